"""Column codecs: a list of row values (``None`` = null row) <-> named payload arrays.

Each encoder returns ``(payload, metadata)``: payload members are numpy arrays or
:mod:`.payloads` buffers (stored as structured members), metadata is JSON-safe. The
payload names and metadata keys are the original Mooncake's, so stored fields decode
with either implementation.

* ``typed_ragged``: numeric rows of any shapes, flattened back to back into ``data``
  with per-row ``offsets`` (elements), ``shapes``/``ndims`` and ``nulls``;
* ``ragged_tensor``: the same for torch tensors (``metadata["dtype"]`` a torch dtype);
* ``ragged_tensor_dict``: rows ``{key: tensor}``, one ``ragged_tensor`` per key;
* ``ndarray``: numeric scalars as one array plus ``nulls``;
* ``bytes_ragged``/``media_bytes``/``utf8_ragged``/``json_ragged``/``msgpack_ragged``:
  one byte string per row in ``data`` with ``offsets`` (bytes) and ``nulls``;
* ``media_list_ragged``: rows of byte strings/images (``row_offsets``, ``byte_offsets``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from . import payloads, tensor_codec
from .inference import CodecDecision, is_absent
from .payloads import OWNER_ATTR, DirectCopyPayload, MultiBufferPayload, OwnerBackedList

DEFAULT_TYPED_DTYPE = "int64"
DEFAULT_TENSOR_DTYPE = "torch.float32"
TENSOR_PAYLOAD_NAMES = frozenset({"data", "offsets", "shapes", "ndims", "nulls"})
BYTE_CODECS = frozenset({"media_bytes", "bytes_ragged", "utf8_ragged", "msgpack_ragged",
                         "json_ragged"})

# -- typed_ragged -----------------------------------------------------------------------


def _flat_data(flats: list[np.ndarray], dtype: np.dtype, total: int) -> Any:
    """The ``data`` payload of flattened rows: gathered at write time when possible."""
    if len(flats) > 1 and payloads.concat_arrays_into is not None:
        return DirectCopyPayload.from_flat_arrays(flats, dtype, total)
    if not flats:
        flats = [np.empty(0, dtype=dtype)]
    return MultiBufferPayload(tuple(memoryview(f.data).cast("B") for f in flats),
                              tuple(flats), dtype.str, (int(total),))


def _contiguous(value: Any, dtype: np.dtype) -> np.ndarray:
    array = np.asarray(value, dtype=dtype)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def encode_regular_ndarray_rows(values: Sequence[Any], dtype: Any
                                ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The ``typed_ragged`` encoding of two or more non-null C-contiguous ndarray rows of
    one shape and ``dtype``; None for anything else."""
    dtype = np.dtype(dtype)
    if len(values) < 2 or not all(
            isinstance(v, np.ndarray) and v.dtype == dtype and v.flags.c_contiguous
            for v in values):
        return None
    shape = values[0].shape
    if any(v.shape != shape for v in values):
        return None
    return _typed_payload(list(values), [False] * len(values), dtype, "ndarray", None, True)


def encode_typed_ragged(values: Sequence[Any], dtype_hint: Any = None
                        ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``typed_ragged`` encoding of numeric rows (ndarrays, sequences or scalars)."""
    if dtype_hint is not None:
        dtype = np.dtype(dtype_hint)
    else:
        present = [np.asarray(v) for v in values if v is not None]
        dtype = np.result_type(*present) if present else np.dtype(DEFAULT_TYPED_DTYPE)
    if dtype.hasobject:
        raise ValueError("typed_ragged codec requires non-object dtype")
    regular = encode_regular_ndarray_rows(values, dtype)
    if regular is not None:
        return regular
    nulls = [v is None for v in values]
    arrays = [None if v is None else _contiguous(v, dtype) for v in values]
    is_array = [isinstance(v, np.ndarray) for v in values]
    if all(a or n for a, n in zip(is_array, nulls)) and values:
        return _typed_payload(arrays, nulls, dtype, "ndarray", None, True)
    row_format = "mixed" if any(is_array) else "list"
    return _typed_payload(arrays, nulls, dtype, row_format,
                          is_array if row_format == "mixed" else None, False)


def _typed_payload(arrays: list[np.ndarray | None], nulls: list[bool], dtype: np.dtype,
                   row_format: str, ndarray_rows: list[bool] | None, flat_layout: bool
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    rows = len(arrays)
    present = [a for a in arrays if a is not None]
    max_ndim = max((a.ndim for a in present), default=0)
    offsets = np.zeros(rows + 1, dtype=np.int64)
    ndims = np.zeros(rows, dtype=np.int16)
    shapes = np.zeros((rows, max(max_ndim, 1)), dtype=np.int64)
    for row, array in enumerate(arrays):
        size = 0 if array is None else array.size
        offsets[row + 1] = offsets[row] + size
        if array is not None and array.ndim:
            ndims[row] = array.ndim
            shapes[row, :array.ndim] = array.shape
    flats = [a.reshape(-1) for a in present if a.size]
    metadata: dict[str, Any] = {"dtype": str(dtype), "max_ndim": int(max_ndim),
                                "shape_policy": "ragged", "row_format": row_format,
                                "ndarray_rows": ndarray_rows}
    if flat_layout:
        metadata["physical_layout"] = "contiguous_flat"
    return ({"data": _flat_data(flats, dtype, int(offsets[-1])), "offsets": offsets,
             "shapes": shapes, "ndims": ndims, "nulls": np.asarray(nulls, dtype=np.bool_)},
            metadata)


def _as_typed(raw: Any, dtype: np.dtype) -> np.ndarray:
    torch = tensor_codec.loaded_torch()
    if torch is not None and isinstance(raw, torch.Tensor):
        return raw.numpy()
    if isinstance(raw, np.ndarray):
        return raw if raw.dtype == dtype else raw.reshape(-1).view(np.uint8).view(dtype)
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return np.frombuffer(raw, dtype=dtype)
    return np.asarray(raw, dtype=dtype)


def decode_typed_ragged(payload: Mapping[str, Any], rows: int,
                        metadata: Mapping[str, Any] | None = None) -> list[Any]:
    """Rows of a ``typed_ragged`` payload; ndarray rows are views of ``data``."""
    metadata = metadata or {}
    data = _as_typed(payload["data"], np.dtype(metadata.get("dtype", DEFAULT_TYPED_DTYPE)))
    offsets, shapes, ndims, nulls = (payload[n] for n in ("offsets", "shapes", "ndims", "nulls"))
    row_format = metadata.get("row_format")
    ndarray_rows = metadata.get("ndarray_rows") or []
    source = data.view(np.ndarray)
    values: list[Any] = []
    for row in range(rows):
        if bool(nulls[row]):
            values.append(None)
            continue
        ndim = int(ndims[row])
        shape = tuple(int(d) for d in shapes[row, :ndim])
        array = source[int(offsets[row]):int(offsets[row + 1])].reshape(shape)
        as_array = row_format == "ndarray" or (row_format == "mixed" and ndarray_rows[row])
        values.append(array if as_array else array.tolist())
    owner = getattr(data, OWNER_ATTR, None)
    return values if owner is None else OwnerBackedList(values, owner)


# -- ragged tensors ---------------------------------------------------------------------


def encode_ragged_tensor(values: Sequence[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``ragged_tensor`` encoding of rows that are tensors (or numeric ndarrays)."""
    torch = tensor_codec.torch_module()
    dtype = None
    arrays: list[Any] = []
    for value in values:
        if value is None:
            arrays.append(None)
            continue
        if isinstance(value, np.ndarray):
            if value.dtype == object:
                raise ValueError("ragged tensor codec requires numeric ndarray values")
            tensor = torch.as_tensor(value if value.flags.writeable else value.copy())
        else:
            tensor = value.detach()
        tensor = tensor.cpu().contiguous()
        if tensor.dtype == torch.bfloat16:
            raise ValueError("ragged tensor codec does not support torch.bfloat16")
        dtype = tensor.dtype if dtype is None else dtype
        if tensor.dtype != dtype:
            raise ValueError(f"mixed tensor dtype: {dtype} vs {tensor.dtype}")
        arrays.append(tensor.numpy())
    name = str(dtype) if dtype is not None else DEFAULT_TENSOR_DTYPE
    payload, metadata = encode_typed_ragged(arrays, tensor_codec.numpy_dtype_of(name))
    metadata["dtype"] = name
    return payload, metadata


def decode_ragged_tensor(payload: Mapping[str, Any], rows: int,
                         metadata: Mapping[str, Any] | None = None) -> list[Any]:
    torch = tensor_codec.torch_module()
    name = (metadata or {}).get("dtype", DEFAULT_TENSOR_DTYPE)
    typed = dict(metadata or {})
    typed["dtype"] = str(tensor_codec.numpy_dtype_of(name))
    dtype = tensor_codec.parse_torch_dtype(name)
    out = []
    for value in decode_typed_ragged(payload, rows, typed):
        if value is None:
            out.append(None)
        elif isinstance(value, np.ndarray):
            array = value if value.flags.writeable else value.copy()
            out.append(torch.from_numpy(array).to(dtype))
        else:
            out.append(torch.as_tensor(value, dtype=dtype))
    return out


def dict_keys(keys: Any) -> list[str]:
    """Validated key list of a ``ragged_tensor_dict`` (a mapping gives its keys)."""
    names: list[str] = []
    for key in (keys.keys() if isinstance(keys, Mapping) else keys):
        if not isinstance(key, str):
            raise TypeError("ragged_tensor_dict keys must be strings")
        if not key:
            raise ValueError("ragged_tensor_dict keys must not be empty")
        if any(sep in key for sep in ".\\/"):
            raise ValueError("ragged_tensor_dict keys must not contain '.', '/', or '\\'")
        if key in names:
            raise ValueError(f"ragged_tensor_dict keys contain duplicate key {key!r}")
        names.append(key)
    return names


def key_payload(payload: Mapping[str, Any], key: str, what: str = "payload") -> dict[str, Any]:
    """The ``ragged_tensor`` payload of one key inside a ``ragged_tensor_dict``."""
    head = f"{key}."
    items = {name[len(head):]: v for name, v in payload.items() if name.startswith(head)}
    missing = sorted(TENSOR_PAYLOAD_NAMES - set(items))
    if missing:
        raise ValueError(f"ragged_tensor_dict {what} for key {key!r} is missing payloads: "
                         f"{missing}")
    return items


def encode_ragged_tensor_dict(values: Sequence[Any], declared: Any = None
                              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``ragged_tensor_dict`` encoding of rows ``{key: tensor}`` or None; ``declared``
    (the schema's ``keys``) fixes the key set, else it is the union of the rows' keys."""
    keys = None if declared is None else dict_keys(declared)
    seen: set[str] = set()
    for row, item in enumerate(values):
        if item is None:
            continue
        if not isinstance(item, Mapping):
            raise TypeError("ragged_tensor_dict rows must be mappings or None; "
                            f"row {row} is {type(item).__name__}")
        nulls = sorted(k for k, v in item.items() if v is None)
        if nulls:
            raise TypeError("ragged_tensor_dict rows cannot contain explicit None tensor "
                            f"values; row {row} has explicit None for {nulls}")
        row_keys = dict_keys(item.keys())
        if keys is None:
            seen.update(row_keys)
            continue
        extra = sorted(set(row_keys) - set(keys))
        if extra:
            raise ValueError("ragged_tensor_dict rows contain keys not declared in "
                             f"FieldSchema metadata['keys']; row {row} has keys not "
                             f"declared: {extra}")
    if keys is None:
        keys = dict_keys(sorted(seen))
    payload: dict[str, Any] = {"null_mask": np.asarray([v is None for v in values],
                                                       dtype=np.bool_)}
    codecs: dict[str, Any] = {}
    for key in keys:
        try:
            sub, codecs[key] = encode_ragged_tensor(
                [None if v is None else v.get(key) for v in values])
        except (TypeError, ValueError, OverflowError, RuntimeError, RecursionError) as exc:
            raise ValueError(f"failed to encode ragged_tensor_dict key {key!r}") from exc
        payload.update({f"{key}.{name}": part for name, part in sub.items()})
    return payload, {"keys": keys, "key_codecs": codecs}


def decode_ragged_tensor_dict(payload: Mapping[str, Any], rows: int,
                              metadata: Mapping[str, Any]) -> list[Any]:
    null_mask = payload["null_mask"]
    if isinstance(null_mask, (bytes, bytearray)):
        null_mask = np.frombuffer(null_mask, dtype=np.bool_)
    codecs = metadata.get("key_codecs", {})
    columns = {key: decode_ragged_tensor(key_payload(payload, key), rows, codecs.get(key))
               for key in metadata.get("keys", [])}
    return [None if bool(null_mask[row]) else
            {key: column[row] for key, column in columns.items() if column[row] is not None}
            for row in range(rows)]


# -- scalars ----------------------------------------------------------------------------


def encode_scalars(values: Sequence[Any], dtype: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``ndarray`` encoding: one ``dtype`` array, nulls stored as 0/False."""
    dtype = np.dtype(dtype)
    fill = False if dtype == np.bool_ else 0
    data = np.asarray([fill if v is None else v for v in values], dtype=dtype)
    return ({"data": data, "nulls": np.asarray([v is None for v in values], dtype=np.bool_)},
            {"dtype": str(data.dtype), "shape": list(data.shape)})


def decode_scalars(payload: Mapping[str, Any]) -> list[Any]:
    data, nulls = payload["data"], payload["nulls"]
    if not bool(np.asarray(nulls).any()):
        return data.tolist()
    values = data.astype(object)
    values[nulls] = None
    return values.tolist()


# -- byte strings -----------------------------------------------------------------------


def _is_pil_image(value: Any) -> bool:
    return type(value).__module__.startswith("PIL.") and hasattr(value, "tobytes")


def _media_bytes(value: Any) -> tuple[Any, str | None, dict[str, Any]]:
    """``(bytes, media type, encoding record)`` of a byte string or PIL image."""
    if value is None:
        return b"", None, {"kind": "null"}
    if _is_pil_image(value):
        image = value.convert(value.mode) if getattr(value, "readonly", False) else value
        return image.tobytes(), "image/raw", {"kind": "pil_raw", "mode": image.mode,
                                              "size": list(image.size),
                                              "format": getattr(value, "format", None)}
    return bytes(value), None, {"kind": "bytes"}


def _from_media_bytes(data: Any, encoding: Mapping[str, Any] | None) -> Any:
    if not encoding or encoding.get("kind") != "pil_raw":
        return bytes(data)
    try:
        from PIL import Image
    except ImportError:
        return bytes(data)
    mode = encoding["mode"]
    image = Image.frombuffer(mode, tuple(encoding["size"]), bytes(data), "raw", mode, 0, 1)
    image.format = encoding.get("format")
    return image


def encode_byte_rows(values: Sequence[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One byte string (bytes-like or image) per row."""
    parts, kinds, types = [], [], set()
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    for row, value in enumerate(values):
        data, media_type, encoding = _media_bytes(value)
        view = payloads.bytes_view(data, "payload part")
        if len(view):
            parts.append(view)
        kinds.append(encoding)
        if media_type:
            types.add(media_type)
        offsets[row + 1] = offsets[row] + len(view)
    metadata: dict[str, Any] = {}
    if any(k["kind"] == "pil_raw" for k in kinds):
        metadata["media_encodings"] = kinds
    if types:
        metadata["media_types"] = sorted(types)
        metadata["encode_source"] = "raw_pixels_from_object"
    return ({"data": MultiBufferPayload(tuple(parts), tuple(parts)), "offsets": offsets,
             "nulls": np.asarray([v is None for v in values], dtype=np.bool_)}, metadata)


def decode_byte_rows(payload: Mapping[str, Any], rows: int,
                     metadata: Mapping[str, Any] | None = None) -> list[Any]:
    data = memoryview(payload["data"]).cast("B")
    offsets, nulls = payload["offsets"], payload["nulls"]
    encodings = (metadata or {}).get("media_encodings", [])
    return [None if bool(nulls[row]) else
            _from_media_bytes(data[int(offsets[row]):int(offsets[row + 1])],
                              encodings[row] if row < len(encodings) else None)
            for row in range(rows)]


def encode_msgpack_rows(path: str, values: Sequence[Any]
                        ) -> tuple[dict[str, Any], dict[str, Any]]:
    """One msgpack document per non-null row (exact types only: no tuples)."""
    packer = msgpack.Packer(use_bin_type=True, strict_types=True)
    data = bytearray()
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    for row, value in enumerate(values):
        if value is not None:
            try:
                data += packer.pack(value)
            except TypeError as exc:
                raise ValueError(f"unsupported structured non-tensor field {path}: msgpack "
                                 "codec cannot encode value") from exc
        offsets[row + 1] = len(data)
    return ({"data": data, "offsets": offsets,
             "nulls": np.asarray([v is None for v in values], dtype=np.bool_)}, {})


def decode_msgpack_rows(payload: Mapping[str, Any], rows: int) -> list[Any]:
    offsets, nulls = payload["offsets"], payload["nulls"]
    if len(offsets) != rows + 1:
        raise ValueError(f"msgpack_ragged offsets length {len(offsets)} does not match "
                         f"rows {rows}")
    if len(nulls) != rows:
        raise ValueError(f"msgpack_ragged nulls length {len(nulls)} does not match rows {rows}")
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(bytes(memoryview(payload["data"]).cast("B")))
    documents = iter(unpacker)
    values = [None if bool(nulls[row]) else next(documents) for row in range(rows)]
    if next(documents, None) is not None:
        raise ValueError("msgpack_ragged payload has more documents than rows")
    return values


def encode_json_rows(values: Sequence[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    return encode_byte_rows([None if v is None else json.dumps(
        v, ensure_ascii=False, separators=(",", ":")).encode("utf-8") for v in values])


def encode_text_rows(values: Sequence[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    return encode_byte_rows([None if v is None else v.encode("utf-8") for v in values])


# -- lists of media ---------------------------------------------------------------------


def encode_media_lists(values: Sequence[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rows that are lists of byte strings or images."""
    parts, kinds, types = [], [], set()
    row_offsets, byte_offsets = [0], [0]
    for value in values:
        items = [] if value is None else list(value)
        for item in items:
            data, media_type, encoding = _media_bytes(item)
            parts.append(bytes(data))
            kinds.append(encoding)
            if media_type:
                types.add(media_type)
            byte_offsets.append(byte_offsets[-1] + len(parts[-1]))
        row_offsets.append(row_offsets[-1] + len(items))
    metadata: dict[str, Any] = {"encode_source": "raw_pixels_from_object",
                                "media_encodings": kinds}
    if types:
        metadata["media_types"] = sorted(types)
    return ({"data": b"".join(parts), "row_offsets": np.asarray(row_offsets, dtype=np.int64),
             "byte_offsets": np.asarray(byte_offsets, dtype=np.int64),
             "nulls": np.asarray([v is None for v in values], dtype=np.bool_)}, metadata)


def decode_media_lists(payload: Mapping[str, Any], rows: int,
                       metadata: Mapping[str, Any] | None = None) -> list[Any]:
    data = memoryview(payload["data"]).cast("B")
    row_offsets, byte_offsets, nulls = (payload[n] for n in
                                        ("row_offsets", "byte_offsets", "nulls"))
    encodings = (metadata or {}).get("media_encodings", [])
    values: list[Any] = []
    for row in range(rows):
        if bool(nulls[row]):
            values.append(None)
            continue
        values.append([_from_media_bytes(data[int(byte_offsets[i]):int(byte_offsets[i + 1])],
                                         encodings[i] if i < len(encodings) else None)
                       for i in range(int(row_offsets[row]), int(row_offsets[row + 1]))])
    return values


# -- dispatch ---------------------------------------------------------------------------


def encode_values(codec: str, path: str, values: Sequence[Any], dtype: Any = None
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Encode a column with the named codec (``dtype``: the element/scalar dtype)."""
    if codec == "ragged_tensor":
        return encode_ragged_tensor(values)
    if codec == "typed_ragged":
        return encode_typed_ragged(values, dtype)
    if codec == "ndarray":
        if dtype is None:
            raise ValueError("ndarray codec needs a dtype")
        return encode_scalars(values, dtype)
    if codec in ("bytes_ragged", "media_bytes"):
        return encode_byte_rows(values)
    if codec == "media_list_ragged":
        return encode_media_lists(values)
    if codec == "utf8_ragged":
        return encode_text_rows(values)
    if codec == "msgpack_ragged":
        return encode_msgpack_rows(path, values)
    if codec == "json_ragged":
        return encode_json_rows(values)
    raise ValueError(f"unsupported structured non-tensor codec: {codec}")


def encode_decided(values: Sequence[Any], decision: CodecDecision, path: str = ""
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Encode an inferred leaf column with its accepted codec decision."""
    if not decision.accepted:
        raise ValueError(f"unsupported structured non-tensor field: {decision.reason}")
    dtype = decision.metadata.get("dtype") if decision.codec in ("typed_ragged", "ndarray") \
        else None
    payload, metadata = encode_values(decision.codec, path, values, dtype)
    metadata.update({"schema_source": "inferred_from_runtime_values",
                     "decision_reason": decision.reason,
                     "normalized_type": decision.normalized_type, **decision.metadata})
    return payload, metadata


def decode_values(codec: str, payload: Mapping[str, Any], rows: int,
                  metadata: Mapping[str, Any] | None = None) -> list[Any]:
    """Rows of one encoded leaf column."""
    if codec == "ragged_tensor":
        return decode_ragged_tensor(payload, rows, metadata)
    if codec == "typed_ragged":
        return decode_typed_ragged(payload, rows, metadata)
    if codec == "media_list_ragged":
        return decode_media_lists(payload, rows, metadata)
    if codec == "ndarray":
        return decode_scalars(payload)
    if codec in ("media_bytes", "bytes_ragged"):
        return decode_byte_rows(payload, rows, metadata)
    if codec == "utf8_ragged":
        return [None if v is None else v.decode("utf-8") for v in decode_byte_rows(payload, rows)]
    if codec == "msgpack_ragged":
        return decode_msgpack_rows(payload, rows)
    if codec == "json_ragged":
        return [None if v is None else json.loads(v) for v in decode_byte_rows(payload, rows)]
    raise ValueError(f"unknown structured non-tensor codec: {codec}")


def all_absent(values: Sequence[Any]) -> bool:
    return all(is_absent(v) for v in values)
