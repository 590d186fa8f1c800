"""Peers that die mid-batch: the initiator gets a clean failure, never a hang."""

import os
import signal
import time

import pytest

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.errors import TransferError
from mooncake_plugins.transfer import OpCode, TransferEngine, TransferRequest, TransferStatus


@pytest.mark.parametrize("transports", [["tcp"], ["shm", "tcp"]], ids=["tcp", "shm"])
def test_peer_killed_mid_batch(spawn_peer, transports):
    nbytes = 64 << 20
    peer = spawn_peer("--nbytes", str(nbytes), "--plain")
    cfg = EngineConfig(transports=transports, slice_nbytes=1 << 20, workers=2,
                       transfer_timeout_s=10, retries=1)
    with TransferEngine(config=cfg) as e:
        local = e.allocate(nbytes)
        reqs = [TransferRequest(OpCode.READ, local.address, peer.address, nbytes)] * 40
        batch = e.submit(peer.segment, reqs)  # ~2.5 GiB: still running when the peer dies
        os.kill(peer.proc.pid, signal.SIGKILL)
        peer.proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            batch.wait(60)
        assert time.monotonic() - t0 < 30
        assert batch.status() == TransferStatus.FAILED
        # the engine is still usable for others afterwards
        with TransferEngine(config=EngineConfig(transports=transports)) as other:
            buf = other.allocate(4096)
            e.read(other.segment_name, local.address, buf.address, 4096)


def test_unreachable_peer_fails_fast():
    with TransferEngine(config=EngineConfig(transports=["tcp"])) as e:
        with TransferEngine(config=EngineConfig(transports=["tcp"])) as gone:
            name = gone.segment_name
            buf = gone.allocate(4096)
            e.open_segment(name)
        local = e.allocate(4096)
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            e.read(name, local.address, buf.address, 4096, timeout_s=30)
        assert time.monotonic() - t0 < 5  # a refused connection, not the 30 s timeout
