"""DataProto-shaped data: handles, envelopes, flat dicts and row/field selections.

A DataProto is ``batch`` (row-aligned tensors/arrays), ``non_tensor_batch`` (row-aligned
object arrays) and ``meta_info`` (anything JSON-like). Objects with those attributes,
envelope dicts with those keys, and plain dicts of batch fields are accepted. Stored
DataProtos travel between processes as JSON-safe handles (``export_dataproto_ref``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import tensor_codec
from .non_tensor import SCHEMA_SECTIONS, schema_dtype
from .records import (FieldSchema, MooncakeDataProtoRef, RemoteBundleRef,
                      StructuredFieldLocation, StructuredMemberSlice)

HANDLE_TYPE = "mooncake_dataproto_ref"
HANDLE_VERSION = 1
HANDLE_KIND = "bundle_stages"
STORAGE_GROUP_ID = "storage_group_id"
SECTIONS = ("batch", "non_tensor_batch", "meta_info")


# -- handles ----------------------------------------------------------------------------


def is_dataproto_ref_handle(value: Any) -> bool:
    """Whether ``value`` is an exported DataProto handle."""
    return isinstance(value, Mapping) and value.get("type") == HANDLE_TYPE


def json_safe(value: Any) -> Any:
    """A JSON-safe copy: numpy scalars/arrays become Python values."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return json_safe(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    raise TypeError(f"DataProto ref handles support only JSON-safe values, got "
                    f"{type(value).__name__}")


def export_dataproto_ref(ref: MooncakeDataProtoRef) -> dict[str, Any]:
    """A JSON-safe handle of a stored DataProto (manifests are not included)."""
    if not isinstance(ref, MooncakeDataProtoRef):
        raise TypeError(f"expected MooncakeDataProtoRef, got {type(ref).__name__}")
    handle = {
        "type": HANDLE_TYPE, "version": HANDLE_VERSION, "kind": HANDLE_KIND,
        "batch_size": int(ref.batch_size), "namespace": ref.namespace,
        "partition": ref.partition, "global_indexes": json_safe(ref.global_indexes),
        "stage_refs": {stage: {"manifest_key": r.manifest_key}
                       for stage, r in ref.stage_refs.items()},
        "field_index": {name: {"stage": loc.stage, "member": loc.member,
                               "section": loc.section}
                        for name, loc in ref.field_index.items()},
        "meta_info": json_safe(ref.meta_info),
        "encoded_non_tensor": json_safe(ref.encoded_non_tensor),
    }
    if ref._storage_group_id is not None:
        handle[STORAGE_GROUP_ID] = ref._storage_group_id
    json.dumps(handle, ensure_ascii=False)
    return handle


def _mapping(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"DataProto ref handle {name} must be a mapping")
    return value


def _filled(*values: Any) -> bool:
    return all(isinstance(v, str) and v for v in values)


def import_dataproto_ref(handle: Mapping[str, Any]) -> MooncakeDataProtoRef:
    """A lazy ref from an exported handle (manifests are fetched when used)."""
    if not is_dataproto_ref_handle(handle):
        raise ValueError("not a Mooncake DataProto ref handle")
    version = handle.get("version")
    if isinstance(version, bool) or version not in (HANDLE_VERSION, 2):
        raise ValueError(f"unsupported DataProto ref handle version: {version!r}")
    if handle.get("kind") != HANDLE_KIND:
        raise ValueError(f"unsupported DataProto ref handle kind: {handle.get('kind')!r}")
    stages: dict[str, RemoteBundleRef] = {}
    for stage, raw in _mapping(handle.get("stage_refs"), "stage_refs").items():
        key = _mapping(raw, f"stage_refs[{stage!r}]").get("manifest_key")
        if not _filled(stage, key):
            raise ValueError("DataProto ref handle stage refs must contain non-empty string "
                             "names and manifest_key values")
        stages[stage] = RemoteBundleRef(manifest_key=key, manifest={})
    fields: dict[str, StructuredFieldLocation] = {}
    for name, raw in _mapping(handle.get("field_index"), "field_index").items():
        where = _mapping(raw, f"field_index[{name!r}]")
        section = where.get("section")
        if section not in ("batch", "non_tensor_batch"):
            raise ValueError(f"invalid DataProto field section: {section!r}")
        stage, member = where.get("stage"), where.get("member")
        if not _filled(name, stage, member):
            raise ValueError("DataProto ref handle field locations must be non-empty strings")
        if stage not in stages:
            raise ValueError(f"DataProto ref handle field {name!r} references unknown stage "
                             f"{stage!r}")
        fields[name] = StructuredFieldLocation(stage, member, section)
    group = handle.get(STORAGE_GROUP_ID)
    if (version == 2 and group is None) or (group is not None and not _filled(group)):
        raise ValueError("DataProto ref handle has invalid storage_group_id")
    indexes = handle.get("global_indexes")
    if indexes is not None:
        if not isinstance(indexes, list):
            raise ValueError("DataProto ref handle global_indexes must be a list or null")
        if any(isinstance(i, bool) or not isinstance(i, int) for i in indexes):
            raise ValueError("DataProto ref handle global_indexes must contain integers")
        indexes = list(indexes)
    batch_size = handle.get("batch_size")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
        raise ValueError(f"DataProto ref handle batch_size must be an integer >= 0, "
                         f"got {batch_size!r}")
    return MooncakeDataProtoRef(
        batch_size=batch_size, stage_refs=stages, field_index=fields,
        meta_info=dict(_mapping(handle.get("meta_info", {}), "meta_info")),
        namespace=str(handle.get("namespace", "default")),
        partition=str(handle.get("partition", "default")), global_indexes=indexes,
        encoded_non_tensor=dict(_mapping(handle.get("encoded_non_tensor", {}),
                                         "encoded_non_tensor")),
        _storage_group_id=group)


def resolve_ref(ref: Any) -> MooncakeDataProtoRef:
    if isinstance(ref, MooncakeDataProtoRef):
        return ref
    if is_dataproto_ref_handle(ref):
        return import_dataproto_ref(ref)
    raise TypeError(f"expected MooncakeDataProtoRef or DataProto handle, got "
                    f"{type(ref).__name__}")


# -- inputs -----------------------------------------------------------------------------


def _as_dict(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    items = getattr(value, "items", None)
    if callable(items):
        return dict(items())
    raise TypeError(f"expected mapping-like value, got {type(value).__name__}")


def _is_envelope(data: Mapping[str, Any]) -> bool:
    return bool(data) and set(data) <= set(SECTIONS) and all(
        v is None or isinstance(v, Mapping) or callable(getattr(v, "items", None))
        for v in data.values())


def split_sections(data: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(batch, non_tensor_batch, meta_info)`` of a DataProto-like value; a dict that is
    not an envelope is all batch fields."""
    if isinstance(data, Mapping):
        if _is_envelope(data):
            return tuple(_as_dict(data.get(s)) for s in SECTIONS)  # type: ignore[return-value]
        return dict(data), {}, {}
    return tuple(_as_dict(getattr(data, s, None)) for s in SECTIONS)  # type: ignore[return-value]


def batch_size_of(batch: Mapping[str, Any], non_tensor: Mapping[str, Any]) -> int:
    sizes = {len(v) for section in (batch, non_tensor) for v in section.values()}
    if len(sizes) > 1:
        raise ValueError(f"DataProto fields have inconsistent batch sizes: {sorted(sizes)}")
    return sizes.pop() if sizes else 0


def schema_section(name: str, schema: FieldSchema) -> str | None:
    section = schema.metadata.get("section")
    if section is not None and section not in SCHEMA_SECTIONS:
        raise ValueError(f"FieldSchema for {name!r} metadata['section'] must be one of "
                         f"{sorted(SCHEMA_SECTIONS)}")
    return section


def schema_for(schemas: Mapping[str, FieldSchema] | None, name: str,
               section: str) -> FieldSchema | None:
    """The schema of field ``name`` if it applies to ``section``."""
    schema = (schemas or {}).get(name)
    if schema is None:
        return None
    declared = schema_section(name, schema)
    return schema if declared in (None, section) else None


def check_schema_sections(sections: Sequence[Mapping[str, Any]],
                          schemas: Mapping[str, FieldSchema] | None) -> None:
    """A schema pinned to a section must not describe a field found only elsewhere."""
    found: dict[str, set[str]] = {}
    for section, fields in zip(SECTIONS, sections):
        for name in fields:
            found.setdefault(name, set()).add(section)
    for name, schema in (schemas or {}).items():
        declared = schema_section(name, schema)
        actual = found.get(name)
        if declared is None or not actual or declared in actual:
            continue
        raise ValueError(f"FieldSchema for {name!r} declares section {declared!r}, but data "
                         f"contains it in {', '.join(repr(s) for s in sorted(actual))}")


def object_column(name: str, value: Any) -> np.ndarray:
    """A non-tensor field as a 1-D object-or-typed ndarray."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray)):
        array = np.empty(len(value), dtype=object)
        array[:] = list(value)
        return array
    raise TypeError(f"non_tensor_batch field {name!r} with FieldSchema must be an ndarray or "
                    "non-string sequence")


# -- flat dicts -------------------------------------------------------------------------


def _is_sequence(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def _is_dense(value: Any) -> bool:
    torch = tensor_codec.loaded_torch()
    if torch is not None and isinstance(value, torch.Tensor):
        return value.ndim > 0
    return isinstance(value, np.ndarray) and value.dtype != object and value.ndim > 0


def _rows_of(data: Mapping[str, Any], schemas: Mapping[str, FieldSchema]) -> tuple[int, bool]:
    """The flat dict's row count and whether schemas fixed it."""
    pinned = set()
    for name, schema in schemas.items():
        if name in data and schema_section(name, schema) in ("batch", "non_tensor_batch"):
            try:
                pinned.add(len(data[name]))
            except TypeError:
                raise ValueError(f"flat dict row-aligned field {name!r} must be sized") from None
    if len(pinned) > 1:
        raise ValueError(f"flat dict fields have inconsistent batch sizes: {sorted(pinned)}")
    if pinned:
        return pinned.pop(), True
    meta = {n for n, s in schemas.items() if n in data and schema_section(n, s) == "meta_info"}
    candidates = {k: v for k, v in data.items() if k not in meta}
    dense = {len(v) for v in candidates.values() if _is_dense(v)}
    if len(dense) > 1:
        raise ValueError(f"flat dict dense fields have ambiguous batch sizes: {sorted(dense)}")
    if dense:
        return dense.pop(), False
    sized = {len(v) for v in candidates.values()
             if (isinstance(v, np.ndarray) and v.ndim > 0) or _is_sequence(v)}
    if len(sized) > 1:
        raise ValueError(f"flat dict fields have ambiguous batch sizes: {sorted(sized)}; pass "
                         "FieldSchema metadata['section'] for list-valued metadata fields")
    return (sized.pop() if sized else 0), False


def _flat_column(name: str, value: Any, rows: int, schema: FieldSchema | None) -> Any:
    if not (isinstance(value, np.ndarray) or _is_sequence(value)):
        raise TypeError(f"flat dict non_tensor_batch field {name!r} must be an ndarray or "
                        "non-string sequence")
    if len(value) != rows:
        raise ValueError(f"flat dict non_tensor_batch field {name!r} has batch size "
                         f"{len(value)}, expected {rows}")
    if not isinstance(value, np.ndarray):
        return object_column(name, value)
    dtype = schema_dtype(schema) if schema is not None else None
    if schema is not None and schema.codec == "ndarray" and dtype is not None and (
            value.dtype != object or all(v is not None for v in value)):
        return np.asarray(value, dtype=dtype)
    return value


def flat_dict_to_envelope(data: Any, schemas: Mapping[str, FieldSchema] | None = None
                          ) -> dict[str, dict[str, Any]]:
    """Sort a flat dict into sections: row-aligned dense arrays -> batch, row-aligned
    sequences -> non_tensor_batch, the rest -> meta_info (schemas may pin a section)."""
    if not isinstance(data, Mapping):
        raise TypeError("flat dict payload must be a mapping")
    schemas = schemas or {}
    rows, pinned = _rows_of(data, schemas)
    out: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for name, value in data.items():
        schema = schemas.get(name)
        section = None if schema is None else schema_section(name, schema)
        if section is None:
            if rows and _is_dense(value) and len(value) == rows:
                section = "batch"
            elif not pinned and _is_sequence(value) and len(value) == rows:
                section = "non_tensor_batch"
            else:
                section = "meta_info"
        if section == "non_tensor_batch":
            value = _flat_column(name, value, rows, schema)
        out[section][name] = value
    return out


def envelope_to_flat_dict(data: Mapping[str, Any]) -> dict[str, Any]:
    """The sections merged into one dict (object arrays become lists)."""
    meta, batch, non_tensor = (_as_dict(data.get(s)) for s in ("meta_info", "batch",
                                                               "non_tensor_batch"))
    overlap = (set(meta) & set(batch)) | (set(meta) & set(non_tensor)) | \
        (set(batch) & set(non_tensor))
    if overlap:
        raise ValueError(f"Duplicate keys found across DataProto sections: {sorted(overlap)}")
    flat = {**meta, **batch}
    for name, value in non_tensor.items():
        flat[name] = value.tolist() if isinstance(value, np.ndarray) and value.dtype == object \
            else value
    return flat


def build_result(batch: dict[str, Any], non_tensor: dict[str, Any], meta: dict[str, Any],
                 data_cls: Any) -> Any:
    """The envelope dict, or ``data_cls`` built from it (``from_dict`` if it has one)."""
    if data_cls is None or data_cls is dict:
        return {"batch": batch, "non_tensor_batch": non_tensor, "meta_info": meta}
    try:
        from_dict = getattr(data_cls, "from_dict", None)
        if callable(from_dict):
            return from_dict(batch, non_tensor, meta_info=meta)
        return data_cls(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)
    except TypeError as exc:
        raise TypeError(f"{getattr(data_cls, '__name__', data_cls)!r} cannot be constructed "
                        "from batch, non_tensor_batch, and meta_info") from exc


# -- selections -------------------------------------------------------------------------


@dataclass(frozen=True)
class RowSelection:
    """Rows to read: a slice, or explicit indices (normalized, possibly repeated)."""

    count: int
    rows: StructuredMemberSlice | None = None
    indices: tuple[int, ...] | None = None


def select_rows(rows: Any, total: int) -> RowSelection | None:
    """Validate a ``rows=`` argument against ``total`` rows (None: all rows)."""
    if rows is None:
        return None
    if isinstance(rows, StructuredMemberSlice):
        if rows.axis != 0:
            raise ValueError("DataProto row slicing currently supports axis=0 only")
        return RowSelection(rows.count(total), rows=rows)
    if isinstance(rows, slice):
        start, end, step = rows.indices(total)
        if step <= 0:
            raise ValueError("DataProto row slicing step must be positive")
        chosen = StructuredMemberSlice(0, start, end, step)
        return RowSelection(chosen.count(total), rows=chosen)
    if isinstance(rows, Sequence) and not isinstance(rows, (str, bytes, bytearray)):
        indices = []
        for index in rows:
            if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
                raise TypeError("DataProto row indices must be integers")
            position = int(index) + (total if int(index) < 0 else 0)
            if not 0 <= position < total:
                raise IndexError(f"DataProto row index {index} out of range for {total} rows")
            indices.append(position)
        return RowSelection(len(indices), indices=tuple(indices))
    raise TypeError("DataProto rows must be a slice, StructuredMemberSlice, or row index "
                    "sequence")


def select_fields(ref: MooncakeDataProtoRef, fields: Sequence[str] | None,
                  batch_fields: Sequence[str] | None,
                  non_tensor_fields: Sequence[str] | None) -> list[str]:
    """The field names to read, batch fields first."""
    if fields is not None and (batch_fields is not None or non_tensor_fields is not None):
        raise ValueError("fields cannot be combined with batch_fields or non_tensor_fields")
    if fields is not None:
        names = list(fields)
    elif batch_fields is None and non_tensor_fields is None:
        names = list(ref.field_index)
    else:
        names = [*(batch_fields or []), *(non_tensor_fields or [])]
    unknown = [n for n in names if n not in ref.field_index]
    if unknown:
        raise KeyError(f"unknown DataProto fields: {unknown}")
    return [n for n in names if ref.field_index[n].section == "batch"] + \
        [n for n in names if ref.field_index[n].section == "non_tensor_batch"]
