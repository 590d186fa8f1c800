"""Protocols on the drop-in ``mooncake.engine.TransferEngine``, as the original handles them
on a host without RDMA: ``rdma`` runs over tcp (SGLang PD asks for it by default), and
with ``MC_FORCE_TCP`` set to any value every protocol does (SGLang's ``mooncake_tcp``
transfer backend sets it); a protocol neither covers is an error code."""

from __future__ import annotations

import pytest

from mooncake.engine import TransferEngine


def moves_bytes(target_protocol: str, initiator_protocol: str) -> None:
    target, initiator = TransferEngine(), TransferEngine()
    try:
        assert target.initialize("127.0.0.1", "P2PHANDSHAKE", target_protocol, "mlx5_0") == 0
        assert initiator.initialize("127.0.0.1", "P2PHANDSHAKE", initiator_protocol, "") == 0
        dst = target.allocate_managed_buffer(4096)
        src = initiator.allocate_managed_buffer(4096)
        assert initiator.write_bytes_to_buffer(src, b"moved", 5) == 0
        name = f"127.0.0.1:{target.get_rpc_port()}"
        assert initiator.transfer_sync_write(name, src, dst, 5) == 0
        assert target.read_bytes_from_buffer(dst, 5) == b"moved"
    finally:
        initiator.close()
        target.close()


def test_rdma_runs_over_tcp(monkeypatch):
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    moves_bytes("rdma", "tcp")


def test_an_unknown_protocol_is_an_error_code(monkeypatch):
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    assert TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "efa", "") < 0


@pytest.mark.parametrize("value", ["1", "", "0"])  # the original only asks whether it is set
def test_force_tcp_covers_every_protocol(monkeypatch, value):
    monkeypatch.setenv("MC_FORCE_TCP", value)
    moves_bytes("efa", "nvlink")
