"""``concat_arrays_into``: a gather copy of arrays to an address (``mooncake._fast_copy``).

The native version (``_native.fast_copy``, GIL released, optionally threaded) is used when
built and ``MOONCAKE_PUREPYTHON`` is not 1; otherwise a Python version with the same
arguments, checks and errors copies through :mod:`.memory` (``nthreads`` is then
ignored). ``IMPLEMENTATION`` says which: ``"native"`` or ``"python"``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..config import PURE_PYTHON
from . import memory

log = logging.getLogger(__name__)


def _py_concat_arrays_into(arrays: list, dest_ptr: int, dest_size: int, start: int = 0,
                           count: int = -1, nthreads: int = 1) -> int:
    """Copy ``arrays[start:start+count]`` back to back to ``dest_ptr``; return the bytes copied.

    Raises:
        TypeError: ``arrays`` is not a list, or an item exports no buffer.
        ValueError: an item is not C-contiguous, or the bytes exceed ``dest_size``.
        OverflowError: a negative ``dest_ptr`` or ``dest_size``.
    """
    if not isinstance(arrays, list):
        raise TypeError(f"arrays must be a list, not {type(arrays).__name__}")
    if dest_ptr < 0 or dest_size < 0:
        raise OverflowError("dest_ptr and dest_size must be non-negative")
    start = min(max(start, 0), len(arrays))
    if count < 0 or count > len(arrays) - start:
        count = len(arrays) - start
    sources: list[tuple[int, int]] = []
    for i in range(start, start + count):
        try:
            view = memoryview(arrays[i])
        except TypeError:
            raise TypeError(f"arrays[{i}] is not an array (a {type(arrays[i]).__name__} "
                            "exports no buffer)") from None
        with view:
            if not view.c_contiguous:
                raise ValueError(f"arrays[{i}] is not C-contiguous")
            nbytes = view.nbytes
        sources.append((memory.address_of(arrays[i])[0] if nbytes else 0, nbytes))
    total = sum(n for _, n in sources)
    if total > dest_size:
        raise ValueError(f"destination buffer too small: need {total} bytes, got {dest_size}")
    copies, offset = [], 0
    for address, nbytes in sources:
        if nbytes:
            copies.append((dest_ptr + offset, address, nbytes))
            offset += nbytes
    memory.copy_many(copies)
    return total


def _pick() -> tuple[Callable[..., int], str]:
    if not PURE_PYTHON:
        try:
            from .._native.fast_copy import concat_arrays_into as native
            return native, "native"
        except ImportError as exc:  # pragma: no cover - depends on the build
            log.warning("native fast_copy unavailable (%s); using the Python version", exc)
    return _py_concat_arrays_into, "python"


concat_arrays_into: Any
concat_arrays_into, IMPLEMENTATION = _pick()

__all__ = ["IMPLEMENTATION", "concat_arrays_into"]
