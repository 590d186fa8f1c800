"""Raw memory helpers: buffer -> address, address -> memoryview, copies, memory kinds.

Native (``_native.buffers``) when built, else an honest ctypes fallback with the same
names. Callers pass only addresses that ``segment.py`` has already bounds-checked.

Kinds and locations (:func:`kind_of`, :func:`location_of`, :func:`resolve_location`,
:func:`tensor_location`): ``"host"``/``"cpu"`` or ``"cuda"``/``"cuda:N"``, asked of CUDA
(``cuda.py``) only when a CUDA driver is loaded in this process; without one, an address
that is not mapped here (a device pointer, a typo) is an InvalidArgument, never a crash.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from typing import Any

from ..config import PURE_PYTHON
from ..errors import InvalidArgument
from . import cuda

log = logging.getLogger(__name__)

_native: Any = None
try:
    from .._native import buffers as _native
except ImportError as exc:  # pragma: no cover - depends on the build
    if not PURE_PYTHON:
        log.warning("native buffers unavailable (%s); using the ctypes fallback", exc)


_libc = ctypes.CDLL(None, use_errno=True)  # ctypes drops the GIL around each call
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MS_ASYNC = 1


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_MADV_POPULATE = {False: 22, True: 23}  # MADV_POPULATE_READ / _WRITE, Linux 5.14+
_PAGE = mmap.PAGESIZE


def populate(address: int, nbytes: int, write: bool) -> int:
    """Fault in the pages of a mapped range in one call, readable or writable (contents
    untouched); 0, or the errno (EINVAL: a kernel without it; ENOMEM: no memory left)."""
    start = address & ~(_PAGE - 1)
    if _libc.madvise(start, address + nbytes - start, _MADV_POPULATE[write]) == 0:
        return 0
    return ctypes.get_errno()


class _PyExport:
    """Fallback of ``_native.buffers.Export``: a held memoryview and its address."""

    def __init__(self, obj: Any, writable: bool = False) -> None:
        mv = memoryview(obj)
        if not mv.contiguous:
            mv.release()
            raise BufferError("buffer is not contiguous")
        mv = mv.cast("B")
        if writable and mv.readonly:
            mv.release()
            raise BufferError("buffer is read-only")
        self.readonly = mv.readonly
        self._mv = mv
        if mv.nbytes == 0:
            self.address = 0
        elif not mv.readonly:
            self.address = ctypes.addressof(ctypes.c_char.from_buffer(mv))
        else:
            # A read-only buffer has no ctypes route; numpy reads its data pointer.
            import numpy as np

            self.address = int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)
        self.nbytes = mv.nbytes
        self.released = False

    def __getitem__(self, key: slice) -> memoryview:
        """A view of the held memory; it keeps the export alive (memoryview slices share it)."""
        if self.released:
            raise BufferError("the registration behind this memory was released")
        return self._mv[key]

    def release(self) -> None:
        """Give the export back once no view of it is alive (views keep it until then)."""
        if not self.released:
            self.released = True
            self._mv.release()


def _py_view(address: int, nbytes: int, readonly: bool = False, owner: Any = None) -> memoryview:
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    window = (ctypes.c_char * nbytes).from_address(address)
    window._owner = owner  # the view holds the window, the window its owner
    mv = memoryview(window).cast("B")
    return mv.toreadonly() if readonly else mv


def _py_copy(dst: int, src: int, nbytes: int) -> None:
    ctypes.memmove(dst, src, nbytes)


def _py_copy_many(copies: list[tuple[int, int, int]]) -> None:
    for dst, src, nbytes in copies:
        ctypes.memmove(dst, src, nbytes)


def _py_empty_bytes(nbytes: int) -> bytearray:
    # No honest way to fill a bytes object from Python: callers get a bytearray and copy.
    return bytearray(nbytes)


Export: Any
view: Any
copy: Any
copy_many: Any
empty_bytes: Any
IMPLEMENTATION = ""


def use(native: bool) -> None:
    """Bind this module's functions to the native module or to the ctypes fallback."""
    global Export, view, copy, copy_many, empty_bytes, IMPLEMENTATION
    if native and _native is None:
        raise ImportError("the native buffers module is not built (pip install -e .)")
    src: Any = _native if native else None
    Export = src.Export if src else _PyExport
    view = src.view if src else _py_view
    copy = src.copy if src else _py_copy
    copy_many = src.copy_many if src else _py_copy_many
    empty_bytes = src.empty_bytes if src else _py_empty_bytes
    IMPLEMENTATION = "native" if native else "python"


use(_native is not None and not PURE_PYTHON)


def is_export(keep: Any) -> bool:
    """Whether ``keep`` is an :class:`Export` (memory of a buffer-protocol object: the CPU's)."""
    return isinstance(keep, _PyExport) or (_native is not None and isinstance(keep, _native.Export))


def view_of(keep: Any, address: int, nbytes: int, readonly: bool = False) -> memoryview:
    """A user-facing view of registered memory that keeps it mapped while the view lives.

    ``keep`` is what holds the memory: an :class:`Export` (the view counts as one of its
    exports, so a release waits for the view) or any other owner (a tensor), which the
    view references. ``view`` above is the raw form for the data path's internal use.
    """
    if is_export(keep):
        if keep.released:
            raise BufferError("the registration behind this memory was released")
        start = address - keep.address
        mv = keep[start:start + nbytes] if isinstance(keep, _PyExport) \
            else memoryview(keep)[start:start + nbytes]
        return mv.toreadonly() if readonly and not mv.readonly else mv
    if IMPLEMENTATION == "native":
        return memoryview(_native.Window(address, nbytes, readonly, keep))
    return _py_view(address, nbytes, readonly, keep)


def address_of(obj: Any, allow_cuda: bool = False) -> tuple[int, int]:
    """Return ``(address, nbytes)`` of a contiguous buffer or a torch tensor (not held).

    Args:
        allow_cuda: accept a CUDA tensor (the engine's ``register``: where CUDA works).

    Raises:
        InvalidArgument: a GPU tensor unless ``allow_cuda``; a CUDA tensor where CUDA does
            not work (the message says why); another device type.
    """
    ptr = getattr(obj, "data_ptr", None)
    if callable(ptr):  # torch.Tensor without importing torch
        device_type, index = _tensor_device(obj)
        if device_type == "cuda":
            _require_cuda(f"a CUDA tensor (cuda:{index})")
        if device_type != "cpu" and not (allow_cuda and device_type == "cuda"):
            raise InvalidArgument("GPU tensors need the cuda_ipc transport; pass a CPU tensor")
        if not obj.is_contiguous():
            raise InvalidArgument("tensor is not contiguous")
        return int(ptr()), int(obj.numel() * obj.element_size())
    exp = Export(obj)
    try:
        return exp.address, exp.nbytes
    finally:
        exp.release()


# -- memory kinds and locations ------------------------------------------------------------

HOST = "host"
CUDA = "cuda"


def _tensor_device(obj: Any) -> tuple[str, int]:
    """``(type, index)`` of a torch-like tensor's device, without importing torch:
    ``device`` may be a ``torch.device``, a string such as ``"cuda:1"``, or absent
    (then ``is_cuda`` decides)."""
    device = getattr(obj, "device", None)
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        return kind, int(index) if index.isdigit() else 0
    if device is not None and isinstance(getattr(device, "type", None), str):
        index = getattr(device, "index", None)
        return device.type, index if isinstance(index, int) else 0
    return (CUDA, 0) if getattr(obj, "is_cuda", False) is True else ("cpu", -1)


def _require_cuda(what: str) -> None:
    """InvalidArgument naming ``what`` and the reason when CUDA does not work here."""
    if not cuda.available():
        raise InvalidArgument(f"{what} needs CUDA, and {cuda.why_unavailable()}")


def _readable(address: int) -> bool:
    """Whether one byte at ``address`` can be read (process_vm_readv on ourselves: EFAULT,
    no signal, for unmapped or PROT_NONE memory such as CUDA's address reservations)."""
    byte = ctypes.c_char()
    local = _IoVec(ctypes.addressof(byte), 1)
    remote = _IoVec(address, 1)
    if _libc.process_vm_readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == 1:
        return True
    return ctypes.get_errno() in (errno.ENOSYS, errno.EPERM)  # a sandbox forbids the probe


def _host_mapped(address: int, nbytes: int) -> bool:
    """Whether ``[address, address + nbytes)`` is mapped in this process (msync reports
    ENOMEM for any unmapped page; MS_ASYNC makes it a lookup only) and its ends readable."""
    start = address & ~(_PAGE - 1)
    end = address + max(nbytes, 1)
    if end > 1 << 64 or start == 0:
        return False
    if _libc.msync(start, end - start, _MS_ASYNC) != 0:
        return False
    return _readable(address) and _readable(end - 1)


def kind_of(address: int, nbytes: int = 0) -> str:
    """``"host"`` or ``"cuda"``: what the memory at ``address`` is.

    CUDA is asked only when a driver is loaded in this process (no CUDA memory exists
    otherwise). Called by the engine on registration, from the registering thread.

    Raises:
        InvalidArgument: not an address; or memory that is neither CUDA memory nor mapped
            here (a device pointer without CUDA is one: the message says why CUDA is off).
    """
    if isinstance(address, bool) or not isinstance(address, int) or not 0 <= address < 1 << 64:
        raise InvalidArgument(f"bad address {address!r}: an int in [0, 2**64)")
    if nbytes < 0 or address + nbytes > 1 << 64:
        raise InvalidArgument(f"bad range 0x{address:x} + {nbytes}")
    if cuda.driver_in_process() and cuda.available():
        info = cuda.pointer_info(address)
        if info.kind == CUDA:
            if info.nbytes and address + nbytes > info.base + info.nbytes:
                raise InvalidArgument(
                    f"0x{address:x} + {nbytes} runs past its CUDA allocation "
                    f"(0x{info.base:x} + {info.nbytes} on cuda:{info.device})")
            return CUDA
    if _host_mapped(address, nbytes):
        return HOST
    if not cuda.driver_in_process():
        why = "and no CUDA driver is loaded, so it is no GPU memory either"
    elif cuda.available():
        why = "and CUDA does not know it"
    else:
        why = f"and CUDA cannot be asked: {cuda.why_unavailable()}"
    raise InvalidArgument(f"0x{address:x} + {nbytes} is not readable memory of this process {why}")


def read_bytes(address: int, nbytes: int) -> bytes:
    """``nbytes`` at ``address``, from host memory or GPU memory (through a CUDA copy):
    never a CPU read of device memory, never a fault.

    Raises:
        InvalidArgument: as :func:`kind_of` (memory that is neither, e.g. a bad pointer).
    """
    if kind_of(address, nbytes) == CUDA:
        out = bytearray(nbytes)
        cuda.copy(address_of(out)[0], address, nbytes, cuda.pointer_info(address).device)
        return bytes(out)
    return ctypes.string_at(address, nbytes)


def location_of(address: int, nbytes: int = 0) -> str:
    """The engine's location string of the memory: ``"cpu"`` or ``"cuda:N"`` (as the
    original resolves ``"*"``). Raises InvalidArgument as :func:`kind_of`."""
    if kind_of(address, nbytes) == CUDA:
        return cuda.pointer_info(address).location
    return "cpu"


def resolve_location(address: int, nbytes: int, location: str = "*") -> str:
    """The location to register memory under: ``"*"`` becomes :func:`location_of`; a
    given ``"cpu[:N]"`` or ``"cuda[:N]"`` must match what the memory is.

    Raises:
        InvalidArgument: a bad location string, or one the memory contradicts (a device
            pointer registered as cpu, host memory as cuda, the wrong GPU).
    """
    if location in ("*", "", None):
        return location_of(address, nbytes)
    kind, _, index = location.partition(":")
    if kind not in ("cpu", CUDA) or (index and not index.isdigit()):
        raise InvalidArgument(f"bad location {location!r}: '*', 'cpu', 'cpu:N' or 'cuda:N'")
    actual = kind_of(address, nbytes)
    if kind == "cpu":
        if actual != HOST:
            raise InvalidArgument(f"0x{address:x} is CUDA memory ({location_of(address)}), "
                                  f"registered as {location!r}")
        return location  # cpu:N is a NUMA hint the caller knows better than we do
    if actual != CUDA:
        raise InvalidArgument(f"0x{address:x} is host memory, registered as {location!r}")
    found = location_of(address)
    if index and found != location:
        raise InvalidArgument(f"0x{address:x} is on {found}, registered as {location!r}")
    return found


def tensor_location(obj: Any) -> str:
    """``"cpu"`` or ``"cuda:N"`` of a torch-like tensor, without importing torch.

    Raises:
        InvalidArgument: a CUDA tensor where CUDA does not work (the reason is in the
            message), or another device type.
    """
    device_type, index = _tensor_device(obj)
    if device_type == "cpu":
        return "cpu"
    if device_type == CUDA:
        _require_cuda(f"a CUDA tensor (cuda:{index})")
        return f"cuda:{index}"
    raise InvalidArgument(f"{device_type} tensors are not supported; pass a CPU or CUDA tensor")


def _is_host_location(location: Any) -> bool:
    return location in ("*", "", None, "cpu") or (
        isinstance(location, str) and location[:4] == "cpu:" and location[4:].isdigit())


def registration_location(address: int, nbytes: int, location: Any = "*") -> str:
    """The location the engine registers ``[address, address + nbytes)`` under.

    Host memory costs nothing more than before GPU support: in a process without a CUDA
    driver (no GPU memory can exist there), ``"*"``, ``"cpu"`` or ``"cpu:N"`` is taken at
    the caller's word without touching the memory (``"*"`` becomes ``"cpu"``). With a
    driver loaded, one pointer query decides (:func:`cuda.pointer_info`): GPU memory gets
    ``"cuda:N"`` (checked against a given location and its allocation's end, as
    :func:`resolve_location`); host memory keeps the caller's word, unprobed. An explicit
    ``"cuda[:N]"`` where CUDA does not work is taken at the caller's word, as the original
    takes it (nothing can check it): such a region has no IPC handle, and only a
    transport moving GPU memory is pointed at it (never the tcp server or shm copies).

    Raises:
        InvalidArgument: a bad location, a location the memory contradicts, or GPU memory
            (``cuda`` asked for) where CUDA does not work (the message says why).
    """
    if not isinstance(location, str) and location is not None:
        raise InvalidArgument(f"bad location {location!r}: '*', 'cpu', 'cpu:N' or 'cuda:N'")
    host = _is_host_location(location)
    if host and not cuda.driver_in_process():
        return "cpu" if location in ("*", "", None) else location  # type: ignore[return-value]
    if not host:
        kind, _, index = location.partition(":")  # type: ignore[union-attr]
        if kind != CUDA or (index and not index.isdigit()):
            raise InvalidArgument(f"bad location {location!r}: '*', 'cpu', 'cpu:N' or 'cuda:N'")
        if not cuda.driver_in_process() or not cuda.available():
            return location  # type: ignore[return-value]  # the caller's word, as upstream
        return resolve_location(address, nbytes, location)  # type: ignore[arg-type]
    if not cuda.available():  # a driver is loaded but unusable: no GPU memory reachable
        return resolve_location(address, nbytes, location or "*")
    info = cuda.pointer_info(address)
    if info.kind != CUDA:
        return "cpu" if location in ("*", "", None) else location  # type: ignore[return-value]
    if location not in ("*", "", None):
        raise InvalidArgument(f"0x{address:x} is CUDA memory ({info.location}), "
                              f"registered as {location!r}")
    if info.nbytes and address + nbytes > info.base + info.nbytes:
        raise InvalidArgument(f"0x{address:x} + {nbytes} runs past its CUDA allocation "
                              f"(0x{info.base:x} + {info.nbytes} on {info.location})")
    return info.location
