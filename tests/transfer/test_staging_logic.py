"""Local GPU memory over the host-only transports (tcp, shm), staged through pinned
memory (transports/staging.py), over the CUDA driver TEST DOUBLE (cuda_double.py: it
proves the path choice, the grouping and that every device byte passes through a pinned
bounce buffer, not CUDA; tests/gpu runs the same on a GPU)."""

from __future__ import annotations

import ctypes
import os

import pytest
from helpers import wait_until

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.errors import TransportUnavailable
from mooncake_plugins.transfer import TransferEngine, memory
from mooncake_plugins.transfer.transports import staging

from cuda_double import double  # noqa: F401  (the fixture)

N = (10 << 20) + 12345  # three groups of a 4 MiB half, and a ragged end


def _pair(transport: str) -> tuple[TransferEngine, TransferEngine]:
    cfg = dict(transports=[transport], slice_nbytes=256 << 10, inline_nbytes=0, workers=2)
    return TransferEngine(config=EngineConfig(**cfg)), TransferEngine(config=EngineConfig(**cfg))


def _staged_copies(double, dev: int, nbytes: int, to_device: bool) -> int:
    """Bytes copied between ``dev`` and the double's pinned buffers, each copy checked to
    have one end in device memory and the other in a pinned buffer."""
    total = 0
    for dst, src, n in double.copy_log:
        device_end, host_end = (dst, src) if to_device else (src, dst)
        assert dev <= device_end and device_end + n <= dev + nbytes, "a copy outside the buffer"
        assert double.is_pinned(host_end, n), "device bytes went through pageable memory"
        total += n
    return total


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_gpu_memory_to_and_from_a_peers_host_memory(double, transport):
    a, b = _pair(transport)
    try:
        dev = double.alloc(N)
        a.register_address(dev, N)  # "*": found to be cuda:0 from the pointer
        assert a.regions()[0].location == "cuda:0"
        pattern = os.urandom(N)
        host = bytearray(N)
        b.register(host)
        host_addr = memory.address_of(host)[0]
        ctypes.memmove(dev, pattern, N)  # the double's device memory is host memory

        a.write(b.segment_name, dev, host_addr, N)
        assert bytes(host) == pattern
        assert _staged_copies(double, dev, N, to_device=False) == N

        double.copy_log.clear()
        fresh = os.urandom(N)
        host[:] = fresh
        a.read(b.segment_name, dev, host_addr, N)
        assert double.view(dev, N) == fresh
        assert _staged_copies(double, dev, N, to_device=True) == N
        # one bounce buffer per worker thread that staged, two halves each
        assert 1 <= len(double.pinned) <= 2
        assert all(buf.nbytes == 2 * staging.HALF_NBYTES for buf in double.pinned)
    finally:
        a.close()
        b.close()
    assert all(buf.closed for buf in double.pinned), "the engine freed its bounce buffers"


@pytest.mark.parametrize("local_kind", ["host", "gpu"])
def test_a_peers_gpu_memory_over_tcp_is_staged_by_its_server(double, local_kind):
    """The target's tcp server receives a WRITE into its GPU region, and answers a READ
    from it, through pinned memory; from local GPU memory both sides stage."""
    a, b = _pair("tcp")
    try:
        remote = double.alloc(N, device=1)
        b.register_address(remote, N)
        if local_kind == "gpu":
            local = double.alloc(N)
            a.register_address(local, N)
        else:
            buf = bytearray(N)
            local = a.register(buf).address
        pattern = os.urandom(N)
        ctypes.memmove(local, pattern, N)
        a.write(b.segment_name, local, remote, N)
        assert double.view(remote, N) == pattern
        ctypes.memmove(local, bytes(N), N)
        a.read(b.segment_name, local, remote, N)
        assert double.view(local, N) == pattern
        # every copy ran between GPU memory and a pinned buffer; the server's covered the
        # remote region twice (in, then out), the initiator's its own buffer twice
        moved = {remote: 0, local: 0}
        for dst, src, n in double.copy_log:
            dev, pinned = (dst, src) if double.is_pinned(src, n) else (src, dst)
            assert double.is_pinned(pinned, n), "device bytes went through pageable memory"
            base = remote if remote <= dev < remote + N else local
            assert base <= dev and dev + n <= base + N
            moved[base] += n
        assert moved == {remote: 2 * N, local: 2 * N if local_kind == "gpu" else 0}
    finally:
        a.close()
        b.close()
    # the server's connection threads free theirs as they end, just after close()
    assert wait_until(lambda: all(buf.closed for buf in double.pinned), 5.0)


def test_groups_cut_slices_at_half_boundaries():
    half = 100
    slices = [(0, 2, 1000, 5000, 60), (1, 2, 2000, 6000, 130), (2, 1, 3000, 7000, 50),
              (3, 1, 4000, 8000, 0)]
    runs = staging._groups(slices, half)
    assert [op for op, _ in runs] == [2, 1]
    writes = runs[0][1]
    assert [sum(s[4] for s in g) for g in writes] == [100, 90]
    # a slice cut across groups keeps its addresses contiguous
    assert writes[0] == [(0, 2, 1000, 5000, 60), (1, 2, 2000, 6000, 40)]
    assert writes[1] == [(1, 2, 2040, 6040, 90)]
    assert runs[1][1] == [[(2, 1, 3000, 7000, 50)]]
