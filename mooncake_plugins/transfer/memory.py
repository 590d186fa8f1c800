"""Raw memory helpers: buffer -> address, address -> memoryview, copies.

Native (``_native.buffers``) when built, else an honest ctypes fallback with the same
names. Callers pass only addresses that ``segment.py`` has already bounds-checked.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from typing import Any

from ..config import PURE_PYTHON
from ..errors import InvalidArgument

log = logging.getLogger(__name__)

_native: Any = None
try:
    from .._native import buffers as _native
except ImportError as exc:  # pragma: no cover - depends on the build
    if not PURE_PYTHON:
        log.warning("native buffers unavailable (%s); using the ctypes fallback", exc)


_libc = ctypes.CDLL(None, use_errno=True)  # ctypes drops the GIL around each call
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
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


def view_of(keep: Any, address: int, nbytes: int, readonly: bool = False) -> memoryview:
    """A user-facing view of registered memory that keeps it mapped while the view lives.

    ``keep`` is what holds the memory: an :class:`Export` (the view counts as one of its
    exports, so a release waits for the view) or any other owner (a tensor), which the
    view references. ``view`` above is the raw form for the data path's internal use.
    """
    if isinstance(keep, _PyExport) or (_native is not None and isinstance(keep, _native.Export)):
        if keep.released:
            raise BufferError("the registration behind this memory was released")
        start = address - keep.address
        mv = keep[start:start + nbytes] if isinstance(keep, _PyExport) \
            else memoryview(keep)[start:start + nbytes]
        return mv.toreadonly() if readonly and not mv.readonly else mv
    if IMPLEMENTATION == "native":
        return memoryview(_native.Window(address, nbytes, readonly, keep))
    return _py_view(address, nbytes, readonly, keep)


def address_of(obj: Any) -> tuple[int, int]:
    """Return ``(address, nbytes)`` of a contiguous buffer or a CPU torch tensor (not held)."""
    ptr = getattr(obj, "data_ptr", None)
    if callable(ptr):  # torch.Tensor without importing torch
        if getattr(getattr(obj, "device", None), "type", "cpu") != "cpu":
            raise InvalidArgument("GPU tensors need the cuda_ipc transport; pass a CPU tensor")
        if not obj.is_contiguous():
            raise InvalidArgument("tensor is not contiguous")
        return int(ptr()), int(obj.numel() * obj.element_size())
    exp = Export(obj)
    try:
        return exp.address, exp.nbytes
    finally:
        exp.release()
