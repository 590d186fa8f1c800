"""Member payloads that are not plain bytes, and results that keep pool memory alive.

Writers hand the bundle store, besides bytes-like values:

* :class:`TensorPayload`: a torch tensor, stored with the store's tensor API when it has
  one, else serialized;
* :class:`TensorObjectBuffer`: an already serialized ``[header | data]`` tensor object in
  caller memory (usually a buffer-pool lease), written with ``put_from``;
* :class:`MultiBufferPayload`: several buffers stored back to back as one payload;
* :class:`DirectCopyPayload`: arrays gathered straight into pool memory at write time.

Readers may get :class:`PoolBackedArray` results, views of a pool lease that is released
when the array (and every view of it) is gone, or by ``release_result``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...transfer import fast_copy

concat_arrays_into: Callable[..., int] | None = fast_copy.concat_arrays_into
"""Gather copy of arrays to an address (``transfer.fast_copy``); a patchable hook."""

OWNER_ATTR = "_mooncake_pool_owner"


@dataclass(frozen=True)
class TensorPayload:
    """A torch tensor member."""

    tensor: Any


@dataclass(frozen=True)
class TensorObjectBuffer:
    """A serialized tensor object at ``ptr`` (``size`` bytes) kept alive by ``owner``.

    ``batch_size`` is its row count when it stands for a DataProto field.
    """

    ptr: int
    size: int
    owner: Any
    batch_size: int | None = None

    def __len__(self) -> int:
        if self.batch_size is None:
            raise TypeError("tensor object buffer requires batch_size for DataProto use")
        return self.batch_size


@dataclass(frozen=True)
class MultiBufferPayload:
    """Buffers stored back to back as one payload; ``owners`` keep them alive. With
    ``dtype`` and ``shape`` the payload is read back as that ndarray."""

    buffers: tuple[memoryview, ...]
    owners: tuple[Any, ...] = ()
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.buffers)


@dataclass(frozen=True)
class DirectCopyPayload:
    """C-contiguous arrays copied back to back into pool memory only when written."""

    arrays: list[np.ndarray]
    total_bytes: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return self.total_bytes

    @staticmethod
    def from_flat_arrays(flat_arrays: list[np.ndarray], dtype: Any,
                         total_elems: int) -> "DirectCopyPayload":
        """The payload of ``flat_arrays``: one flat ndarray of ``total_elems`` items."""
        return DirectCopyPayload(flat_arrays, sum(a.nbytes for a in flat_arrays),
                                 np.dtype(dtype).str, (int(total_elems),))


@dataclass(frozen=True)
class RawDestination:
    """Caller memory to read a member into; ``pre_registered`` if the store knows it."""

    ptr: int
    size: int
    owner: Any = None
    pre_registered: bool = False


def tensor_object_buffer(ptr: int, size: int, owner: Any = None,
                         batch_size: int | None = None) -> TensorObjectBuffer:
    """A serialized tensor object in caller memory, to write or to read into."""
    return TensorObjectBuffer(int(ptr), int(size), owner, batch_size)


def raw_destination(ptr: int, size: int, owner: Any = None, *,
                    pre_registered: bool = False) -> RawDestination:
    """Raw caller memory to materialize a member into."""
    return RawDestination(int(ptr), int(size), owner, pre_registered)


class PoolLeaseOwner:
    """Releases a buffer-pool lease once: explicitly, or when garbage collected."""

    def __init__(self, lease: Any) -> None:
        self.lease = lease
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.lease.release()

    def __del__(self) -> None:
        self.release()


def _array_at(ptr: int, nbytes: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return np.ctypeslib.as_array(raw).view(dtype).reshape(shape)


def array_at(ptr: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """An ndarray of ``dtype``/``shape`` over raw memory at ``ptr``."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype=dtype)
    return _array_at(ptr, nbytes, dtype, shape)


class PoolBackedArray(np.ndarray):
    """An ndarray over a pool lease; views share (and keep) the lease's owner."""

    def __new__(cls, owner: PoolLeaseOwner, dtype: np.dtype,
                shape: tuple[int, ...]) -> "PoolBackedArray":
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        array = _array_at(owner.lease.ptr, nbytes, dtype, shape).view(cls)
        setattr(array, OWNER_ATTR, owner)
        return array

    def __array_finalize__(self, obj: Any) -> None:
        if obj is not None:
            setattr(self, OWNER_ATTR, getattr(obj, OWNER_ATTR, None))


class OwnerBackedList(list):
    """Decoded rows that view pool memory, holding its owner."""

    def __init__(self, values: Sequence[Any], owner: Any) -> None:
        super().__init__(values)
        setattr(self, OWNER_ATTR, owner)


class OwnerBackedObjectArray(np.ndarray):
    """An object array of rows viewing pool memory, holding its owner."""

    def __array_finalize__(self, obj: Any) -> None:
        if obj is not None:
            setattr(self, OWNER_ATTR, getattr(obj, OWNER_ATTR, None))

    def tolist(self) -> list[Any]:  # type: ignore[override]
        values = super().tolist()
        owner = getattr(self, OWNER_ATTR, None)
        return values if owner is None else OwnerBackedList(values, owner)


def object_array(values: list[Any]) -> np.ndarray:
    """``values`` as a 1-D object array, keeping any pool owner of its rows."""
    array = np.empty(len(values), dtype=object)
    array[:] = values
    owner = getattr(values, OWNER_ATTR, None) or next(
        (getattr(v, OWNER_ATTR, None) for v in values if v is not None), None)
    if owner is None:
        return array
    result = array.view(OwnerBackedObjectArray)
    setattr(result, OWNER_ATTR, owner)
    return result


def release_owners(result: Any) -> None:
    """Release every pool lease held by arrays anywhere inside ``result`` (once each)."""
    released: set[int] = set()
    visited: set[int] = set()
    stack = [result]
    while stack:
        value = stack.pop()
        owner = getattr(value, OWNER_ATTR, None)
        if owner is not None:
            if id(owner) not in released:
                released.add(id(owner))
                owner.release()
            continue
        if isinstance(value, dict):
            items: Any = value.values()
        elif isinstance(value, (list, tuple)):
            items = value
        elif isinstance(value, np.ndarray) and value.dtype == object:
            items = value.flat
        else:
            continue
        if id(value) not in visited:
            visited.add(id(value))
            stack.extend(items)


def bytes_view(value: Any, name: str) -> memoryview:
    """``value`` as a flat byte view (a copy only when it is not contiguous)."""
    try:
        view = memoryview(value)
    except TypeError:
        raise TypeError(f"{name} must be bytes-like, got {type(value).__name__}") from None
    if not view.contiguous:
        view = memoryview(view.tobytes())
    return view.cast("B")


def split_view(view: memoryview, chunk_bytes: int) -> list[memoryview]:
    """``view`` cut into pieces of at most ``chunk_bytes``."""
    return [view[i:i + chunk_bytes] for i in range(0, len(view), chunk_bytes)] or [view]


def group_buffers(buffers: Sequence[memoryview], chunk_bytes: int) -> list[list[memoryview]]:
    """Buffers laid back to back, cut into groups of exactly ``chunk_bytes`` (the last
    may be shorter); a buffer can straddle two groups."""
    if len(buffers) == 1:
        return [[piece] for piece in split_view(buffers[0], chunk_bytes)]
    groups: list[list[memoryview]] = []
    current: list[memoryview] = []
    filled = 0
    for buffer in buffers:
        offset = 0
        while offset < len(buffer):
            piece = buffer[offset:offset + chunk_bytes - filled]
            current.append(piece)
            filled += len(piece)
            offset += len(piece)
            if filled == chunk_bytes:
                groups.append(current)
                current, filled = [], 0
    if current:
        groups.append(current)
    return groups


def buffer_address(value: bytearray | np.ndarray) -> int:
    """Address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(value))


def buffer_nbytes(value: bytearray | np.ndarray) -> int:
    return int(value.nbytes) if isinstance(value, np.ndarray) else len(value)


def copy_into_lease(buffers: Sequence[memoryview], lease: Any) -> None:
    """Copy ``buffers`` back to back to the start of a pool lease."""
    copy_from_buffers = getattr(lease, "copy_from_buffers", None)
    if callable(copy_from_buffers):
        copy_from_buffers(buffers)
        return
    view = lease.buffer
    try:
        with view.cast("B") as target:
            offset = 0
            for buffer in buffers:
                n = len(buffer)
                target[offset:offset + n] = buffer.cast("B")
                offset += n
    finally:
        view.release()
