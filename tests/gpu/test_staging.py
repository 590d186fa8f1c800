"""GPU memory over tcp and shm, staged through pinned memory, on a real GPU (marker
``cuda``).

A target process lends 64 MiB of host memory (or, over tcp, device memory, which its tcp
server stages); this process writes it from device memory in 4 MiB requests over one
host-only transport alone (so a staged path is the only one), the target hashes what
landed, and the bytes are read back into device memory and compared.
"""

from __future__ import annotations

import hashlib

import pytest
from peers import TARGET, Target

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.transfer import TransferEngine, cuda, memory
from mooncake_plugins.transfer.batch import OpCode, TransferRequest

pytestmark = pytest.mark.cuda

MIB = 1 << 20
TOTAL = 64 * MIB
REQUEST = 4 * MIB


@pytest.mark.parametrize("transport,target", [("tcp", "host"), ("shm", "host"), ("tcp", "gpu")])
def test_device_memory_to_a_peers_memory_and_back(transport: str, target: str) -> None:
    with Target(TARGET % ([transport], TOTAL, target == "gpu")) as peer_proc:
        segment, remote = peer_proc.segment, peer_proc.address
        src = bytes((i * 131 + 7) % 251 for i in range(4096)) * (TOTAL // 4096)
        with TransferEngine(config=EngineConfig(transports=[transport])) as eng, \
                cuda.DeviceBuffer(TOTAL) as dev:
            staging = bytearray(src)  # kept alive across the copy
            cuda.copy(dev.address, memory.address_of(staging)[0], TOTAL)
            eng.register_address(dev.address, TOTAL)
            peer = eng.open_segment(segment)
            kinds = ("cuda", "cuda" if target == "gpu" else "host")
            assert [type(t).__name__ for t in eng._paths(peer, None, kinds)] == ["Staged"]
            eng.submit(segment, [TransferRequest(OpCode.WRITE, dev.address + off, remote + off,
                                                 REQUEST) for off in range(0, TOTAL, REQUEST)]).wait(120)
            assert peer_proc.ask("hash") == hashlib.sha256(src).hexdigest()
            with cuda.DeviceBuffer(TOTAL) as back:
                eng.register_address(back.address, TOTAL)
                eng.submit(segment, [TransferRequest(OpCode.READ, back.address + off,
                                                     remote + off, REQUEST)
                                     for off in range(0, TOTAL, REQUEST)]).wait(120)
                host = bytearray(TOTAL)
                cuda.copy(memory.address_of(host)[0], back.address, TOTAL)
                assert host == src
                eng.unregister(back.address)
            eng.unregister(dev.address)
