"""Reading chosen rows of stored DataProto fields without fetching whole members.

Plain members (ndarrays, tensor objects) are gathered row by row with ranged reads.
Encoded ``non_tensor_batch`` columns are gathered payload by payload: per-row arrays
(``nulls``, ``shapes``, ...) by row, and ``data`` by the element or byte spans its
``offsets`` give for the chosen rows; offsets are rebuilt for the gathered rows, so the
result decodes with the column's ordinary decoder.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import codecs, tensor_codec
from .non_tensor import RECURSIVE
from .objects import (BYTES_SPEC, StructuredObjectLayer, field_specs, ndarray_destination,
                      ndarray_spec, tensor_row_layout)
from .payloads import RawDestination
from .manifest import BundleManifestStore
from .records import RemoteBundleRef
from .transport import PayloadTransport, Range


def coalesce(ranges: Sequence[Range]) -> list[Range]:
    """Merge ranges that continue each other in both source and destination."""
    merged: list[list[int]] = []
    for src, dst, n in ranges:
        if not n:
            continue
        if merged and merged[-1][0] + merged[-1][2] == src and merged[-1][1] + merged[-1][2] == dst:
            merged[-1][2] += n
        else:
            merged.append([src, dst, n])
    return [(s, d, n) for s, d, n in merged]


def _row_ranges(indices: Sequence[int], row_bytes: int, base: int = 0) -> list[Range]:
    return coalesce([(base + row * row_bytes, out * row_bytes, row_bytes)
                     for out, row in enumerate(indices)])


def _gathered_offsets(begins: np.ndarray, ends: np.ndarray) -> np.ndarray:
    out = np.zeros(len(begins) + 1, dtype=np.int64)
    np.cumsum(np.asarray(ends, dtype=np.int64) - np.asarray(begins, dtype=np.int64),
              out=out[1:])
    return out


class RowReader:
    """Row gathers over one stage bundle."""

    def __init__(self, bundles: BundleManifestStore, objects: StructuredObjectLayer,
                 transport: PayloadTransport, stage_ref: RemoteBundleRef) -> None:
        self._io = transport
        self._objects = objects
        self._manifest = bundles.resolve_manifest(stage_ref)
        self._stage_ref = stage_ref
        self._specs = field_specs(objects.read_metadata(self._manifest))

    def _payload(self, member: str) -> Mapping[str, Any]:
        buffers = self._manifest["buffers"]
        if member not in buffers:
            raise KeyError(f"unknown bundle buffers: {[member]}")
        return buffers[member]

    # -- plain members ------------------------------------------------------------------

    def member_rows(self, member: str, indices: Sequence[int], destination: Any = None) -> Any:
        """Rows ``indices`` of an ndarray or tensor member."""
        spec = self._specs.get(member, BYTES_SPEC)
        encoding = spec.get("encoding", "bytes")
        payload = self._payload(member)
        if encoding == "ndarray":
            return self._ndarray_rows(member, payload, spec, indices, destination)
        if encoding != "torch_tensor":
            raise ValueError(f"structured member {member} does not support indexed rows")
        if spec.get("nested"):
            whole = self._objects.read_member(member, payload, spec, None, destination)
            return tensor_codec.nested_rows(whole, indices)
        if payload.get("format") == "torch_save":
            if destination is not None:
                raise ValueError(f"structured torch_save tensor member {member} does not "
                                 "support destinations")
            return tensor_codec.torch_load_bytes(self._io.read(payload))[list(indices)]
        header, shape, row_bytes = tensor_row_layout(member, payload, spec)
        return self._objects.read_tensor_rows(member, payload, header, shape, row_bytes,
                                              _row_ranges(indices, row_bytes, header),
                                              len(indices), destination)

    def _ndarray_rows(self, member: str, payload: Mapping[str, Any], spec: Mapping[str, Any],
                      indices: Sequence[int], destination: Any) -> np.ndarray:
        dtype, shape = ndarray_spec(member, spec)
        if not shape:
            raise ValueError("structured ndarray indexed read requires at least one dimension")
        out_shape = (len(indices), *shape[1:])
        row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        ranges = _row_ranges(indices, row_bytes)
        if isinstance(destination, RawDestination):
            target = ndarray_destination(member, destination, dtype, out_shape)
            if destination.pre_registered:
                self._io.read_ranges_to_address(payload, destination.ptr, ranges)
            elif ranges:
                data = bytearray(target.nbytes)
                self._io.read_ranges_into(payload, data, ranges)
                ctypes.memmove(destination.ptr, bytes(data), len(data))
            return target
        target = ndarray_destination(member, destination, dtype, out_shape)
        if ranges:
            self._io.read_ranges_into(payload, target.view(np.uint8).reshape(-1), ranges)
        return target

    # -- encoded columns ----------------------------------------------------------------

    def encoded_rows(self, encoded: Mapping[str, Any], indices: Sequence[int]
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The payload of rows ``indices`` of an encoded column, and its metadata
        adjusted to those rows."""
        codec = encoded["codec"]
        members: Mapping[str, str] = encoded["payload_members"]
        metadata = dict(encoded.get("metadata") or {})

        def rows_of(name: str, which: Sequence[int] = indices) -> np.ndarray:
            return self.member_rows(members[name], which)

        if codec == RECURSIVE:
            payload: dict[str, Any] = {}
            for node in metadata.get("nodes", []):
                for key in ("missing_payload", "row_mask_payload", "lengths_payload"):
                    if node.get(key) is not None:
                        payload[node[key]] = rows_of(node[key])
            leaves = []
            for leaf in metadata.get("leaves", []):
                names = leaf["payload_members"]
                sub, sub_meta = self.encoded_rows(
                    {"codec": leaf["codec"], "metadata": leaf.get("metadata") or {},
                     "payload_members": {n: members[g] for n, g in names.items()
                                         if n != "missing"}}, indices)
                payload.update({names[n]: v for n, v in sub.items()})
                payload[names["missing"]] = rows_of(names["missing"])
                leaves.append({**leaf, "metadata": sub_meta})
            metadata["leaves"] = leaves
            return payload, metadata
        if codec == "ndarray":
            return {"data": rows_of("data"), "nulls": rows_of("nulls")}, metadata
        if codec == "ragged_tensor_dict":
            key_codecs = dict(metadata.get("key_codecs") or {})
            payload = {"null_mask": rows_of("null_mask")}
            for key in codecs.dict_keys(metadata.get("keys", [])):
                sub, key_codecs[key] = self.encoded_rows(
                    {"codec": "ragged_tensor", "metadata": key_codecs.get(key) or {},
                     "payload_members": codecs.key_payload(members, key, "manifest")}, indices)
                payload.update({f"{key}.{n}": v for n, v in sub.items()})
            metadata["key_codecs"] = key_codecs
            return payload, metadata
        if codec in ("ragged_tensor", "typed_ragged"):
            begins, ends = self._spans(members["offsets"], indices)
            data_spec = self._specs.get(members["data"], {})
            dtype = np.dtype(data_spec.get("dtype", "u1"))
            data = self._gather(members["data"], begins, ends, dtype)
            return {"data": data, "offsets": _gathered_offsets(begins, ends),
                    "shapes": rows_of("shapes"), "ndims": rows_of("ndims"),
                    "nulls": rows_of("nulls")}, metadata
        if codec in codecs.BYTE_CODECS:
            begins, ends = self._spans(members["offsets"], indices)
            if "media_encodings" in metadata:
                metadata["media_encodings"] = [metadata["media_encodings"][i] for i in indices]
            return {"data": self._gather(members["data"], begins, ends, None),
                    "offsets": _gathered_offsets(begins, ends),
                    "nulls": rows_of("nulls")}, metadata
        if codec == "media_list_ragged":
            first, last = self._spans(members["row_offsets"], indices)
            items = [i for a, b in zip(first, last) for i in range(int(a), int(b))]
            item_begins, item_ends = self._spans(members["byte_offsets"], items)
            if "media_encodings" in metadata:
                metadata["media_encodings"] = [metadata["media_encodings"][i] for i in items]
            return {"data": self._gather(members["data"], item_begins, item_ends, None),
                    "row_offsets": _gathered_offsets(first, last),
                    "byte_offsets": _gathered_offsets(item_begins, item_ends),
                    "nulls": rows_of("nulls")}, metadata
        raise ValueError(f"unknown structured non-tensor codec: {codec}")

    def _spans(self, offsets_member: str, indices: Sequence[int]
               ) -> tuple[np.ndarray, np.ndarray]:
        """``offsets[i]`` and ``offsets[i + 1]`` for each chosen row ``i``."""
        bounds = self.member_rows(offsets_member, [b for i in indices for b in (i, i + 1)])
        return bounds[0::2], bounds[1::2]

    def _gather(self, member: str, begins: np.ndarray, ends: np.ndarray,
                dtype: np.dtype | None) -> Any:
        """Elements (``dtype``) or bytes (None) ``begins[k]:ends[k]`` of a member, back
        to back."""
        unit = 1 if dtype is None else dtype.itemsize
        ranges, out = [], 0
        for begin, end in zip(begins.tolist(), ends.tolist()):
            ranges.append((begin * unit, out, (end - begin) * unit))
            out += (end - begin) * unit
        ranges = coalesce(ranges)
        if dtype is None:
            data = bytearray(out)
            self._io.read_ranges_into(self._payload(member), data, ranges)
            return bytes(data)
        array = np.empty(out // unit, dtype=dtype)
        if ranges:
            self._io.read_ranges_into(self._payload(member), array.view(np.uint8).reshape(-1),
                                      ranges)
        return array

