"""tcp multi-path on loopback addresses (127.0.0.x all reach this host): a target that
publishes several addresses is written over all of them, and a path that dies mid-transfer
hands its slices to the others; the bytes are always compared. Rate-limited links and links
taken down between network namespaces are in test_multipath_netns.py."""

from __future__ import annotations

import os
import threading
import time

import pytest
from helpers import wait_until

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.errors import ProtocolError
from mooncake_plugins.transfer import OpCode, TransferEngine, TransferRequest
from mooncake_plugins.transfer.segment import SegmentDescriptor

MIB = 1 << 20
PATHS = ["127.0.0.2", "127.0.0.3"]


def engines(pause_s: float = 30.0, workers: int = 4):
    target = TransferEngine("127.0.0.1", config=EngineConfig(transports=["tcp"],
                                                            tcp_paths=PATHS))
    initiator = TransferEngine("127.0.0.1", config=EngineConfig(
        transports=["tcp"], workers=workers, connections_per_peer=4, path_pause_s=pause_s,
        transfer_timeout_s=5.0, slice_nbytes=MIB))
    return target, initiator


def write_all(initiator, target, src, dst, total, block=4 * MIB):
    initiator.submit(target.segment_name, [
        TransferRequest(OpCode.WRITE, src.address + off, dst.address + off, block)
        for off in range(0, total, block)]).wait(60)


def test_the_target_publishes_every_path_and_serves_on_each():
    target, initiator = engines()
    with target, initiator:
        desc = initiator.open_segment(target.segment_name).refresh()
        assert desc.paths == tuple(PATHS) and desc.host == "127.0.0.1"
        total = 64 * MIB
        src, dst = initiator.allocate(total), target.allocate(total)
        data = os.urandom(total)
        initiator.local_view(src.address, total)[:] = data
        write_all(initiator, target, src, dst, total)
        assert bytes(target.local_view(dst.address, total)) == data
        stats = initiator.path_stats()
        port = target.rpc_port
        used = {k: v["bytes"] for k, v in stats.items()}
        assert set(used) == {f"{a}:{port}" for a in ["127.0.0.1", *PATHS]}
        assert sum(used.values()) == total
        assert sum(n > 0 for n in used.values()) >= 2, f"one transfer used one path: {used}"
        assert target.stats["bytes_in"] == total   # summed over its three listeners


def test_a_path_that_dies_mid_transfer_hands_its_slices_to_the_others(caplog):
    target, initiator = engines(pause_s=30.0)
    with target, initiator:
        total = 256 * MIB
        src, dst = initiator.allocate(total), target.allocate(total)
        data = os.urandom(total)
        initiator.local_view(src.address, total)[:] = data
        victim = target._servers[1]   # the listener on PATHS[0]
        # close that listener and its connections once bytes flow
        threading.Thread(target=lambda: wait_until(lambda: target.stats["bytes_in"] > 16 * MIB,
                                                   30) and victim.close()).start()
        t0 = time.monotonic()
        write_all(initiator, target, src, dst, total)
        assert bytes(target.local_view(dst.address, total)) == data
        stats = initiator.path_stats()[f"{PATHS[0]}:{target.rpc_port}"]
        assert stats["failures"] >= 1 and stats["paused"]
        assert "its slices go to the other paths" in caplog.text
        # while paused the dead path is left alone: the next transfer avoids it
        before = stats["bytes"]
        write_all(initiator, target, src, dst, 16 * MIB)
        assert initiator.path_stats()[f"{PATHS[0]}:{target.rpc_port}"]["bytes"] == before
        assert time.monotonic() - t0 < 60


def test_a_paused_path_is_tried_again_after_its_pause():
    target, initiator = engines(pause_s=0.2, workers=2)
    with target, initiator:
        total = 32 * MIB
        src, dst = initiator.allocate(total), target.allocate(total)
        key = f"{PATHS[1]}:{target.rpc_port}"
        tcp = next(t for t in initiator._transports if t.name == "tcp")
        write_all(initiator, target, src, dst, total)
        path = tcp._paths[(PATHS[1], target.rpc_port)]
        path.paused_until = time.monotonic() + 0.2   # as after a failure
        before = initiator.path_stats()[key]["bytes"]
        time.sleep(0.3)
        for _ in range(4):
            write_all(initiator, target, src, dst, total)
        assert initiator.path_stats()[key]["bytes"] > before, "back in use after the pause"


@pytest.mark.parametrize("paths", [["not-an-ip"], ["10.0.0.1"] * 17, [1, 2]])
def test_descriptor_paths_are_validated(paths):
    wire = SegmentDescriptor("s", "127.0.0.1", 1234, 1, "h").to_wire()
    wire["paths"] = paths
    with pytest.raises(ProtocolError, match="bad paths"):
        SegmentDescriptor.from_wire(wire)


def test_config_refuses_a_path_that_is_no_address():
    with pytest.raises(ValueError, match="not an IP address"):
        EngineConfig(tcp_paths=["eth0"]).validate()
