"""Raw memory helpers: buffer -> address, address -> memoryview, copies.

Native (``_native.buffers``) when built, else an honest ctypes fallback with the same
names. Callers pass only addresses that ``segment.py`` has already bounds-checked.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

from ..config import PURE_PYTHON
from ..errors import InvalidArgument

log = logging.getLogger(__name__)

_native: Any = None
if not PURE_PYTHON:
    try:
        from .._native import buffers as _native
    except ImportError as exc:  # pragma: no cover - depends on the build
        log.warning("native buffers unavailable (%s); using the ctypes fallback", exc)


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

    def release(self) -> None:
        self._mv.release()


def _py_view(address: int, nbytes: int, readonly: bool = False) -> memoryview:
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    mv = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
    return mv.toreadonly() if readonly else mv


def _py_copy(dst: int, src: int, nbytes: int) -> None:
    ctypes.memmove(dst, src, nbytes)


def _py_copy_many(copies: list[tuple[int, int, int]]) -> None:
    for dst, src, nbytes in copies:
        ctypes.memmove(dst, src, nbytes)


def _py_empty_bytes(nbytes: int) -> bytearray:
    # No honest way to fill a bytes object from Python: callers get a bytearray and copy.
    return bytearray(nbytes)


if _native is not None:
    Export = _native.Export
    view = _native.view
    copy = _native.copy
    copy_many = _native.copy_many
    empty_bytes = _native.empty_bytes
    IMPLEMENTATION = "native"
else:
    Export = _PyExport  # type: ignore[assignment,misc]
    view = _py_view
    copy = _py_copy
    copy_many = _py_copy_many
    empty_bytes = _py_empty_bytes
    IMPLEMENTATION = "python"


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
