"""A TEST DOUBLE of the native CUDA module (``_native.cuda``), for tests without a GPU.

``CudaDriverDouble``'s "device memory" is memfd-backed HOST memory, its IPC handles name
that memfd, ``ipc_open`` maps the same memfd again (a true alias, so copies through a
mapping land in the exporter's memory and can be checked), ``memcpy_async`` is a memmove
(recorded), pinned host buffers are plain mmaps, events complete at once. It proves the
engine's bookkeeping (locations, wire form, path choice, handle lifetimes, staging), not
CUDA: tests/gpu runs the same paths on a real GPU. The ``double`` fixture installs it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import threading

import pytest

from mooncake_plugins.transfer import cuda

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_SHARED, _MAP_FIXED = 0x01, 0x10
_PROT = mmap.PROT_READ | mmap.PROT_WRITE
_HANDLE = struct.Struct("<4sIiQ")  # magic, pid, memfd, serial (padded to 64 bytes)


class CudaDriverDouble:
    """TEST DOUBLE of ``_native.cuda``: host memory plays device memory (see the module
    docstring). Records opens, closes, copies and synchronisations."""

    def __init__(self, devices: int = 2) -> None:
        self.bus_ids = [f"0000:{0x18 + d:02x}:00.0" for d in range(devices)]
        self.allocs: dict[int, tuple[int, int, int, int]] = {}  # base -> nbytes, device, fd, serial
        self.opens: list[tuple[bytes, int]] = []
        self.closes: list[int] = []
        self.copies = 0
        self.syncs = 0
        self._maps: dict[int, int] = {}  # address opened by ipc_open -> nbytes
        self._serial = 0
        self._streams = 0
        self._events = 0
        self.copy_log: list[tuple[int, int, int]] = []  # (dst, src, nbytes) of every copy
        self.pinned: list[_PinnedDouble] = []
        self._lock = threading.Lock()

    # memory the double hands out ("device memory")
    def alloc(self, nbytes: int, device: int = 0, at: int | None = None) -> int:
        fd = os.memfd_create("cuda-double", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        addr = _libc.mmap(at, nbytes, _PROT, _MAP_SHARED | (_MAP_FIXED if at else 0), fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        self._serial += 1
        self.allocs[addr] = (nbytes, device, fd, self._serial)
        return addr

    def free(self, base: int, keep_range: bool = False) -> None:
        nbytes, _, fd, _ = self.allocs.pop(base)
        if not keep_range:
            _libc.munmap(base, nbytes)
        os.close(fd)

    # the driver calls DeviceBuffer makes
    def mem_alloc(self, nbytes: int, device: int) -> int:
        return self.alloc(nbytes, device)

    def mem_free(self, address: int, device: int) -> None:
        self.free(address)

    def close_all(self) -> None:
        for base in list(self.allocs):
            self.free(base)
        for addr, n in list(self._maps.items()):
            _libc.munmap(addr, n)
        self._maps.clear()
        for buf in self.pinned:
            buf.close()

    def view(self, address: int, nbytes: int) -> bytes:
        return ctypes.string_at(address, nbytes)

    def _find(self, address: int) -> tuple[int, tuple[int, int, int, int]] | None:
        for base, rec in self.allocs.items():
            if base <= address < base + rec[0]:
                return base, rec
        return None

    # the native module's interface
    def device_count(self) -> int:
        return len(self.bus_ids)

    def device_pci_bus_id(self, device: int) -> str:
        return self.bus_ids[device]

    def pointer_attributes(self, address: int) -> tuple:
        found = self._find(address)
        if found is None:
            return (0, 0, False, 0, 0, False)
        base, (nbytes, device, _, _) = found
        return (2, device, False, base, nbytes, True)

    def address_range(self, address: int, device: int) -> tuple[int, int]:
        found = self._find(address)
        assert found is not None
        return found[0], found[1][0]

    def ipc_get_handle(self, base: int, device: int) -> bytes:
        _, _, fd, serial = self.allocs[base]
        return _HANDLE.pack(b"DBL!", os.getpid(), fd, serial).ljust(cuda.IPC_HANDLE_NBYTES, b"\0")

    def ipc_open(self, handle: bytes, device: int) -> int:
        magic, pid, fd, _ = _HANDLE.unpack_from(handle)
        assert magic == b"DBL!"
        ofd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        try:
            nbytes = os.fstat(ofd).st_size
            addr = _libc.mmap(None, nbytes, _PROT, _MAP_SHARED, ofd, 0)
        finally:
            os.close(ofd)
        with self._lock:
            self.opens.append((handle, device))
            self._maps[addr] = nbytes
        return addr

    def ipc_close(self, address: int, device: int) -> None:
        with self._lock:
            self.closes.append(address)
            _libc.munmap(address, self._maps.pop(address))

    def stream_create(self, device: int) -> int:
        with self._lock:
            self._streams += 1
            return self._streams

    def stream_destroy(self, stream: int, device: int) -> None:
        pass

    def stream_synchronize(self, stream: int, device: int) -> None:
        with self._lock:
            self.syncs += 1

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int, device: int) -> None:
        with self._lock:
            self.copies += 1
            self.copy_log.append((dst, src, nbytes))
        ctypes.memmove(dst, src, nbytes)

    def memcpy(self, dst: int, src: int, nbytes: int, device: int) -> None:
        self.memcpy_async(dst, src, nbytes, 0, device)

    def event_create(self, device: int, timing: bool) -> int:
        with self._lock:
            self._events += 1
            return self._events

    def event_record(self, event: int, stream: int, device: int) -> None:
        pass

    def event_synchronize(self, event: int, device: int) -> None:
        pass

    def event_query(self, event: int, device: int) -> bool:
        return True

    def event_destroy(self, event: int, device: int) -> None:
        pass

    def HostBuffer(self, nbytes: int, device: int = 0) -> "_PinnedDouble":  # noqa: N802
        buf = _PinnedDouble(nbytes)
        with self._lock:
            self.pinned.append(buf)
        return buf

    def is_pinned(self, address: int, nbytes: int) -> bool:
        """Whether ``[address, address+nbytes)`` lies in a pinned buffer of the double."""
        return any(b.address <= address and address + nbytes <= b.address + b.nbytes
                   for b in self.pinned)


class _PinnedDouble:
    """Stands in for the native ``HostBuffer`` (pinned memory): an anonymous mapping."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._map.close()


@pytest.fixture
def double(monkeypatch: pytest.MonkeyPatch):
    """The double installed as the process's CUDA driver (restored afterwards)."""
    drv = CudaDriverDouble()
    monkeypatch.setattr(cuda, "_native", drv)
    monkeypatch.setattr(cuda, "_state", "ready")
    monkeypatch.setattr(cuda, "_info", cuda.DriverInfo("double", 12080, drv.device_count()))
    monkeypatch.setattr(cuda, "_driver_seen", True)
    yield drv
    drv.close_all()
