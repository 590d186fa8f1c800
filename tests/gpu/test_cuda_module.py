"""The CUDA module on a real GPU: pointer attributes, pinned memory, copies, events, IPC.

Every copy is checked byte for byte. The IPC test exports an allocation here and maps it
in a second process, which reads what we wrote and writes what we then read.
"""

from __future__ import annotations

import importlib
import json
import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mooncake_plugins.errors import InvalidArgument
from mooncake_plugins.transfer import cuda, memory

pytestmark = pytest.mark.cuda

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def _pattern(nbytes: int, seed: int) -> bytes:
    block = bytes((i * 131 + seed) % 251 for i in range(4096))
    return (block * (nbytes // 4096 + 1))[:nbytes]


def _fill(buf: object, data: bytes) -> None:
    with memoryview(buf) as view:  # type: ignore[arg-type]
        view[:len(data)] = data


def _read(buf: object, nbytes: int, offset: int = 0) -> bytes:
    with memoryview(buf) as view:  # type: ignore[arg-type]
        return bytes(view[offset:offset + nbytes])


def test_driver_and_device() -> None:
    info = cuda.driver_info()
    assert info.version >= 12000 and info.device_count >= 1
    assert cuda.device_name(0)
    bus = cuda.device_pci_bus_id(0)
    assert len(bus.split(":")) == 3 and bus == bus.lower()
    assert cuda.why_unavailable() == ""


def test_pointer_attributes_of_device_memory() -> None:
    with cuda.DeviceBuffer(3 * MIB) as dev:
        for address in (dev.address, dev.address + 12345, dev.address + 3 * MIB - 1):
            info = cuda.pointer_info(address)
            assert (info.kind, info.device, info.location) == ("cuda", 0, "cuda:0")
            assert info.base == dev.address and info.nbytes >= 3 * MIB
            assert info.ipc_capable and not info.pinned and not info.managed
        assert memory.kind_of(dev.address, 3 * MIB) == "cuda"
        assert memory.location_of(dev.address + 5) == "cuda:0"
        assert memory.resolve_location(dev.address, MIB, "*") == "cuda:0"
        assert memory.resolve_location(dev.address, MIB, "cuda") == "cuda:0"
        with pytest.raises(InvalidArgument, match="is CUDA memory"):
            memory.resolve_location(dev.address, MIB, "cpu")
        with pytest.raises(InvalidArgument, match="runs past its CUDA allocation"):
            memory.kind_of(dev.address + MIB, 4 * MIB)


def test_pointer_attributes_of_host_memory() -> None:
    buf = bytearray(MIB)
    address, nbytes = memory.address_of(buf)
    info = cuda.pointer_info(address)
    assert (info.kind, info.pinned, info.location) == ("host", False, "cpu")
    assert memory.kind_of(address, nbytes) == "host"
    pinned = cuda.pinned_buffer(2 * MIB)
    try:
        info = cuda.pointer_info(pinned.address + 100)
        assert (info.kind, info.pinned) == ("host", True)
        if info.nbytes:  # the range attributes of pinned memory: reported by CUDA 12+ drivers
            assert info.base == pinned.address and info.nbytes >= 2 * MIB
        assert memory.kind_of(pinned.address, 2 * MIB) == "host"
    finally:
        pinned.close()
    with pytest.raises(InvalidArgument, match="not CUDA device memory"):
        cuda.export_ipc(address)


def test_pinned_buffer_refuses_close_with_a_view() -> None:
    pinned = cuda.pinned_buffer(MIB)
    view = memoryview(pinned)
    with pytest.raises(BufferError):
        pinned.close()
    view.release()
    pinned.close()
    assert pinned.closed


@pytest.mark.parametrize("nbytes", [4096, 4 * MIB + 3, 64 * MIB])
def test_async_copies_h2d_d2d_d2h(nbytes: int) -> None:
    data = _pattern(nbytes, 7)
    src = cuda.pinned_buffer(nbytes)
    dst = cuda.pinned_buffer(nbytes)
    try:
        _fill(src, data)
        with cuda.DeviceBuffer(nbytes) as a, cuda.DeviceBuffer(nbytes) as b, \
                cuda.Stream() as stream, cuda.Event(timing=True) as start, \
                cuda.Event(timing=True) as end:
            start.record(stream)
            cuda.copy_async(a.address, src.address, nbytes, stream)   # H2D
            cuda.copy_async(b.address, a.address, nbytes, stream)     # D2D
            cuda.copy_async(dst.address, b.address, nbytes, stream)   # D2H
            end.record(stream)
            end.synchronize()
            assert end.query() and stream.query()
            assert start.elapsed_ms(end) > 0
        assert _read(dst, nbytes) == data
    finally:
        src.close()
        dst.close()


def test_pageable_copy_and_sync_copy() -> None:
    data = _pattern(MIB, 3)
    src = bytearray(data)
    out = bytearray(MIB)
    s_addr, _ = memory.address_of(src)
    o_addr, _ = memory.address_of(out)
    with cuda.DeviceBuffer(MIB) as dev, cuda.Stream() as stream:
        cuda.copy_async(dev.address, s_addr, MIB, stream)  # pageable: staged by CUDA
        stream.synchronize()
        cuda.copy(o_addr, dev.address, MIB)
    assert bytes(out) == data


def test_two_streams_ordered_by_an_event() -> None:
    nbytes = 16 * MIB
    data = _pattern(nbytes, 11)
    host = cuda.pinned_buffer(nbytes)
    back = cuda.pinned_buffer(nbytes)
    try:
        _fill(host, data)
        with cuda.DeviceBuffer(nbytes) as a, cuda.DeviceBuffer(nbytes) as b, \
                cuda.Stream() as first, cuda.Stream() as second, cuda.Event() as done:
            cuda.copy_async(a.address, host.address, nbytes, first)
            done.record(first)
            second.wait(done)  # the D2D below starts after the H2D on the other stream
            cuda.copy_async(b.address, a.address, nbytes, second)
            cuda.copy_async(back.address, b.address, nbytes, second)
            second.synchronize()
        assert _read(back, nbytes) == data
    finally:
        host.close()
        back.close()


def test_registered_host_memory() -> None:
    region = mmap.mmap(-1, 4 * MIB)
    address, nbytes = memory.address_of(region)
    data = _pattern(nbytes, 5)
    region[:] = data
    cuda.pin(address, nbytes)
    try:
        assert cuda.pointer_info(address + 10).pinned
        with cuda.DeviceBuffer(nbytes) as dev, cuda.Stream() as stream:
            cuda.copy_async(dev.address, address, nbytes, stream)
            stream.synchronize()
            region[:] = bytes(nbytes)
            cuda.copy_async(address, dev.address, nbytes, stream)
            stream.synchronize()
        assert region[:] == data
    finally:
        cuda.unpin(address)
    assert not cuda.pointer_info(address).pinned
    region.close()


def test_errors_carry_the_cuda_name() -> None:
    with pytest.raises(cuda.CudaError) as err:
        cuda.DeviceBuffer(1 << 50)  # a petabyte
    assert err.value.cuda_name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert str(err.value).startswith("cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (")
    with pytest.raises(ValueError, match="no CUDA device 99"):
        cuda.Stream(device=99)


CHILD = """
import json, sys
from mooncake_plugins.transfer import cuda

wire = json.loads(sys.argv[1])
wire[0] = bytes.fromhex(wire[0])
offset, nbytes = int(sys.argv[2]), int(sys.argv[3])
handle = cuda.IpcHandle.from_wire(wire)
cache = cuda.IpcCache()
device = cache.local_device(handle)
base = cache.open("parent", handle)
assert cache.open("parent", handle) == base and cache.opened == 1
host = cuda.pinned_buffer(nbytes)
cuda.copy(host.address, base + offset, nbytes, device)
with memoryview(host) as view:
    seen = bytes(view)
    view[:] = bytes(255 - b for b in seen)  # answer with the complement
with cuda.Stream(device) as stream:
    cuda.copy_async(base + offset, host.address, nbytes, stream)
    stream.synchronize()
host.close()
cache.close()
print(json.dumps({"pid_differs": True, "checksum": sum(seen) % 1000003, "device": device}))
"""


def test_ipc_between_two_processes() -> None:
    nbytes = 2 * MIB
    offset = 3 * MIB + 512  # an interior address: the peer maps the base and adds it
    data = _pattern(nbytes, 17)
    with cuda.DeviceBuffer(8 * MIB) as dev:
        cuda.copy(dev.address + offset, memory.address_of(data)[0], nbytes)
        handle = cuda.export_ipc(dev.address + offset)
        assert handle.base == dev.address and handle.nbytes >= 8 * MIB
        wire = handle.to_wire()
        wire[0] = wire[0].hex()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(CHILD), json.dumps(wire), str(offset), str(nbytes)],
            capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
        assert answer["checksum"] == sum(data) % 1000003  # the child read our bytes
        back = bytearray(nbytes)
        cuda.copy(memory.address_of(back)[0], dev.address + offset, nbytes)
    assert bytes(back) == bytes(255 - b for b in data)  # and we read the child's


def _torch_cuda():  # type: ignore[no-untyped-def]
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    return torch


def test_torch_cuda_tensor() -> None:
    torch = _torch_cuda()
    tensor = torch.randint(0, 256, (4 * MIB,), dtype=torch.uint8, device="cuda")
    device_before = torch.cuda.current_device()
    ptr = tensor.data_ptr()
    info = cuda.pointer_info(ptr + 100)
    assert (info.kind, info.device) == ("cuda", tensor.device.index)
    assert info.base <= ptr and ptr + 4 * MIB <= info.base + info.nbytes
    assert memory.tensor_location(tensor) == f"cuda:{tensor.device.index}"
    with pytest.raises(InvalidArgument, match="GPU tensors need the cuda_ipc transport"):
        memory.address_of(tensor)
    out = torch.empty(4 * MIB, dtype=torch.uint8, pin_memory=True)
    with cuda.Stream(tensor.device.index) as stream:
        cuda.copy_async(out.data_ptr(), ptr, 4 * MIB, stream)
        stream.synchronize()
    assert torch.equal(out, tensor.cpu())
    assert torch.cuda.current_device() == device_before
    assert int((tensor + 1).sum().item()) > 0  # torch still works in its context
