"""GPU paths at size and under faults, on a real GPU (marker ``cuda``).

- cuda_ipc between two processes moves 1 GiB in 4 MiB requests, WRITE then READ, every
  byte compared on both sides;
- a peer killed (SIGKILL) while a batch into or out of GPU memory runs: the batch ends,
  within seconds, each request completed or failed with the engine's error, never a hang,
  and the engine goes on with another peer;
- a peer unregistering and freeing the GPU memory a batch is writing: the batch ends the
  same way, and the peer lives on (no write landed in memory that changed hands).
"""

from __future__ import annotations

import hashlib
import textwrap
import time

import pytest
from peers import Target

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.errors import MooncakeError
from mooncake_plugins.transfer import TransferEngine, cuda, memory
from mooncake_plugins.transfer.batch import OpCode, TransferRequest

pytestmark = pytest.mark.cuda

MIB, GIB = 1 << 20, 1 << 30
REQUEST = 4 * MIB

# A target lending ``nbytes`` of device memory: answers "hash" (sha256 of it), "free"
# (unregister, then free it: "freed"), anything else ends it ("bye").
GPU_TARGET = textwrap.dedent("""
    import hashlib, sys
    from mooncake_plugins.config import EngineConfig
    from mooncake_plugins.transfer import TransferEngine, cuda, memory
    eng = TransferEngine(config=EngineConfig(transports=%r))
    dev = cuda.DeviceBuffer(%d)
    eng.register_address(dev.address, dev.nbytes)
    print(eng.segment_name, dev.address, flush=True)
    for line in sys.stdin:
        word = line.strip()
        if word == "hash":
            host = bytearray(dev.nbytes)
            cuda.copy(memory.address_of(host)[0], dev.address, dev.nbytes)
            print(hashlib.sha256(host).hexdigest(), flush=True)
        elif word == "free":
            eng.unregister(dev.address)
            dev.close()
            dev = None
            print("freed", flush=True)
        else:
            break
    eng.close()
    if dev is not None:
        dev.close()
    print("bye", flush=True)
""")


def pattern(nbytes: int, seed: int) -> bytearray:
    block = bytes((i * 131 + seed) % 251 for i in range(1 << 16))
    return bytearray((block * (nbytes // len(block) + 1))[:nbytes])


def requests(op: OpCode, local: int, remote: int, total: int) -> list[TransferRequest]:
    return [TransferRequest(op, local + off, remote + off, REQUEST)
            for off in range(0, total, REQUEST)]


def ended_cleanly(batch, timeout_s: float = 30.0) -> list:
    """The batch's errors, once it ended (an assertion when it did not within the time)."""
    t0 = time.monotonic()
    assert batch.wait_done(timeout_s), f"the batch still ran after {timeout_s} s"
    errors = [e for e in batch.errors() if e is not None]
    assert all(isinstance(e, MooncakeError) for e in errors), errors[:3]
    return errors + [time.monotonic() - t0]


def test_cuda_ipc_moves_1_gib_in_4_mib_requests() -> None:
    with Target(GPU_TARGET % (["cuda_ipc"], GIB)) as target, \
            TransferEngine(config=EngineConfig(transports=["cuda_ipc"])) as eng, \
            cuda.DeviceBuffer(GIB) as src, cuda.DeviceBuffer(GIB) as back:
        data = pattern(GIB, 3)
        cuda.copy(src.address, memory.address_of(data)[0], GIB)
        eng.register_address(src.address, GIB)
        eng.register_address(back.address, GIB)
        t0 = time.perf_counter()
        eng.submit(target.segment, requests(OpCode.WRITE, src.address, target.address,
                                            GIB)).wait(120)
        write_s = time.perf_counter() - t0
        assert target.ask("hash") == hashlib.sha256(data).hexdigest()
        t0 = time.perf_counter()
        eng.submit(target.segment, requests(OpCode.READ, back.address, target.address,
                                            GIB)).wait(120)
        read_s = time.perf_counter() - t0
        assert memory.read_bytes(back.address, GIB) == data
        print(f"cuda_ipc 1 GiB: WRITE {GIB / write_s / 1e9:.1f} GB/s, "
              f"READ {GIB / read_s / 1e9:.1f} GB/s")
        eng.unregister(src.address)
        eng.unregister(back.address)


@pytest.mark.parametrize("transports", [["cuda_ipc"], ["tcp"]])
def test_a_peer_killed_mid_transfer_ends_the_batch(transports: list[str]) -> None:
    victim = Target(GPU_TARGET % (transports, GIB))
    try:
        with TransferEngine(config=EngineConfig(transports=transports)) as eng, \
                cuda.DeviceBuffer(GIB) as mine:
            eng.register_address(mine.address, GIB)
            batch = eng.submit(victim.segment, requests(OpCode.READ, mine.address,
                                                        victim.address, GIB))
            victim.proc.kill()
            victim.proc.wait(30)
            *errors, seconds = ended_cleanly(batch)
            print(f"{transports}: peer killed: {len(errors)} of {GIB // REQUEST} requests "
                  f"failed, the batch ended {seconds:.2f} s after")
            # the engine goes on: a fresh peer is written whole
            with Target(GPU_TARGET % (transports, 64 * MIB)) as fresh:
                eng.submit(fresh.segment, requests(OpCode.WRITE, mine.address, fresh.address,
                                                   64 * MIB)).wait(60)
                assert fresh.ask("hash") == hashlib.sha256(
                    memory.read_bytes(mine.address, 64 * MIB)).hexdigest()
            eng.unregister(mine.address)
    finally:
        if victim.proc.poll() is None:
            victim.proc.kill()
            victim.proc.wait()


@pytest.mark.parametrize("transports", [["cuda_ipc"], ["tcp"]])
def test_gpu_memory_freed_mid_transfer_ends_the_batch(transports: list[str]) -> None:
    with Target(GPU_TARGET % (transports, GIB)) as target, \
            TransferEngine(config=EngineConfig(transports=transports)) as eng, \
            cuda.DeviceBuffer(GIB) as src:
        eng.register_address(src.address, GIB)
        batch = eng.submit(target.segment, requests(OpCode.WRITE, src.address,
                                                    target.address, GIB))
        assert target.ask("free") == "freed"
        *errors, seconds = ended_cleanly(batch)
        print(f"{transports}: memory freed: {len(errors)} of {GIB // REQUEST} requests "
              f"failed, the batch ended {seconds:.2f} s after")
        # nothing more reaches it: the region is gone (refused at submit or on the batch)
        try:
            late = eng.submit(target.segment, requests(OpCode.WRITE, src.address,
                                                       target.address, REQUEST))
            assert late.wait_done(30) and late.error() is not None
        except MooncakeError:
            pass
        eng.unregister(src.address)
    # leaving the block asked the target to exit: it said "bye" and ended with status 0
