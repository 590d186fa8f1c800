"""Parallel layouts of stored tensors, as the original's "unified parallelism" lays them out.

A writer stores one shard of a tensor under a key derived from its parallel axes
(``dp``/``tp``/``ep``/``pp``); readers ask for their own shard, or for the full tensor,
which is reassembled from the tensor-parallel shards along their split dim:

* ``<key>_tp_<rank>``: a shard of a tensor split along one ``tp`` axis only;
* ``<key>__dp_0of2__tp_1of4_sd1...``: a shard with several axes (canonical dp, tp, ep, pp
  order; ``_sd`` split dim, ``_eid`` expert id, ``_sid`` stage id);
* ``<key>__writer_<r>of<n>_sd<d>`` with ``<key>__writer_manifest``: a writer partition;
* ``<key>__parallelism_manifest``: global shape, split dim and shard count of the tp shards.

Every shard is a tensor object (:mod:`.tensors`) whose header records its axes and the
global shape. The functions here plan writes and resolve reads; the caller moves bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import InvalidParams
from . import tensors as T
from .rpc import MAX_BATCH

_KINDS = {"dp": T.AxisKind.DP, "tp": T.AxisKind.TP, "ep": T.AxisKind.EP, "pp": T.AxisKind.PP}
_NAMES = {v: k for k, v in _KINDS.items()}
_MANIFEST = struct.Struct("<IHHiiiii4x8q")  # 96 bytes, as the original's
_MANIFEST_MAGIC = 0x574D414E
READ_MODES = ("as_stored", "shard", "full")
MAX_SHARDS = MAX_BATCH
"""Most shards of one tensor: a full read fetches them all in one batch."""


@dataclass(frozen=True)
class Axis:
    """One requested parallel axis: this writer/reader is ``rank`` of ``size``."""

    kind: int
    rank: int
    size: int
    split_dim: int | None = None
    expert_id: int | None = None
    stage_id: int | None = None

    def suffix(self) -> str:
        out = f"{_NAMES[self.kind]}_{self.rank}of{self.size}"
        for tag, v in (("sd", self.split_dim), ("eid", self.expert_id), ("sid", self.stage_id)):
            if v is not None:
                out += f"_{tag}{v}"
        return out


@dataclass(frozen=True)
class Writer:
    """A writer partition: this writer holds slice ``rank`` of ``size`` along ``split_dim``."""

    rank: int
    size: int
    split_dim: int


Fetch = Callable[[Sequence[str]], Sequence[Any]]
"""Reads objects: bytes per key, or None where one cannot be read."""

Dest = Callable[[T.TensorHeader], Any]
"""Where an assembled tensor goes: a writable uint8 array of shape ``local_shape + (itemsize,)``
for the header given (the caller's buffer, so that shards are copied only once)."""


# -- specs ----------------------------------------------------------------------------------
def axis_kind(name: str) -> int:
    try:
        return _KINDS[str(name).lower()]
    except KeyError:
        raise InvalidParams(f"unsupported parallel axis kind {name!r}") from None


def check_axes(axes: Sequence[Axis]) -> list[Axis]:
    """The rules the original applies to a TensorParallelism; InvalidParams otherwise."""
    if not axes or len(axes) > T.MAX_AXES:
        raise InvalidParams(f"a parallelism needs 1 to {T.MAX_AXES} axes, got {len(axes)}")
    if len({a.kind for a in axes}) != len(axes):
        raise InvalidParams("duplicate axis kinds are not supported")
    for a in axes:
        name = _NAMES[a.kind]
        if not 0 < a.size <= MAX_SHARDS or not 0 <= a.rank < a.size:
            raise InvalidParams(f"{name} axis: rank {a.rank} of {a.size} (sizes up to {MAX_SHARDS})")
        if (a.kind == T.AxisKind.TP) != (a.split_dim is not None):
            raise InvalidParams(f"{name} axis: split_dim is required for tp and refused otherwise")
        if a.kind == T.AxisKind.EP and a.expert_id is None:
            raise InvalidParams("ep axis requires expert_id")
        if a.kind == T.AxisKind.PP and a.stage_id is None:
            raise InvalidParams("pp axis requires stage_id")
    return list(axes)


def canonical(axes: Sequence[Axis]) -> list[Axis]:
    return sorted(axes, key=lambda a: a.kind)


def tp_axis(axes: Sequence[Axis]) -> Axis | None:
    return next((a for a in axes if a.kind == T.AxisKind.TP), None)


def with_tp(axes: Sequence[Axis], **changes: Any) -> list[Axis]:
    return [replace(a, **changes) if a.kind == T.AxisKind.TP else a for a in axes]


def tp_key(key: str, rank: int) -> str:
    return f"{key}_tp_{rank}"


def shard_key(key: str, axes: Sequence[Axis]) -> str:
    if len(axes) == 1 and axes[0].kind == T.AxisKind.TP:
        return tp_key(key, axes[0].rank)
    return key + "".join("__" + a.suffix() for a in canonical(axes))


def writer_key(key: str, w: Writer) -> str:
    return f"{key}__writer_{w.rank}of{w.size}_sd{w.split_dim}"


def writer_manifest_key(key: str) -> str:
    return f"{key}__writer_manifest"


def manifest_key(key: str) -> str:
    return f"{key}__parallelism_manifest"


# -- headers and manifests ------------------------------------------------------------------
def shard_header(dtype: int, global_shape: Sequence[int], local_shape: Sequence[int],
                 axes: Sequence[Axis]) -> T.TensorHeader:
    """The header of a shard carrying ``axes`` (in the order given)."""
    laxes = []
    for i, a in enumerate(axes):
        if a.split_dim is not None and not 0 <= a.split_dim < len(local_shape):
            raise InvalidParams(f"split_dim {a.split_dim} out of range for {len(local_shape)} dims")
        tag = a.expert_id if a.kind == T.AxisKind.EP else a.stage_id if a.kind == T.AxisKind.PP else 0
        extent = local_shape[a.split_dim] if a.split_dim is not None else 0
        laxes.append(T.Axis(a.kind, i, a.rank, a.size, -1 if a.split_dim is None else a.split_dim,
                            tag or 0, extent))
    nbytes = T.itemsize(dtype) * int(np.prod(local_shape, dtype=np.int64))
    return T.TensorHeader(dtype, tuple(global_shape), tuple(local_shape), T.Layout.SHARD, laxes, nbytes)


def axes_of(h: T.TensorHeader) -> list[Axis] | None:
    """The (canonical) axes recorded in a shard header; None for a full tensor."""
    if h.layout != T.Layout.SHARD:
        return None
    return canonical([Axis(a.kind, a.rank, a.count, a.split_dim if a.split_dim >= 0 else None,
                           a.tag if a.kind == T.AxisKind.EP else None,
                           a.tag if a.kind == T.AxisKind.PP else None) for a in h.axes])


def matches(axes: Sequence[Axis], h: T.TensorHeader) -> bool:
    """Whether the shard header ``h`` records exactly ``axes`` (in any order)."""
    return axes_of(h) == canonical(axes)


def pack_manifest(global_shape: Sequence[int], dtype: int, split_dim: int, count: int) -> bytes:
    dims = list(global_shape) + [-1] * (T.MAX_DIMS - len(global_shape))
    return _MANIFEST.pack(_MANIFEST_MAGIC, 1, _MANIFEST.size, dtype, len(global_shape), split_dim,
                          count, 0, *dims)


def parse_manifest(raw: Any) -> tuple[tuple[int, ...], int, int, int] | None:
    """``(global_shape, dtype, split_dim, shard_count)``; None when no manifest is stored
    (``raw`` None), InvalidParams when ``raw`` is not a well-formed one. Another process
    wrote it: the count (which sizes a reader's fetch) must split the shape uniformly and
    fit one batch read, the dtype must exist and the shape fit in memory at all."""
    if raw is None:
        return None
    if len(raw) < _MANIFEST.size:
        raise InvalidParams(f"a parallelism manifest has {_MANIFEST.size} bytes, not {len(raw)}")
    magic, version, size, dtype, ndim, split_dim, count, _, *dims = _MANIFEST.unpack_from(raw)
    if (magic, version, size) != (_MANIFEST_MAGIC, 1, _MANIFEST.size):
        raise InvalidParams("not a parallelism manifest (bad magic, version or size)")
    if not 0 <= split_dim < ndim <= T.MAX_DIMS:
        raise InvalidParams(f"parallelism manifest: split dim {split_dim} of {ndim} dims")
    shape = tuple(dims[:ndim])
    T.check_shape(shape, dtype, "parallelism manifest")
    if not 0 < count <= MAX_SHARDS or shape[split_dim] % count:
        raise InvalidParams(f"parallelism manifest: {count} shards of dim {split_dim} of {shape} "
                            f"(uniform, at most {MAX_SHARDS})")
    return shape, dtype, split_dim, count


# -- writes ---------------------------------------------------------------------------------
def _uniform(shape: Sequence[int], split_dim: int, count: int) -> None:
    if not 0 <= split_dim < len(shape) or count <= 0:
        raise InvalidParams(f"bad split: dim {split_dim} into {count} of a {len(shape)}-dim tensor")
    if shape[split_dim] % count:
        raise InvalidParams(f"dim {split_dim} of size {shape[split_dim]} does not split into "
                            f"{count} equal shards (only uniform sharding is supported)")


def tp_shards(tensor: Any, count: int, split_dim: int) -> list[tuple[int, Any, T.TensorHeader]]:
    """Every shard of ``tensor`` split ``count`` ways along ``split_dim`` (the legacy tp
    layout): ``(rank, shard view, shard header)`` for each rank."""
    _uniform(tuple(tensor.shape), split_dim, count)
    code = T.dtype_code(tensor.dtype)
    out = []
    for rank in range(count):
        part = T.shard(tensor, rank, count, split_dim)
        h = shard_header(code, tensor.shape, part.shape, [Axis(T.AxisKind.TP, rank, count, split_dim)])
        out.append((rank, part, h))
    return out


def write_plan(key: str, tensor: Any, axes: Sequence[Axis] | None = None,
               writer: Writer | None = None) -> list[tuple[str, bytearray | bytes]]:
    """The objects ``put_tensor_with_parallelism`` stores for ``tensor``: ``(key, bytes)``.

    * no axes, no writer: the tensor itself under ``key``;
    * a writer partition: its slice of the full ``tensor``, and the writer manifest;
    * one tp axis: ``tensor`` is this rank's shard (the global shape is inferred);
    * several axes with a tp axis: this rank's slice of the full ``tensor``;
    * axes without tp: the tensor as it is, under the axes' key.
    """
    if axes and writer:
        raise InvalidParams("writer_partition cannot be combined with parallelism")
    shape, code = tuple(int(d) for d in tensor.shape), T.dtype_code(tensor.dtype)
    if writer is not None:
        _uniform(shape, writer.split_dim, writer.size)
        part = T.shard(tensor, writer.rank, writer.size, writer.split_dim)
        tp = [Axis(T.AxisKind.TP, writer.rank, writer.size, writer.split_dim)]
        h = shard_header(code, shape, part.shape, tp)
        return [(writer_key(key, writer), T.encode(part, h)),
                (writer_manifest_key(key), pack_manifest(shape, code, writer.split_dim, writer.size))]
    if not axes:
        return [(key, T.encode(tensor))]
    axes = check_axes(axes)
    tp = tp_axis(axes)
    if tp is None:
        return [(shard_key(key, axes), T.encode(tensor, shard_header(code, shape, shape, axes)))]
    assert tp.split_dim is not None
    if len(axes) == 1:  # the caller holds its shard already
        if not 0 <= tp.split_dim < len(shape):
            raise InvalidParams(f"split_dim {tp.split_dim} out of range")
        full = list(shape)
        full[tp.split_dim] *= tp.size
        part = tensor
    else:
        _uniform(shape, tp.split_dim, tp.size)
        full, part = list(shape), T.shard(tensor, tp.rank, tp.size, tp.split_dim)
    h = shard_header(code, full, part.shape, axes)
    return [(shard_key(key, axes), T.encode(part, h)),
            (manifest_key(key), pack_manifest(full, code, tp.split_dim, tp.size))]


def write_from_plan(key: str, obj: Any, axes: Sequence[Axis] | None = None,
                    writer: Writer | None = None) -> list[tuple[str, bytearray | bytes]] | None:
    """The objects ``put_tensor_with_parallelism_from`` stores for a ``[header | data]``
    buffer; None when the buffer itself is the object (no axes, no writer).

    Unlike :func:`write_plan`, a tp axis here means the buffer holds the full tensor: every
    tp shard of it is stored (no manifest), as the original does.
    """
    if axes and writer:
        raise InvalidParams("writer_partition cannot be combined with parallelism")
    if not axes and writer is None:
        T.parse_header(obj)
        return None
    tensor = T.decode(obj, copy=False)
    if writer is not None or tp_axis(check_axes(axes or [])) is None:
        return write_plan(key, tensor, axes, writer)
    tp = tp_axis(axes)
    assert tp is not None and tp.split_dim is not None and axes is not None
    shape, code = tuple(tensor.shape), T.dtype_code(tensor.dtype)
    _uniform(shape, tp.split_dim, tp.size)
    out: list[tuple[str, bytearray | bytes]] = []
    for rank in range(tp.size):
        ranked = with_tp(axes, rank=rank)
        part = T.shard(tensor, rank, tp.size, tp.split_dim)
        out.append((shard_key(key, ranked), T.encode(part, shard_header(code, shape, part.shape, ranked))))
    return out


# -- reads ----------------------------------------------------------------------------------
@dataclass
class Assembled:
    """A tensor put together from shards: header (a full layout) and C-order bytes, in a
    new array or where ``dest`` said (``placed``)."""

    header: T.TensorHeader
    data: np.ndarray  # uint8, shape + (itemsize,)
    placed: bool = False


def _parse(raw: Any) -> T.TensorHeader | None:
    try:
        return T.parse_header(raw) if raw is not None else None
    except InvalidParams:
        return None


def _assemble(raws: Sequence[Any], global_shape: Sequence[int], split_dim: int, dtype: int,
              dest: Dest | None = None) -> Assembled:
    """Concatenate shards (objects) along ``split_dim``, into ``dest`` or a new array.

    InvalidParams unless every shard is its equal slice of ``global_shape`` in ``dtype``
    (manifest and headers come from other processes), so the tensor is no larger than the
    shards read."""
    shape, count = tuple(global_shape), len(raws)
    if not count or shape[split_dim] % count:
        raise InvalidParams(f"{count} shards cannot make dim {split_dim} of {shape}")
    local = shape[:split_dim] + (shape[split_dim] // count,) + shape[split_dim + 1:]
    size = T.itemsize(dtype)
    parts = []
    for rank, raw in enumerate(raws):
        h = T.parse_header(raw)
        if h.dtype != dtype or h.local_shape != local:
            raise InvalidParams(f"shard {rank} of {count} is {T.Dtype(h.dtype).name} {h.local_shape}; "
                                f"a {shape} tensor needs {T.Dtype(dtype).name} {local}")
        arr = np.frombuffer(raw, np.uint8, h.data_bytes, T.HEADER_SIZE)
        parts.append(arr.reshape(local + (size,)))
    header = T.TensorHeader(dtype, shape, shape, data_bytes=count * parts[0].nbytes)
    out = dest(header) if dest else np.empty(shape + (size,), np.uint8)
    np.concatenate(parts, axis=split_dim, out=out)
    return Assembled(header, out, dest is not None)


def _tp_sources(key: str, axes: Sequence[Axis], fetch: Fetch) -> tuple[list[Any], tuple, int, int] | None:
    """The stored tp shards a reader with ``axes`` can rebuild the full tensor from:
    ``(objects, global_shape, split_dim, dtype)``, or None."""
    want = canonical(axes)
    tp = tp_axis(want)
    assert tp is not None
    manifest = parse_manifest(fetch([manifest_key(key)])[0])
    if manifest is not None:
        shape, dtype, split_dim, count = manifest
        if tp.split_dim == split_dim and shape[split_dim] % tp.size == 0 \
                and shape[split_dim] % count == 0:
            ranked = [with_tp(want, rank=r, size=count) for r in range(count)]
            raws = fetch([shard_key(key, a) for a in ranked])
            heads = [_parse(r) for r in raws]
            if all(h is not None and matches(a, h) for a, h in zip(ranked, heads)):
                return list(raws), shape, split_dim, dtype
    if len(want) == 1:  # single tp: the stored shard count may differ from the reader's
        first = _parse(fetch([tp_key(key, 0) if tp.size > 1 else key])[0])
        stored = axes_of(first) if first else None
        if not stored or tp_axis(stored) is None:
            return None
        st = tp_axis(stored)
        assert st is not None and first is not None
        if st.split_dim != tp.split_dim or first.global_shape[st.split_dim] % tp.size:
            return None
        if st.size > MAX_SHARDS:
            raise InvalidParams(f"{tp_key(key, 0)} says it is one of {st.size} shards "
                                f"(at most {MAX_SHARDS})")
        ranked = [[replace(st, rank=r)] for r in range(st.size)]
    else:
        ranked = [with_tp(want, rank=r) for r in range(tp.size)]
    raws = fetch([shard_key(key, a) for a in ranked])
    heads = [_parse(r) for r in raws]
    if not all(h is not None and matches(a, h) for a, h in zip(ranked, heads)):
        return None
    h0 = heads[0]
    assert h0 is not None
    st = tp_axis(axes_of(h0) or [])
    if st is None or st.split_dim is None or st.split_dim != tp.split_dim:
        return None
    return list(raws), h0.global_shape, st.split_dim, h0.dtype


def read_full(key: str, axes: Sequence[Axis], fetch: Fetch, dest: Dest | None = None) -> Assembled | None:
    """The full tensor rebuilt from the tp shards of ``key`` (readers with ``axes``)."""
    found = _tp_sources(key, axes, fetch)
    return _assemble(*found, dest) if found else None


def read_writer_full(key: str, fetch: Fetch, dest: Dest | None = None) -> Assembled | None:
    """The full tensor written by writer partitions; None when ``key`` has no manifest."""
    manifest = parse_manifest(fetch([writer_manifest_key(key)])[0])
    if manifest is None:
        return None
    shape, dtype, split_dim, count = manifest
    writers = [Writer(r, count, split_dim) for r in range(count)]
    raws = fetch([writer_key(key, w) for w in writers])
    heads = [_parse(r) for r in raws]
    if not all(h is not None and matches([Axis(T.AxisKind.TP, w.rank, w.size, split_dim)], h)
               for w, h in zip(writers, heads)):
        return None
    return _assemble(raws, shape, split_dim, dtype, dest)


def read_shard(key: str, axes: Sequence[Axis], fetch: Fetch) -> Any | Assembled | None:
    """This reader's shard: the stored object (bytes) when one matches ``axes``, else a
    slice of the full tensor rebuilt from shards of another tp size, or None."""
    axes = check_axes(axes)
    tp = tp_axis(axes)
    candidates = [shard_key(key, axes)]
    if tp is not None and len(axes) == 1:
        candidates.append(writer_key(key, Writer(tp.rank, tp.size, tp.split_dim or 0)))
    for candidate in candidates:
        raw = fetch([candidate])[0]
        h = _parse(raw)
        if h is not None and matches(axes, h):
            return raw
    if tp is None:
        return None
    full = read_full(key, axes, fetch)  # the shards were cut for another tp size
    if full is not None:
        part = np.ascontiguousarray(np.split(full.data, tp.size, axis=tp.split_dim)[tp.rank])
        shape = part.shape[:-1]
        return Assembled(T.TensorHeader(full.header.dtype, shape, shape, data_bytes=part.nbytes), part)
    if len(axes) == 1:
        return fetch([tp_key(key, tp.rank) if tp.size > 1 else key])[0]
    return None
