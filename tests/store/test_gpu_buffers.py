"""The store's zero-copy calls on GPU memory, over the CUDA driver TEST DOUBLE
(tests/cuda_double.py: it proves the path, not CUDA; tests/gpu runs on a GPU).

A client registers "device" buffers, puts from them and gets into them; the holders'
segments are host memory of this process, so the bytes go through CUDA copies (cuda_ipc's
in-process path, or the staged paths' pinned bounce buffers), never a CPU copy of device
memory. Calls that need a CPU view of the buffer (the SSD tier's copy) refuse it with a
clear error.
"""

from __future__ import annotations

import ctypes
import os

import pytest
from cuda_double import double  # noqa: F401  (the fixture)

from mooncake_plugins.errors import InvalidArgument, InvalidParams
from mooncake_plugins.store.client import ReplicateConfig, StoreClient

N = (3 << 20) + 777


@pytest.fixture
def clients(master, double):
    a = StoreClient(master.address, global_segment_size=16 << 20)
    b = StoreClient(master.address, global_segment_size=16 << 20)
    yield a, b
    a.close()
    b.close()


def test_put_from_and_get_into_device_buffers(clients, double):
    a, b = clients
    src, dst = double.alloc(N), double.alloc(N, device=1)
    pattern = os.urandom(N)
    ctypes.memmove(src, pattern, N)  # the double's device memory is host memory
    a.register_buffer(src, N)
    b.register_buffer(dst, N)
    a.put_from("gpu-kv", src, N, ReplicateConfig(replica_num=2))
    assert b.get_into("gpu-kv", dst, N) == N
    assert double.view(dst, N) == pattern
    assert a.get("gpu-kv") == pattern  # and read into host memory like any object
    for d, s, n in double.copy_log:  # every CUDA copy has device memory at one end
        assert double._find(d) or double._find(s)
    assert sum(n for _, _, n in double.copy_log) >= 3 * N  # two replicas out, one in
    # batch forms, several objects from slices of one device buffer
    keys = [f"blk-{i}" for i in range(4)]
    size = N // 4
    assert a.batch_put_from(keys, [src + i * size for i in range(4)], [size] * 4) == [None] * 4
    ctypes.memmove(dst, bytes(N), N)
    assert b.batch_get_into(keys, [dst + (3 - i) * size for i in range(4)], [size] * 4) == [size] * 4
    got = double.view(dst, 4 * size)
    for i in range(4):
        assert got[(3 - i) * size:(4 - i) * size] == pattern[i * size:(i + 1) * size]
    b.unregister_buffer(dst)
    a.unregister_buffer(src)


def test_no_cpu_view_of_device_memory(clients, double):
    a, _ = clients
    dev = double.alloc(1 << 20)
    a.register_buffer(dev, 1 << 20)
    with pytest.raises(InvalidArgument, match="GPU memory .* the CPU has no view of it"):
        a.local_view(dev, 4096)
    a.unregister_buffer(dev)


def test_a_holder_lends_gpu_memory(master, double):
    """A holder whose segment is device memory (``segment_location="cuda:0"``): objects
    put by a client land there through CUDA copies, are read back equal, and the memory is
    freed when the holder closes; a location that is not cpu or cuda:N is refused."""
    holder = StoreClient(master.address, global_segment_size=8 << 20, segment_location="cuda:0")
    (base,) = [a for a, (n, *_rest) in double.allocs.items() if n == 8 << 20]
    client = StoreClient(master.address, global_segment_size=0)
    try:
        data = os.urandom(3 << 20)
        double.copy_log.clear()
        client.put("on-gpu", data)
        assert client.get("on-gpu") == data
        assert any(base <= d < base + (8 << 20) for d, _, _ in double.copy_log), \
            "the bytes were copied into the holder's device memory by CUDA"
        (replica,) = client.locate(["on-gpu"]).found[0][1]
        assert all(base <= s[1] < base + (8 << 20) for s in replica)
    finally:
        client.close()
        holder.close()
    assert base not in double.allocs, "the device memory was freed with the holder"
    with pytest.raises(InvalidParams, match="segment_location 'gpu0'"):
        StoreClient(master.address, global_segment_size=1 << 20, segment_location="gpu0")
