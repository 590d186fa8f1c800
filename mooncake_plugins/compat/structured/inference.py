"""Column inference for structured objects: rows in, leaf columns and container nodes out.

A batch of rows (one Python value per row) is split into columns the way a columnar
store wants them:

* a column whose non-null rows are all ``dict`` with string keys becomes a *dict node*
  and one child column per key (``path.key``; a row lacking the key holds ``MISSING``,
  a row that is not a dict holds ``None``);
* a column whose non-null rows are all short lists/tuples of containers (dicts, lists or
  ``None``) becomes a *list node* and one child column per position (``path[i]``; a list
  shorter than ``i + 1`` holds ``MISSING`` there);
* anything else is a *leaf*: its values plus the codec that would encode them
  (:func:`choose_leaf_codec`).

``None`` means "the value is None"; :data:`MISSING` means "there was no value" (an
absent key or list position). Each node keeps a ``row_mask`` telling which rows had a
real container. The decisions, their order and the codec names are those of the
original Mooncake's structured object store, so manifests stay comparable.

torch and numpy are never imported here just to look at values: a value can only be a
tensor or an ndarray if its library is already loaded. numpy is imported on first use
when a numeric column needs its common dtype.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

MAX_STRUCT_KEYS = 64
"""A dict column with more distinct keys than this stays one leaf."""
MAX_LIST_LEN = 8
"""A list column with a longer row stays one leaf."""
MAX_DEPTH = 32
"""Deepest nesting (containers below the root) that :func:`infer_structure` accepts."""

RAGGED_TENSOR = "ragged_tensor"
TYPED_RAGGED = "typed_ragged"
NDARRAY = "ndarray"
BYTES_RAGGED = "bytes_ragged"
UTF8_RAGGED = "utf8_ragged"
MEDIA_BYTES = "media_bytes"
MEDIA_LIST_RAGGED = "media_list_ragged"
MSGPACK_RAGGED = "msgpack_ragged"


class Missing:
    """Type of :data:`MISSING`: the row has no value here (unlike a ``None`` value)."""

    __slots__ = ()
    _instance: "Missing | None" = None

    def __new__(cls) -> "Missing":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<MISSING>"

    def __reduce__(self) -> str:
        return "MISSING"


MISSING = Missing()
"""Placeholder for a dict key or list position that a row does not have."""


@dataclass
class CodecDecision:
    """Which codec a leaf column gets, and whether that codec can take its values.

    ``accepted`` false means the values do not fit ``codec`` (the caller falls back to
    a generic object encoding or refuses). ``metadata`` carries what the codec needs,
    e.g. the common ``dtype``.
    """

    accepted: bool
    codec: str
    reason: str
    normalized_type: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferredLeaf:
    """One leaf column: its escaped path, one value per row, and its codec decision."""

    path: str
    values: list[Any]
    decision: CodecDecision


@dataclass
class InferredNode:
    """A container column: ``node_type`` ``"dict"`` (children are the sorted keys) or
    ``"list"`` (children are positions ``0..n-1``, ``lengths`` the per-row lengths, 0 for
    rows without a list). ``row_mask[i]`` is true where row ``i`` held a container."""

    path: str
    node_type: str
    children: list[Any]
    lengths: list[int] | None = None
    row_mask: list[bool] | None = None


def escape_key(key: str) -> str:
    """A dict key as a path segment: ``\\``, ``.`` and ``[`` are escaped with ``\\``."""
    return key.replace("\\", "\\\\").replace(".", "\\.").replace("[", "\\[")


def is_absent(value: Any) -> bool:
    """True for ``None`` and :data:`MISSING`."""
    return value is None or value is MISSING


def present(values: Sequence[Any]) -> list[Any]:
    """The values that are neither ``None`` nor :data:`MISSING`."""
    return [v for v in values if not is_absent(v)]


def _loaded(name: str) -> Any:
    """The module ``name`` if something already imported it, else None."""
    return sys.modules.get(name)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError as exc:
        raise ImportError("numeric columns need numpy (pip install numpy)") from exc
    return numpy


def _is_bytes_like(value: Any) -> bool:
    return isinstance(value, (bytes, bytearray, memoryview))


def _is_pil_image(value: Any) -> bool:
    return type(value).__module__.startswith("PIL.") and hasattr(value, "save")


def _is_media_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        _is_pil_image(item) or _is_bytes_like(item) for item in value
    )


def _is_numeric_scalar(value: Any) -> bool:
    if isinstance(value, (bool, int, float)):
        return True
    np = _loaded("numpy")
    return np is not None and isinstance(value, np.number)


def _decision(accepted: bool, codec: str, reason: str, normalized_type: str,
              **metadata: Any) -> CodecDecision:
    return CodecDecision(accepted, codec, reason, normalized_type, dict(metadata))


def _tensor_decision(rows: list[Any]) -> CodecDecision | None:
    torch = _loaded("torch")
    if torch is None or not all(isinstance(v, torch.Tensor) for v in rows):
        return None
    dtypes = sorted({str(v.dtype) for v in rows})
    if len(dtypes) > 1:
        return _decision(False, RAGGED_TENSOR, f"mixed tensor dtype: {dtypes}", "torch.Tensor")
    return _decision(True, RAGGED_TENSOR, "all non-null rows are Tensor", "torch.Tensor",
                     dtype=dtypes[0])


def _ndarray_decision(rows: list[Any]) -> CodecDecision | None:
    np = _loaded("numpy")
    if np is None or not all(isinstance(v, np.ndarray) for v in rows):
        return None
    if all(np.issubdtype(v.dtype, np.number) for v in rows):
        return _decision(True, TYPED_RAGGED, "all rows are numeric ndarray", "numeric sequence",
                         recursive_source="ndarray")
    return _decision(False, MSGPACK_RAGGED, "object ndarray rows", "python object")


def _sequence_decision(rows: list[Any]) -> CodecDecision | None:
    if not all(isinstance(v, (list, tuple)) for v in rows):
        return None
    np = _numpy()
    try:
        dtype = np.result_type(*(np.asarray(v).dtype for v in rows))
    except (TypeError, ValueError, OverflowError):
        return None      # ragged or mixed content: left to the generic object codec
    if not np.issubdtype(dtype, np.number):
        return None
    return _decision(True, TYPED_RAGGED, "all rows are numeric sequences", "numeric sequence",
                     dtype=str(dtype))


def _scalar_decision(rows: list[Any]) -> CodecDecision | None:
    if not all(_is_numeric_scalar(v) for v in rows):
        return None
    np = _numpy()
    try:
        dtype = np.result_type(*rows)
    except (TypeError, ValueError, OverflowError):
        dtype = np.dtype(object)
    if not (np.issubdtype(dtype, np.number) or np.issubdtype(dtype, np.bool_)):
        return _decision(False, NDARRAY, f"non-numeric dtype: {dtype}", "numeric scalar")
    if np.issubdtype(dtype, np.integer):
        # numpy types Python ints by the other values, not by their size
        info = np.iinfo(dtype)
        ints = [v for v in rows if type(v) is int]
        if ints and (min(ints) < info.min or max(ints) > info.max):
            return _decision(False, NDARRAY, f"integer out of range for {dtype}", "numeric scalar")
    return _decision(True, NDARRAY, "all rows are numeric scalar", "numeric scalar",
                     dtype=str(dtype))


def _kind_decision(predicate: Callable[[Any], bool], codec: str, reason: str,
                   normalized_type: str) -> Callable[[list[Any]], CodecDecision | None]:
    def decide(rows: list[Any]) -> CodecDecision | None:
        if all(predicate(v) for v in rows):
            return _decision(True, codec, reason, normalized_type)
        return None
    return decide


# First rule that claims the column wins; the order is the original's.
_RULES: tuple[Callable[[list[Any]], CodecDecision | None], ...] = (
    _tensor_decision,
    # a column of empty lists also counts as media lists, as in the original
    _kind_decision(_is_media_list, MEDIA_LIST_RAGGED, "all rows are media lists", "media list"),
    _ndarray_decision,
    _sequence_decision,
    _scalar_decision,
    _kind_decision(_is_bytes_like, BYTES_RAGGED, "all rows are bytes-like", "bytes-like"),
    _kind_decision(_is_pil_image, MEDIA_BYTES, "all rows are media", "media"),
    _kind_decision(lambda v: isinstance(v, str), UTF8_RAGGED, "all rows are str", "str"),
    _kind_decision(lambda v: isinstance(v, (dict, list, tuple)), MSGPACK_RAGGED,
                   "all rows are msgpack-like", "msgpack"),
)


def choose_leaf_codec(values: Sequence[Any]) -> CodecDecision:
    """The codec for a leaf column, judged on its non-null rows.

    In order: torch tensors of one dtype (any shapes) -> ``ragged_tensor``; lists of
    bytes/images -> ``media_list_ragged``; numeric ndarrays -> ``typed_ragged``; lists or
    tuples with a common numeric dtype -> ``typed_ragged``; bool/int/float scalars ->
    ``ndarray``; bytes-like -> ``bytes_ragged``; PIL images -> ``media_bytes``; str ->
    ``utf8_ragged``; dicts/lists/tuples -> ``msgpack_ragged``. A column with no non-null
    row, or one that no rule fits (e.g. mixed kinds, arbitrary objects), is rejected.
    """
    rows = present(values)
    if not rows:
        return _decision(False, MSGPACK_RAGGED, "all rows are null", "msgpack")
    for rule in _RULES:
        decision = rule(rows)
        if decision is not None:
            return decision
    return _decision(False, MSGPACK_RAGGED, "no codec matched", "python object")


def _dict_keys(rows: list[Any]) -> list[str] | None:
    """Sorted union of keys if the column expands as a dict node, else None."""
    if not rows or not all(isinstance(v, dict) for v in rows):
        return None
    keys = {k for v in rows for k in v}
    if len(keys) > MAX_STRUCT_KEYS or not all(isinstance(k, str) for k in keys):
        return None
    return sorted(keys)


def _list_width(rows: list[Any]) -> int | None:
    """Longest row if the column expands as a list node, else None."""
    if not rows or not all(isinstance(v, (list, tuple)) for v in rows):
        return None
    width = max(len(v) for v in rows)
    if width > MAX_LIST_LEN:
        return None
    if not all(item is None or isinstance(item, (dict, list, tuple)) for v in rows for item in v):
        return None
    return width


def infer_structure(path: str, values: Sequence[Any], leaves: list[InferredLeaf],
                    nodes: list[InferredNode]) -> None:
    """Split the column ``values`` (one value per row) at ``path`` into nodes and leaves.

    Appends to ``leaves`` and ``nodes`` in depth-first order, a node before its
    children, dict children in key order. Raises ValueError when containers nest deeper
    than :data:`MAX_DEPTH` below ``path``.
    """
    _expand(path, list(values), leaves, nodes, 0)


def _expand(path: str, values: list[Any], leaves: list[InferredLeaf],
            nodes: list[InferredNode], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"structure nests deeper than {MAX_DEPTH} levels at {path!r}")
    rows = present(values)
    keys = _dict_keys(rows)
    if keys is not None:
        nodes.append(InferredNode(path, "dict", list(keys),
                                  row_mask=[isinstance(v, dict) for v in values]))
        for key in keys:
            column = [v.get(key, MISSING) if isinstance(v, dict) else None for v in values]
            _expand(f"{path}.{escape_key(key)}", column, leaves, nodes, depth + 1)
        return
    width = _list_width(rows)
    if width is not None:
        is_list = [isinstance(v, (list, tuple)) for v in values]
        lengths = [len(v) if ok else 0 for v, ok in zip(values, is_list)]
        nodes.append(InferredNode(path, "list", list(range(width)), lengths, row_mask=is_list))
        for index in range(width):
            column = [
                (v[index] if index < len(v) else MISSING) if ok else None
                for v, ok in zip(values, is_list)
            ]
            _expand(f"{path}[{index}]", column, leaves, nodes, depth + 1)
        return
    leaves.append(InferredLeaf(path, values, choose_leaf_codec(values)))
