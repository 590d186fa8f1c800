"""GPU registration and the cuda_ipc transport, over a driver TEST DOUBLE (no GPU here).

``CudaDriverDouble`` (tests/cuda_double.py) stands in for ``_native.cuda``: it
proves the engine's and the transport's bookkeeping (locations, wire form, path choice,
handles opened once, closed on forget and re-registration), not CUDA:
tests/gpu/test_cuda_ipc.py runs the same paths on a real GPU.

Engines of this process reach each other in-process; ``_pretend_other_process`` makes
the initiator's cuda_ipc take the cross-process path (handles, epoch page) instead.
"""

from __future__ import annotations

import logging

import msgpack
import pytest

from mooncake_plugins.config import DEFAULT_TRANSPORTS, EngineConfig
from mooncake_plugins.errors import (AddressError, InvalidArgument, ProtocolError,
                                     TransportUnavailable)
from mooncake_plugins.transfer import TransferEngine, cuda, memory
from mooncake_plugins.transfer.batch import OpCode, TransferRequest
from mooncake_plugins.transfer.segment import Region, RegionInfo, RegionTable, SegmentDescriptor
from mooncake_plugins.transfer.transports import registry

from cuda_double import CudaDriverDouble, double  # noqa: F401  (the fixture)


N = 64 << 10
SLICE = 4096


def _engines(*transports: str, **kw):
    cfg = dict(transports=list(transports or ("cuda_ipc", "shm", "tcp")), slice_nbytes=SLICE,
               inline_nbytes=0, workers=2)
    cfg.update(kw)
    return TransferEngine(config=EngineConfig(**cfg)), TransferEngine(config=EngineConfig(**cfg))


def _ipc(engine: TransferEngine):
    return next(t for t in engine._transports if t.name == "cuda_ipc")


def _pretend_other_process(engine: TransferEngine) -> None:
    """The initiator's cuda_ipc treats same-pid peers as other processes (handles, epoch)."""
    _ipc(engine)._own_pid = -1


def _host(n: int = N, fill: bytes = b"\0") -> tuple[bytearray, int]:
    buf = bytearray(fill * n)
    return buf, memory.address_of(buf)[0]


def _wire_roundtrip(desc: SegmentDescriptor) -> SegmentDescriptor:
    return SegmentDescriptor.from_wire(msgpack.unpackb(msgpack.packb(desc.to_wire(),
                                                                     use_bin_type=True), raw=False))


# -- registration ----------------------------------------------------------------------------

def test_star_resolves_to_the_device_and_publishes_the_handle(double) -> None:
    a, b = _engines()
    try:
        dev = double.alloc(N, device=1)
        region = b.register_address(dev + 4096, N - 4096)
        info = region.info
        assert info.location == "cuda:1" and region.device
        assert info.ipc is not None and info.ipc.base == dev and info.ipc.nbytes == N
        assert info.ipc.bus_id == double.bus_ids[1] and info.generation > 0
        host_buf, host_addr = _host()
        host_region = b.register(host_buf)
        assert host_region.info.location == "cpu" and host_region.info.ipc is None
        assert not host_region.device
        back = _wire_roundtrip(b.descriptor())
        assert back.regions == b.descriptor().regions
        # a host region keeps the five-field wire form of before
        wire = b.descriptor().to_wire()["regions"]
        assert sorted(len(r) for r in wire) == [5, 7]
    finally:
        a.close()
        b.close()


def test_gpu_registration_keeps_the_host_rules(double) -> None:
    a, b = _engines()
    try:
        dev = double.alloc(N, device=1)
        b.register_address(dev, N // 2)
        with pytest.raises(InvalidArgument, match="overlaps"):
            b.register_address(dev + 4096, 4096)
        with pytest.raises(InvalidArgument, match="runs past its CUDA allocation"):
            b.register_address(dev + N // 2, N)
        with pytest.raises(InvalidArgument, match="is CUDA memory"):
            b.register_address(dev + N // 2, 4096, location="cpu")
        with pytest.raises(InvalidArgument, match="is on cuda:1"):
            b.register_address(dev + N // 2, 4096, location="cuda:0")
        _, host_addr = _host()
        with pytest.raises(InvalidArgument, match="is host memory"):
            b.register_address(host_addr, 4096, location="cuda:1")
        with pytest.raises(InvalidArgument, match="bad location"):
            b.register_address(dev + N // 2, 4096, location="gpu")
        with pytest.raises(InvalidArgument):
            b.register_address(dev + N // 2, 0)
        with pytest.raises(InvalidArgument, match="allocate makes host memory"):
            b.allocate(4096, location="cuda:0")
        with pytest.raises(InvalidArgument, match="the CPU has no view of it"):
            b.local_view(dev, 16)
        # the tcp server and same-process shm copies never touch GPU memory
        with pytest.raises(AddressError, match="only the cuda_ipc transport"):
            b._regions.acquire(dev, 16, remote=True)
        held = b._regions.acquire(dev, 16, remote=True, device=True)
        assert held.device
        b._regions.release(held)
    finally:
        a.close()
        b.close()


class _CudaTensor:
    """TEST DOUBLE of a torch CUDA tensor (only what the engine reads)."""

    def __init__(self, address: int, nbytes: int, device: str) -> None:
        self._address, self._nbytes, self.device = address, nbytes, device

    def data_ptr(self) -> int:
        return self._address

    def is_contiguous(self) -> bool:
        return True

    def numel(self) -> int:
        return self._nbytes

    def element_size(self) -> int:
        return 1


def test_register_a_cuda_tensor(double) -> None:
    a, b = _engines()
    try:
        dev = double.alloc(N, device=1)
        tensor = _CudaTensor(dev, N, "cuda:1")
        region = b.register(tensor)
        assert region.info.location == "cuda:1" and region.keepalive is tensor
        assert region.info.ipc is not None
        b.unregister(region)
        with pytest.raises(InvalidArgument, match="is on cuda:1"):
            b.register(_CudaTensor(dev, N, "cuda:0"))
    finally:
        a.close()
        b.close()


def test_register_a_cuda_tensor_without_cuda_says_why() -> None:
    if cuda.available():
        pytest.skip("CUDA works here")
    a = TransferEngine(config=EngineConfig(transports=["tcp"]))
    try:
        with pytest.raises(InvalidArgument, match=r"CUDA tensor \(cuda:0\) needs CUDA, and "):
            a.register(_CudaTensor(0x7000_0000_0000, N, "cuda:0"))
    finally:
        a.close()


@pytest.mark.parametrize("field,value,error", [
    (6, ["short" * 4, 0, "0000:18:00.0", 0x10000, N], "IPC handle"),
    (6, [b"x" * 65, 0, "0000:18:00.0", 0x10000, N], "IPC handle"),
    (6, [b"x" * 64, 0, "0000:18:00.0", 0x10000], "IPC handle"),
    (6, [b"x" * 64, True, "0000:18:00.0", 0x10000, N], "IPC handle"),
    (6, [b"x" * 64, 0, "0000:18:00.0", 0x20000, N], "outside its IPC allocation"),
    (6, "handle", "IPC handle"),
    (5, 0, "malformed GPU region"),
    (5, "1", "malformed GPU region"),
    (5, True, "malformed GPU region"),
    (2, "cpu", "malformed GPU region"),
])
def test_descriptor_rejects_a_malformed_gpu_region(field: int, value: object, error: str) -> None:
    good = [0x10000, N, "cuda:0", -1, False, 3, [b"x" * 64, 0, "0000:18:00.0", 0x10000, N]]
    desc = SegmentDescriptor("s", "127.0.0.1", 1234, 99, "h", regions=[]).to_wire()
    desc["regions"] = [good]
    assert SegmentDescriptor.from_wire(desc).regions[0].ipc.base == 0x10000
    bad = list(good)
    bad[field] = value
    desc["regions"] = [bad]
    with pytest.raises(ProtocolError, match=error):
        SegmentDescriptor.from_wire(desc)
    desc["regions"] = [good[:6]]
    with pytest.raises(ProtocolError, match="malformed region"):
        SegmentDescriptor.from_wire(desc)


# -- path choice -----------------------------------------------------------------------------

def test_gpu_requests_go_to_cuda_ipc_and_host_stays_with_shm(double) -> None:
    a, b = _engines()
    try:
        assert [t.name for t in a._transports] == ["cuda_ipc", "shm", "tcp"]
        peer = a.open_segment(b.segment_name)
        # after cuda_ipc: tcp (its server stages a GPU target), local GPU memory through
        # the staged forms of shm and tcp (transports/staging.py)
        def paths(kinds):
            return [(t.name, type(t).__name__) for t in a._paths(peer, None, kinds)]
        assert paths(("host", "cuda")) == [("cuda_ipc", "CudaIpcTransport"),
                                           ("tcp", "TcpTransport")]
        assert paths(("cuda", "cuda")) == [("cuda_ipc", "CudaIpcTransport"), ("tcp", "Staged")]
        assert paths(("cuda", "host")) == [("cuda_ipc", "CudaIpcTransport"), ("shm", "Staged"),
                                           ("tcp", "Staged")]
        assert [t.name for t in a._paths(peer, None, ("host", "host"))] == ["shm", "tcp"]
    finally:
        a.close()
        b.close()


def test_gpu_memory_without_a_cuda_transport_is_transport_unavailable(double) -> None:
    a, b = _engines("shm")  # shm copies with the CPU: a peer's GPU memory is out of reach
    try:
        dev = double.alloc(N)
        b.register_address(dev, N)
        src, src_addr = _host(fill=b"s")
        a.register(src)
        with pytest.raises(TransportUnavailable,
                           match="no transport moves host memory here to or from cuda memory"):
            a.write(b.segment_name, src_addr, dev, N)
        assert double.view(dev, N) == bytes(N)
    finally:
        a.close()
        b.close()


# -- the transport ---------------------------------------------------------------------------

def test_in_process_peer_is_copied_directly(double) -> None:
    a, b = _engines()
    try:
        dev = double.alloc(N)
        b.register_address(dev, N)
        src, src_addr = _host(fill=b"p")
        a.register(src)
        a.write(b.segment_name, src_addr, dev, N)
        assert double.view(dev, N) == bytes(src)
        assert double.opens == []  # CUDA cannot open a handle its own process exported
    finally:
        a.close()
        b.close()


def test_a_handle_is_opened_once_for_many_slices(double) -> None:
    a, b = _engines()
    try:
        _pretend_other_process(a)
        dev = double.alloc(N, device=1)
        b.register_address(dev, N)
        src, src_addr = _host(fill=b"w")
        a.register(src)
        syncs = double.syncs
        batch = a.submit(b.segment_name, [TransferRequest(OpCode.WRITE, src_addr + off, dev + off,
                                                          N // 4)
                                          for off in range(0, N, N // 4)])
        batch.wait(10)
        assert double.view(dev, N) == bytes(src)
        assert len(double.opens) == 1 and double.opens[0][1] == 1  # mapped into cuda:1
        assert double.copies >= N // SLICE
        assert double.syncs - syncs <= a.config.workers  # once per batch and thread
        back, back_addr = _host()
        a.register(back)
        a.read(b.segment_name, back_addr, dev, N)
        assert back == src and len(double.opens) == 1
        # device to device: a's own GPU memory
        mine = double.alloc(N, device=0)
        a.register_address(mine, N)
        a.read(b.segment_name, mine, dev, N)
        assert double.view(mine, N) == bytes(src) and len(double.opens) == 1
    finally:
        a.close()
        b.close()


def test_forget_closes_the_peers_handles(double) -> None:
    a, b = _engines()
    try:
        _pretend_other_process(a)
        dev = double.alloc(N)
        b.register_address(dev, N)
        src, src_addr = _host(fill=b"f")
        a.register(src)
        a.write(b.segment_name, src_addr, dev, N)
        assert len(double.opens) == 1 and double.closes == []
        a.close_segment(b.segment_name)
        assert len(double.closes) == 1 and len(_ipc(a)._cache) == 0
        a.write(b.segment_name, src_addr, dev, N)  # opened again on next use
        assert len(double.opens) == 2
    finally:
        a.close()
        b.close()
    assert len(double.closes) == 2  # close() unmaps the rest


def test_reregistered_allocation_gets_a_new_handle(double) -> None:
    """b frees its allocation and gets new memory at the same address: a's next write
    must land in the new memory (never through the old mapping) and the old one closes."""
    a, b = _engines()
    try:
        _pretend_other_process(a)
        dev = double.alloc(N)
        first = b.register_address(dev, N)
        src, src_addr = _host(fill=b"1")
        a.register(src)
        a.write(b.segment_name, src_addr, dev, N)
        old_generation = first.info.generation
        b.unregister(dev)
        double.free(dev, keep_range=True)
        assert double.alloc(N, at=dev) == dev  # new memory (a new memfd) at the same address
        second = b.register_address(dev, N)
        assert second.info.generation != old_generation
        src[:] = b"2" * N
        a.write(b.segment_name, src_addr, dev, N)
        assert double.view(dev, N) == b"2" * N  # landed in the new memory
        assert len(double.opens) == 2 and len(double.closes) == 1
        # a region registered again (same memory, new generation) is a new handle too
        b.unregister(dev)
        b.register_address(dev, N)
        a.write(b.segment_name, src_addr, dev, N)
        assert len(double.opens) == 3 and len(double.closes) == 2
    finally:
        a.close()
        b.close()


def test_unregistered_gpu_memory_is_refused(double) -> None:
    a, b = _engines()
    try:
        _pretend_other_process(a)
        dev = double.alloc(N)
        b.register_address(dev, N)
        src, src_addr = _host(fill=b"u")
        a.register(src)
        a.write(b.segment_name, src_addr, dev, N)
        b.unregister(dev)
        with pytest.raises(AddressError):
            a.write(b.segment_name, src_addr, dev, N)
        # refused against the fresh descriptor, which no longer publishes the handle: closed
        assert len(double.closes) == 1
        other = double.alloc(N)
        b.register_address(other, N)
        a.write(b.segment_name, src_addr, other, N)
        assert len(double.closes) == 1
    finally:
        a.close()
        b.close()


# -- without CUDA ------------------------------------------------------------------------------

def test_without_cuda_cuda_ipc_is_unavailable_with_the_reason(caplog) -> None:
    if cuda.available():
        pytest.skip("CUDA works here")
    with pytest.raises(TransportUnavailable,
                       match=r"^transport 'cuda_ipc' is unavailable here: (no CUDA|CUDA needs)"):
        registry.build_transport("cuda_ipc")
    assert "cuda_ipc" in DEFAULT_TRANSPORTS and EngineConfig().transports == list(DEFAULT_TRANSPORTS)
    with caplog.at_level(logging.DEBUG, logger="mooncake_plugins"):
        quiet = TransferEngine(config=EngineConfig())
        quiet.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [t.name for t in quiet._transports] == ["shm", "tcp"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mooncake_plugins"):
        loud = TransferEngine(config=EngineConfig(transports=["cuda_ipc", "tcp"]))
        loud.close()
    assert any("transport cuda_ipc disabled: transport 'cuda_ipc' is unavailable here"
               in r.getMessage() for r in caplog.records)


def test_region_device_flag_follows_the_location() -> None:
    table = RegionTable()
    host = table.add(Region(RegionInfo(0x1000, 4096, "cpu")))
    gpu = table.add(Region(RegionInfo(0x10000, 4096, "cuda:0", generation=1)))
    assert not host.device and gpu.device
    with pytest.raises(AddressError, match="GPU memory"):
        table.acquire_many([(0x1000, 16), (0x10000, 16)], remote=True)
    assert table.acquire(0x1000, 16, remote=True) is host
    table.release(host)


def test_an_event_records_on_our_stream_or_a_frameworks_raw_handle(double, monkeypatch) -> None:
    recorded = []
    monkeypatch.setattr(double, "event_record",
                        lambda event, stream, device: recorded.append((stream, device)))
    with cuda.Stream(0) as ours, cuda.Event(1) as event:
        event.record(ours)
        event.record(0x7F00)      # torch: torch.cuda.current_stream().cuda_stream
        event.record(0)           # the legacy default stream
        for bad in ("0x7f00", -1, None, True):
            with pytest.raises(InvalidArgument, match="not a CUDA stream"):
                event.record(bad)
    assert recorded == [(ours.handle, 1), (0x7F00, 1), (0, 1)]
