"""GPU registration and the cuda_ipc transport on a real GPU (marker ``cuda``).

Two processes on one GPU: a target registers 64 MiB of device memory (``"*"`` must
resolve to ``cuda:0`` and publish an IPC handle); this process writes it in 4 MiB requests
from host memory, reads it back into its own device memory and into host memory, and
every byte is compared, on both sides (the target hashes its device memory).
"""

from __future__ import annotations

import hashlib
import textwrap

import pytest
from peers import Target

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.transfer import TransferEngine, cuda, memory
from mooncake_plugins.transfer.batch import OpCode, TransferRequest

pytestmark = pytest.mark.cuda

MIB = 1 << 20
TOTAL = 64 * MIB
REQUEST = 4 * MIB
TRANSPORTS = ["cuda_ipc", "shm", "tcp"]

_TARGET = textwrap.dedent("""
    import hashlib, sys
    from mooncake_plugins.config import EngineConfig
    from mooncake_plugins.transfer import TransferEngine, cuda, memory
    eng = TransferEngine(config=EngineConfig(transports=%r))
    dev = cuda.DeviceBuffer(%d)
    region = eng.register_address(dev.address, dev.nbytes)
    assert region.info.location == "cuda:0", region.info
    assert region.info.ipc is not None
    print(eng.segment_name, dev.address, flush=True)
    for line in sys.stdin:
        if line.strip() == "hash":
            host = bytearray(dev.nbytes)
            cuda.copy(memory.address_of(host)[0], dev.address, dev.nbytes)
            print(hashlib.sha256(host).hexdigest(), flush=True)
        else:
            break
    eng.unregister(dev.address)
    eng.close()
    dev.close()
    print("bye", flush=True)
""")


def _pattern(nbytes: int, seed: int) -> bytes:
    block = bytes((i * 131 + seed) % 251 for i in range(4096))
    return (block * (nbytes // 4096 + 1))[:nbytes]


def test_register_resolves_device_memory_and_publishes_its_handle() -> None:
    with TransferEngine(config=EngineConfig(transports=TRANSPORTS)) as eng, \
            cuda.DeviceBuffer(4 * MIB) as dev:
        assert [t.name for t in eng._transports][0] == "cuda_ipc"
        region = eng.register_address(dev.address + MIB, 2 * MIB)
        assert region.info.location == "cuda:0" and region.device
        assert region.info.ipc is not None and region.info.ipc.base == dev.address
        with pytest.raises(Exception, match="runs past its CUDA allocation"):
            eng.register_address(dev.address + 3 * MIB, 2 * MIB)
        host = bytearray(MIB)
        assert eng.register(host).info.location == "cpu"
        eng.unregister(region)


def test_two_processes_write_and_read_64_mib_in_4_mib_requests() -> None:
    with Target(_TARGET % (TRANSPORTS, TOTAL)) as target:
        segment, remote = target.segment, target.address
        eng = TransferEngine(config=EngineConfig(transports=TRANSPORTS))
        try:
            src = bytearray(_pattern(TOTAL, 7))
            src_addr = eng.register(src).address
            peer = eng.open_segment(segment)
            assert [t.name for t in eng._paths(peer, None, ("host", "cuda"))] == ["cuda_ipc"]
            eng.submit(segment, [TransferRequest(OpCode.WRITE, src_addr + off, remote + off,
                                                 REQUEST)
                                 for off in range(0, TOTAL, REQUEST)]).wait(60)
            assert target.ask("hash") == hashlib.sha256(src).hexdigest()
            # device to device, into our own GPU memory
            with cuda.DeviceBuffer(TOTAL) as mine:
                eng.register_address(mine.address, TOTAL)
                eng.submit(segment, [TransferRequest(OpCode.READ, mine.address + off,
                                                     remote + off, REQUEST)
                                     for off in range(0, TOTAL, REQUEST)]).wait(60)
                back = bytearray(TOTAL)
                cuda.copy(memory.address_of(back)[0], mine.address, TOTAL)
                assert back == src
                eng.unregister(mine.address)
            # device to host
            host_back = bytearray(TOTAL)
            host_addr = eng.register(host_back).address
            eng.submit(segment, [TransferRequest(OpCode.READ, host_addr + off, remote + off,
                                                 REQUEST)
                                 for off in range(0, TOTAL, REQUEST)]).wait(60)
            assert host_back == src
            ipc = next(t for t in eng._transports if t.name == "cuda_ipc")
            assert ipc._cache.opened == 1  # one handle for every slice
        finally:
            eng.close()
