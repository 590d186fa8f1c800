"""The rdma fields of the wire, validated like every other: the descriptor's NICs and
per-region rkeys, and the ``rdma_connect`` control message."""

from __future__ import annotations

import msgpack
import pytest

from mooncake_plugins.errors import ProtocolError
from mooncake_plugins.transfer import protocol
from mooncake_plugins.transfer.segment import MAX_RDMA_NICS, RegionInfo, SegmentDescriptor

GID = "0000:0000:0000:0000:0000:ffff:7f00:0001"
NICS = (("mlx5_0", GID, 0, 4096), ("mlx5_1", "fe80::1", 7, 1024))


def descriptor(**changes) -> dict:
    d = SegmentDescriptor("s", "127.0.0.1", 1234, 99, "h", regions=[
        RegionInfo(4096, 8192, "cpu", rkeys=(11, 12)),
        RegionInfo(1 << 20, 4096, "cpu", readonly=True, rkeys=(13, 14)),
        RegionInfo(1 << 21, 4096, "cpu")], rdma=NICS).to_wire()
    d.update(changes)
    return d


def test_nics_and_rkeys_round_trip():
    d = SegmentDescriptor.from_wire(msgpack.unpackb(msgpack.packb(descriptor())))
    assert d.rdma == NICS
    assert [r.rkeys for r in d.regions] == [(11, 12), (13, 14), ()]
    assert d.find(1 << 20, 4096).readonly
    plain = SegmentDescriptor("s", "127.0.0.1", 1234, 99, "h").to_wire()
    assert "rdma" not in plain and SegmentDescriptor.from_wire(plain).rdma == ()


@pytest.mark.parametrize("rdma", [
    [["mlx5_0", "not a gid", 0, 4096]],
    [["mlx5_0", GID, 0, 4000]],
    [["mlx5_0", GID, -1, 4096]],
    [["mlx5_0", GID, 1 << 16, 4096]],
    [["", GID, 0, 4096]],
    [["x" * 65, GID, 0, 4096]],
    [["mlx5_0", GID, 0]],
    [["mlx5_0", GID, True, 4096]],
    ["mlx5_0"],
    [["mlx5_0", GID, 0, 4096]] * (MAX_RDMA_NICS + 1),
    "mlx5_0",
], ids=lambda v: repr(v)[:40])
def test_malformed_nics_are_refused(rdma):
    with pytest.raises(ProtocolError):
        SegmentDescriptor.from_wire(descriptor(rdma=rdma))


@pytest.mark.parametrize("region", [
    [4096, 8192, "cpu", -1, False, 0, None, [11]],              # one key for two NICs
    [4096, 8192, "cpu", -1, False, 0, None, [11, 1 << 32]],     # not 32 bits
    [4096, 8192, "cpu", -1, False, 0, None, [11, -1]],
    [4096, 8192, "cpu", -1, False, 0, None, "11,12"],
    [4096, 8192, "cpu", -1, False, 0, None, []],
    [4096, 8192, "cpu", -1, False, 5, None, [11, 12]],          # a generation on host memory
    [4096, 8192, "cpu", -1, False, 0, None, [11, 12], 0],
], ids=lambda v: repr(v)[:48])
def test_malformed_rkeys_are_refused(region):
    with pytest.raises(ProtocolError):
        SegmentDescriptor.from_wire(descriptor(regions=[region]))


def test_rkeys_without_nics_are_refused():
    wire = descriptor()
    del wire["rdma"]
    with pytest.raises(ProtocolError, match="RDMA NICs"):
        SegmentDescriptor.from_wire(wire)


def control(**fields) -> bytes:
    return msgpack.packb({"cmd": "rdma_connect", **fields}, use_bin_type=True)


def test_rdma_connect_is_accepted_when_well_formed():
    msg = protocol.decode_control(control(segment="a", qps=[[0, 5, 0, GID, 0, 4096],
                                                            [1, (1 << 24) - 1, 7, "fe80::1", 3, 256]]))
    assert msg["qps"][1][1] == (1 << 24) - 1


@pytest.mark.parametrize("qps", [
    [],
    [[0, 0, 0, GID, 0, 4096]],                 # qpn 0
    [[0, 1 << 24, 0, GID, 0, 4096]],           # qpn over 24 bits
    [[0, 5, 1 << 24, GID, 0, 4096]],           # psn over 24 bits
    [[16, 5, 0, GID, 0, 4096]],                # NIC index over 4 bits
    [[0, 5, 0, "nope", 0, 4096]],
    [[0, 5, 0, GID, 0, 4095]],
    [[0, 5, 0, GID, 1 << 16, 4096]],
    [[0, 5, 0, GID, 0]],
    [[0, 5, 0, GID, 0, 4096, 1]],
    [[False, 5, 0, GID, 0, 4096]],
    [[0, 5, 0, GID, 0, 4096]] * (protocol.MAX_CONNECT_QPS + 1),
    "qps",
], ids=lambda v: repr(v)[:40])
def test_malformed_rdma_connect_is_refused(qps):
    with pytest.raises(ProtocolError):
        protocol.decode_control(control(segment="a", qps=qps))


def test_lists_are_refused_in_other_commands():
    with pytest.raises(ProtocolError):
        protocol.decode_control(msgpack.packb({"cmd": "notify", "name": ["a"], "msg": "b"}))
    with pytest.raises(ProtocolError):
        protocol.decode_control(msgpack.packb({"cmd": "ping", "x": [1]}))
