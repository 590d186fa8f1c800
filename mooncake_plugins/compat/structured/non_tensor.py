"""Encoding DataProto ``non_tensor_batch`` columns (object arrays) into codec payloads.

Three ways in: an explicit :class:`FieldSchema` codec (:func:`encode_with_schema`), safe
inference with fallbacks for ``codec="auto"`` (:func:`encode_with_fallback`), and plain
inference for object columns without a schema (:func:`encode_inferred`). Columns of
containers holding tensors, arrays or byte strings become ``structured_recursive``: the
container skeleton (per node: missing/row-mask/length arrays) plus one codec column per
leaf path, so large leaves keep their binary codecs and partial reads stay possible.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import codecs
from .inference import (MISSING, CodecDecision, InferredLeaf, InferredNode, Missing,
                        choose_leaf_codec, escape_key, infer_structure)
from .records import FieldSchema

RECURSIVE = "structured_recursive"
_FALLBACK_ERRORS = (TypeError, ValueError, OverflowError, RuntimeError, RecursionError)
_BINARY_LEAF_CODECS = frozenset({"ragged_tensor", "bytes_ragged", "media_bytes",
                                 "media_list_ragged"})
SCHEMA_SECTIONS = frozenset({"batch", "non_tensor_batch", "meta_info"})


@dataclass
class EncodedColumn:
    """A column's codec, row count, JSON metadata and named payload members."""

    codec: str
    rows: int
    payload: dict[str, Any]
    metadata: dict[str, Any]


def schema_dtype(schema: FieldSchema) -> np.dtype | None:
    """The numeric dtype a schema names in ``metadata["dtype"]``, if any."""
    name = schema.metadata.get("dtype")
    if name is None:
        return None
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"invalid FieldSchema metadata['dtype']: {name!r}") from exc
    if dtype.kind not in "biufc":
        raise ValueError(f"FieldSchema metadata['dtype'] must be numeric or bool, got {dtype}")
    return dtype


def check_nullable(path: str, values: Sequence[Any], schema: FieldSchema) -> None:
    if not schema.nullable and any(v is None for v in values):
        raise ValueError(f"FieldSchema for {path!r} is not nullable")


def encode_with_schema(path: str, value: Any, schema: FieldSchema) -> EncodedColumn:
    """Encode a column with the schema's codec (``"auto"``: :func:`encode_with_fallback`)."""
    values = list(value)
    check_nullable(path, values, schema)
    codec = schema.codec
    if codec == "auto":
        return encode_with_fallback(path, value)
    if codec == "ragged_tensor_dict":
        payload, metadata = codecs.encode_ragged_tensor_dict(values, schema.metadata.get("keys"))
        return EncodedColumn(codec, len(values), payload, metadata)
    dtype = schema_dtype(schema) if codec in ("typed_ragged", "ndarray") else None
    if codec == "ndarray" and dtype is None:
        return encode_with_fallback(path, value)
    if codec not in codecs.BYTE_CODECS | {"ragged_tensor", "typed_ragged", "ndarray",
                                          "media_list_ragged"}:
        raise ValueError(f"unsupported schema codec: {codec!r}")
    payload, metadata = codecs.encode_values(codec, path, values, dtype)
    return EncodedColumn(codec, len(values), payload, metadata)


def encode_with_fallback(path: str, value: Any) -> EncodedColumn:
    """Infer a codec, trying in turn: a recursive layout, the inferred leaf codec,
    msgpack, JSON. ValueError listing every failure when none fits."""
    values = list(value)
    errors: list[str] = []
    try:
        recursive = _recursive(path, values, schema_leaves=True)
        if recursive is not None:
            return recursive
    except _FALLBACK_ERRORS as exc:
        errors.append(f"{RECURSIVE}: {exc}")
    decision = choose_leaf_codec(values)
    for codec in dict.fromkeys([decision.codec, "msgpack_ragged", "json_ragged"]):
        metadata = dict(decision.metadata) if codec == decision.codec else {}
        try:
            return encode_with_schema(path, _plain_rows(values, codec),
                                      FieldSchema(codec=codec, metadata=metadata))
        except _FALLBACK_ERRORS as exc:
            errors.append(f"{codec}: {exc}")
    raise ValueError(f"unable to infer a safe codec for structured non-tensor field {path!r}; "
                     f"tried {errors}")


def encode_inferred(path: str, value: Any) -> EncodedColumn:
    """Encode an object column by inference alone (no fallbacks)."""
    values = list(value)
    recursive = _recursive(path, values, schema_leaves=False)
    if recursive is not None:
        return recursive
    decision = choose_leaf_codec(values)
    payload, metadata = codecs.encode_decided(values, decision, path)
    return EncodedColumn(decision.codec, len(values), payload, metadata)


def _plain(value: Any) -> Any:
    """numpy values as Python values, containers recursively (for msgpack/JSON)."""
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _plain_rows(values: list[Any], codec: str) -> list[Any]:
    return [_plain(v) for v in values] if codec in ("msgpack_ragged", "json_ragged") else values


def _worth_recursing(leaf: InferredLeaf) -> bool:
    decision = leaf.decision
    return decision.codec in _BINARY_LEAF_CODECS or (
        decision.codec == "typed_ragged" and decision.metadata.get("recursive_source") == "ndarray")


def _lookup(value: Any, steps: list[Any]) -> Any:
    for step in steps:
        if isinstance(step, str):
            if not isinstance(value, dict) or step not in value:
                return MISSING
        elif not isinstance(value, (list, tuple)) or step >= len(value):
            return MISSING
        value = value[step]
    return value


def path_steps(path: str) -> list[Any]:
    """An escaped path (``a.b[0].c\\.d``) as keys and list positions."""
    steps: list[Any] = []
    word: list[str] = []
    i = 0
    while i < len(path):
        char = path[i]
        if char == "\\" and i + 1 < len(path):
            word.append(path[i + 1])
            i += 2
            continue
        if char in ".[":
            if word:
                steps.append("".join(word))
                word = []
            if char == "[":
                close = path.index("]", i)
                steps.append(int(path[i + 1:close]))
                i = close + 1
                continue
        else:
            word.append(char)
        i += 1
    if word:
        steps.append("".join(word))
    return steps


def _recursive(path: str, values: list[Any], schema_leaves: bool) -> EncodedColumn | None:
    leaves: list[InferredLeaf] = []
    nodes: list[InferredNode] = []
    infer_structure(path, values, leaves, nodes)
    if not nodes or not any(_worth_recursing(leaf) for leaf in leaves):
        return None
    payload: dict[str, Any] = {}
    node_specs = []
    for index, node in enumerate(nodes):
        steps = path_steps(node.path[len(path):])
        spec: dict[str, Any] = {"id": index, "path": node.path, "node_type": node.node_type,
                                "children": list(node.children),
                                "missing_payload": f"node.{index}.missing"}
        payload[spec["missing_payload"]] = np.asarray(
            [_lookup(v, steps) is MISSING for v in values], dtype=np.bool_)
        if node.row_mask is not None:
            spec["row_mask_payload"] = f"node.{index}.row_mask"
            payload[spec["row_mask_payload"]] = np.asarray(node.row_mask, dtype=np.bool_)
        if node.lengths is not None:
            spec["lengths_payload"] = f"node.{index}.lengths"
            payload[spec["lengths_payload"]] = np.asarray(node.lengths, dtype=np.int64)
        node_specs.append(spec)
    leaf_specs = []
    for index, leaf in enumerate(leaves):
        missing = [v is MISSING for v in leaf.values]
        rows = [None if gone else v for gone, v in zip(missing, leaf.values)]
        decision = leaf.decision
        if not decision.accepted and codecs.all_absent(leaf.values):
            decision = CodecDecision(True, "json_ragged", "all rows are null or missing", "json")
        if schema_leaves:
            encoded = encode_with_schema(leaf.path, _object_rows(_plain_rows(rows, decision.codec)),
                                         FieldSchema(codec=decision.codec,
                                                     metadata=dict(decision.metadata)))
            leaf_payload, leaf_meta, codec = encoded.payload, encoded.metadata, encoded.codec
        else:
            leaf_payload, leaf_meta = codecs.encode_decided(rows, decision, leaf.path)
            codec = decision.codec
        members = {}
        for name, part in leaf_payload.items():
            members[name] = f"leaf.{index}.{name}"
            payload[members[name]] = part
        members["missing"] = f"leaf.{index}.missing"
        payload[members["missing"]] = np.asarray(missing, dtype=np.bool_)
        leaf_specs.append({"id": index, "path": leaf.path, "codec": codec, "rows": len(rows),
                           "metadata": leaf_meta, "payload_members": members})
    return EncodedColumn(RECURSIVE, len(values), payload, {
        "schema_source": "inferred_from_runtime_values", "structure_version": 1,
        "root_path": path, "nodes": node_specs, "leaves": leaf_specs})


def _object_rows(values: list[Any]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


# -- decoding ---------------------------------------------------------------------------


def decode_column(encoded: Mapping[str, Any], payload: Mapping[str, Any], rows: int,
                  metadata: Mapping[str, Any] | None = None) -> list[Any]:
    """Rows of an encoded column (``metadata`` overrides the recorded one, e.g. after a
    partial read adjusted it)."""
    codec = encoded.get("codec")
    metadata = encoded.get("metadata") or {} if metadata is None else metadata
    if codec == "ragged_tensor_dict":
        return codecs.decode_ragged_tensor_dict(payload, rows, metadata)
    if codec == RECURSIVE:
        return _decode_recursive(metadata, payload, rows)
    return codecs.decode_values(codec, payload, rows, metadata)


def _child_path(node: Mapping[str, Any], child: Any) -> str:
    if node["node_type"] == "dict":
        return f"{node['path']}.{escape_key(str(child))}"
    return f"{node['path']}[{int(child)}]"


def _decode_recursive(metadata: Mapping[str, Any], payload: Mapping[str, Any],
                      rows: int) -> list[Any]:
    columns: dict[str, list[Any]] = {}
    for leaf in metadata.get("leaves", []):
        members = leaf["payload_members"]
        values = codecs.decode_values(
            leaf["codec"], {n: payload[m] for n, m in members.items() if n != "missing"},
            rows, leaf.get("metadata"))
        missing = payload[members["missing"]]
        columns[leaf["path"]] = [MISSING if bool(missing[r]) else values[r] for r in range(rows)]
    # innermost containers first, so every child column exists when its parent is built
    nodes = sorted(metadata.get("nodes", []),
                   key=lambda n: n["path"].count(".") + n["path"].count("["), reverse=True)
    for node in nodes:
        missing = payload[node["missing_payload"]] if node.get("missing_payload") else None
        mask = payload[node["row_mask_payload"]] if node.get("row_mask_payload") else None
        lengths = payload[node["lengths_payload"]] if node.get("lengths_payload") else None
        children = [(child, columns[_child_path(node, child)]) for child in node["children"]]
        built: list[Any] = []
        for row in range(rows):
            if missing is not None and bool(missing[row]):
                built.append(MISSING)
            elif mask is not None and not bool(mask[row]):
                built.append(None)
            elif node["node_type"] == "dict":
                built.append({child: column[row] for child, column in children
                              if not isinstance(column[row], Missing)})
            else:
                length = int(lengths[row]) if lengths is not None else len(children)
                item: list[Any] = [None] * length
                for child, column in children:
                    if int(child) < length and not isinstance(column[row], Missing):
                        item[int(child)] = column[row]
                built.append(item)
        columns[node["path"]] = built
    return columns[metadata["root_path"]]
