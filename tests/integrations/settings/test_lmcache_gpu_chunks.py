"""Our LMCache connector's chunk mover on memory objects in GPU memory, without LMCache:
over the CUDA TEST DOUBLE (tests/cuda_double.py: its "device memory" is host memory) and
a TEST DOUBLE of LMCache's ``MemoryObj`` (the four attributes the mover reads), since a
torch tensor can only claim to be on CUDA where CUDA exists.

A contiguous chunk in GPU memory moves zero-copy: registered as ``cuda:N`` for the call
(or found in a registered GPU pool), read and written by the engine's CUDA copies, never
by the CPU, and unregistered afterwards.
"""

from __future__ import annotations

import ctypes
import os
from typing import Iterator

import pytest
from cuda_double import double  # noqa: F401  (the fixture)

from mooncake_lmcache.chunks import ChunkIO
from mooncake_plugins.store.client import StoreClient
from mooncake_plugins.store.master import MasterConfig
from mooncake_plugins.store.server import MasterServer, ServerOptions

CHUNK = 256 << 10


class _Device:
    def __init__(self, kind: str, index: int) -> None:
        self.type, self.index = kind, index


class _Raw:
    def __init__(self, device: _Device, contiguous: bool) -> None:
        self.device, self._contiguous = device, contiguous

    def is_contiguous(self) -> bool:
        return self._contiguous


class GpuChunk:
    """TEST DOUBLE of an LMCache MemoryObj whose tensor lives on ``cuda:index``."""

    def __init__(self, address: int, nbytes: int, index: int = 0, contiguous: bool = True):
        self.data_ptr, self._nbytes = address, nbytes
        self.raw_tensor = _Raw(_Device("cuda", index), contiguous)

    def get_size(self) -> int:
        return self._nbytes


def registered(io: ChunkIO) -> int:
    """Memory registered with the client's engine, private registrations included."""
    return len(io.client.engine._regions.regions(include_private=True))


@pytest.fixture
def io(double) -> Iterator[ChunkIO]:
    server = MasterServer(MasterConfig(), ServerOptions(rpc_port=0))
    server.start()
    holder = StoreClient(server.address, global_segment_size=16 << 20)
    client = StoreClient(server.address, global_segment_size=0)
    try:
        yield ChunkIO(client, replica_num=1)
    finally:
        client.close()
        holder.close()
        server.close()


def test_gpu_chunks_move_zero_copy_and_are_unregistered_after(io, double):
    src = [double.alloc(CHUNK, device=1) for _ in range(3)]
    data = [os.urandom(CHUNK) for _ in src]
    for a, d in zip(src, data):
        ctypes.memmove(a, d, CHUNK)
    before = double.copies
    keys = [f"lmcache/gpu@{i}" for i in range(3)]
    assert io.put(keys, [GpuChunk(a, CHUNK, 1) for a in src]) == [None] * 3
    assert double.copies > before, "the engine's CUDA copies read the chunks"
    assert registered(io) == 0, "chunks are registered for the call only"
    dst = [double.alloc(CHUNK, device=1) for _ in src]
    assert io.get(keys, [GpuChunk(a, CHUNK, 1) for a in dst]) == [CHUNK] * 3
    assert [double.view(a, CHUNK) for a in dst] == data
    assert registered(io) == 0


def test_chunks_in_a_registered_gpu_pool_use_the_pool(io, double):
    pool = double.alloc(4 * CHUNK)
    io.register(pool, 4 * CHUNK, "cuda:0")
    ctypes.memmove(pool, b"\x5a" * CHUNK, CHUNK)
    chunk = GpuChunk(pool, CHUNK)
    assert io.zero_copy(chunk)
    assert io.put(["lmcache/pool@0"], [chunk]) == [None]
    into = GpuChunk(pool + 2 * CHUNK, CHUNK)
    assert io.get(["lmcache/pool@0"], [into]) == [CHUNK]
    assert double.view(pool + 2 * CHUNK, CHUNK) == b"\x5a" * CHUNK
    assert registered(io) == 1, "no second registration over the pool"
    io.unregister_all()


def test_a_non_contiguous_gpu_chunk_is_refused_not_read_by_the_cpu(io, double):
    dev = double.alloc(CHUNK)
    bad = GpuChunk(dev, CHUNK, contiguous=False)
    assert not io.zero_copy(bad)
    # staged: the store reads back into it only through a CPU copy, which GPU memory refuses
    ctypes.memmove(dev, b"\x01" * CHUNK, CHUNK)
    assert io.put(["lmcache/host@0"], [GpuChunk(dev, CHUNK)]) == [None]
    (err,) = io.get(["lmcache/host@0"], [bad])
    assert isinstance(err, Exception) and "contiguous host or GPU memory" in str(err)
