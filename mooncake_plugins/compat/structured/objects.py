"""Structured objects: JSON metadata plus named members, each with a recorded encoding.

The metadata blob of the bundle is the caller's metadata with ``layout`` (default
``"structured"``) and, under ``__mooncake_structured_fields__``, one spec per member:

* ``{"encoding": "ndarray", "dtype", "shape"}``: the array's C-order bytes;
* ``{"encoding": "torch_tensor", ...}``: a tensor (store tensor object, ``torch.save``
  blob, or jagged nested tensor parts);
* ``{"encoding": "bytes"}``: anything bytes-like.

Reads resolve the manifest, then read each selected member, whole or a row slice, into a
new array, a pool-backed array or a caller destination.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import tensor_codec
from .manifest import BundleManifestStore, check_segment, decode_json, encode_json
from .payloads import (DirectCopyPayload, MultiBufferPayload, RawDestination,
                       TensorObjectBuffer, TensorPayload, array_at)
from .records import (FIELD_SPECS_KEY, BundleTransferPolicy, RemoteBundleRef,
                      StructuredMemberSlice, StructuredObjectPayload, StructuredObjectReadSpec,
                      StructuredObjectResult)
from .transport import PayloadTransport

BYTES_SPEC = {"encoding": "bytes"}


def encode_metadata(metadata: Mapping[str, Any]) -> bytes:
    return encode_json(metadata, "structured metadata")


def decode_metadata(payload: bytes) -> dict[str, Any]:
    return decode_json(payload, "structured metadata")


def field_specs(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The per-member encodings recorded in a structured object's metadata."""
    specs = metadata.get(FIELD_SPECS_KEY, {})
    if not isinstance(specs, dict):
        raise ValueError("structured field specs must be a dict")
    return specs


def encode_member(value: Any) -> tuple[dict[str, Any], Any]:
    """The field spec of one member and the payload to store for it."""
    if isinstance(value, TensorObjectBuffer):
        return {"encoding": "torch_tensor"}, value
    if isinstance(value, TensorPayload):
        return tensor_codec.tensor_field(value.tensor)
    if isinstance(value, (DirectCopyPayload, MultiBufferPayload)):
        if value.dtype is not None and value.shape is not None:
            return {"encoding": "ndarray", "dtype": value.dtype,
                    "shape": list(value.shape)}, value
        return dict(BYTES_SPEC), value
    torch = tensor_codec.loaded_torch()
    if torch is not None and isinstance(value, torch.Tensor):
        return tensor_codec.tensor_field(value)
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        return {"encoding": "ndarray", "dtype": array.dtype.str,
                "shape": list(array.shape)}, array.view(np.uint8).reshape(-1)
    return dict(BYTES_SPEC), value


def encode_object(metadata: Any, members: Mapping[str, Any]
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Metadata (with the member specs) and payloads of a structured object."""
    if not isinstance(metadata, Mapping):
        raise TypeError("structured metadata must be a mapping")
    meta = dict(metadata)
    if FIELD_SPECS_KEY in meta:
        raise ValueError(f"structured metadata key {FIELD_SPECS_KEY!r} is reserved")
    if not isinstance(meta.get("layout", "structured"), str):
        raise ValueError("structured metadata layout must be a string")
    meta.setdefault("layout", "structured")
    specs: dict[str, Any] = {}
    payloads: dict[str, Any] = {}
    for name, value in members.items():
        check_segment(name, "buffer name")
        specs[name], payloads[name] = encode_member(value)
    if specs:
        meta[FIELD_SPECS_KEY] = specs
    return meta, payloads


def merge_stage_metadata(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """Metadata of a DataProto stage after appending ``new``'s members to ``old``'s."""
    if old.get("dataproto") != new.get("dataproto"):
        raise ValueError("DataProto stage metadata mismatch during manifest merge")
    specs = dict(field_specs(old))
    added = field_specs(new)
    clash = sorted(set(specs) & set(added))
    if clash:
        raise ValueError(f"structured members already exist: {clash}")
    specs.update(added)
    merged = dict(old)
    if specs:
        merged[FIELD_SPECS_KEY] = specs
    return merged


def ndarray_destination(name: str, destination: Any, dtype: np.dtype,
                        shape: tuple[int, ...]) -> np.ndarray:
    """Where an ndarray member of ``dtype``/``shape`` is read to: a new array, raw
    caller memory, or a caller array that must match exactly."""
    if destination is None:
        return np.empty(shape, dtype=dtype)
    if isinstance(destination, RawDestination):
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if destination.size < nbytes:
            raise ValueError(f"raw destination has {destination.size} bytes, expected at "
                             f"least {nbytes}")
        return array_at(destination.ptr, dtype, shape)
    if not isinstance(destination, np.ndarray):
        raise TypeError(f"structured ndarray field {name} destination must be a "
                        "numpy.ndarray or raw_destination")
    if destination.dtype != dtype:
        raise ValueError(f"structured ndarray field {name} destination dtype mismatch: "
                         f"expected {dtype.str}, got {destination.dtype.str}")
    if tuple(destination.shape) != shape:
        raise ValueError(f"structured ndarray field {name} destination shape mismatch: "
                         f"expected {shape}, got {tuple(destination.shape)}")
    if not destination.flags["C_CONTIGUOUS"]:
        raise ValueError(f"structured ndarray field {name} destination must be C-contiguous")
    if not destination.flags["WRITEABLE"]:
        raise ValueError(f"structured ndarray field {name} destination must be writeable")
    return destination


def ndarray_spec(name: str, spec: Mapping[str, Any]) -> tuple[np.dtype, tuple[int, ...]]:
    dtype, shape = spec.get("dtype"), spec.get("shape")
    if not isinstance(dtype, str) or not isinstance(shape, list):
        raise ValueError(f"structured ndarray field {name} is missing dtype or shape")
    return np.dtype(dtype), tuple(int(d) for d in shape)


def tensor_row_layout(name: str, payload: Mapping[str, Any],
                      spec: Mapping[str, Any]) -> tuple[int, list[int], int]:
    """``(header bytes, shape, bytes per row)`` of a stored tensor object."""
    header = int(payload.get("metadata_bytes", -1))
    shape = spec.get("shape")
    element = int(spec.get("element_size", 0))
    if header < 0 or not isinstance(shape, list) or element <= 0:
        raise ValueError(f"structured tensor field {name} is missing slice metadata")
    if not shape:
        raise ValueError("structured tensor slicing requires at least one dimension")
    return header, shape, element * int(np.prod(shape[1:], dtype=np.int64))


def _check_tensor_destination(name: str, destination: Any) -> None:
    if not isinstance(destination, (TensorObjectBuffer, RawDestination)):
        raise ValueError(f"structured tensor member {name} only supports tensor_object_buffer "
                         "or raw_destination destinations")


class StructuredObjectLayer:
    """Structured objects over a :class:`BundleManifestStore`."""

    def __init__(self, bundles: BundleManifestStore, transport: PayloadTransport) -> None:
        self._bundles = bundles
        self._io = transport

    def put(self, payload: StructuredObjectPayload, partition: str, chunk_bytes: int | None,
            policy: BundleTransferPolicy | None, max_inflight_put: int | None,
            config: Any = None) -> RemoteBundleRef:
        metadata, members = encode_object(payload.metadata, payload.buffers)
        policy = (policy or BundleTransferPolicy()).validated(max_inflight_put)
        return self._bundles.put_bundle(encode_metadata(metadata), members, partition,
                                        chunk_bytes, policy, None, config)

    def read_metadata(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        return decode_metadata(self._io.read(manifest["meta"]))

    def materialize_into(self, spec: StructuredObjectReadSpec,
                         destinations: Mapping[str, Any] | None) -> StructuredObjectResult:
        if spec.member_names is not None and not spec.member_names:
            raise ValueError("structured read spec selected no members")
        manifest = self._bundles.resolve_manifest(spec.ref)
        metadata = self.read_metadata(manifest)
        buffers = manifest["buffers"]
        names = list(buffers) if spec.member_names is None else list(spec.member_names)
        unknown = [n for n in names if n not in buffers]
        if unknown:
            raise KeyError(f"unknown bundle buffers: {unknown}")
        specs = field_specs(metadata)
        slices = dict(spec.member_slices)
        destinations = destinations or {}
        objects = {name: self.read_member(name, buffers[name], specs.get(name, BYTES_SPEC),
                                          slices.get(name), destinations.get(name))
                   for name in names}
        return StructuredObjectResult(dict(metadata), objects)

    def read_member(self, name: str, payload: Mapping[str, Any], spec: Mapping[str, Any],
                    rows: StructuredMemberSlice | None, destination: Any) -> Any:
        encoding = spec.get("encoding", "bytes")
        if encoding == "bytes":
            return self._read_bytes(name, payload, rows, destination)
        if encoding == "torch_tensor":
            return self._read_tensor(name, payload, spec, rows, destination)
        if encoding == "ndarray":
            return self._read_ndarray(name, payload, spec, rows, destination)
        raise ValueError(f"unsupported structured field encoding: {encoding}")

    def _read_bytes(self, name: str, payload: Mapping[str, Any],
                    rows: StructuredMemberSlice | None, destination: Any) -> Any:
        if rows is not None:
            raise ValueError(f"structured bytes member {name} does not support slicing")
        if destination is not None:
            raise ValueError(f"structured bytes member {name} does not support "
                             "materialize_into")
        total = int(payload.get("bytes", 0))
        if total > 0:
            pooled = self._io.read_into_pool_array(payload, np.dtype(np.uint8), (total,), 0)
            if pooled is not None:
                return pooled
        return self._io.read(payload)

    def _read_ndarray(self, name: str, payload: Mapping[str, Any], spec: Mapping[str, Any],
                      rows: StructuredMemberSlice | None, destination: Any) -> np.ndarray:
        dtype, shape = ndarray_spec(name, spec)
        start, count, step = 0, (shape[0] if shape else 1), 1
        out_shape = shape
        if rows is not None:
            if rows.axis != 0:
                raise ValueError("structured ndarray slicing currently supports axis=0 only")
            if not shape:
                raise ValueError("structured ndarray slicing requires at least one dimension")
            start, end, step = rows.bounds(shape[0])
            count = len(range(start, end, step))
            out_shape = (count, *shape[1:])
        row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64)) if shape else \
            dtype.itemsize
        offset = start * row_bytes
        covered = (count - 1) * step + 1 if count else 0      # rows spanned by the slice
        nbytes = covered * row_bytes
        if destination is None and nbytes and step == 1:
            pooled = self._io.read_into_pool_array(payload, dtype, out_shape, offset)
            if pooled is not None:
                return pooled
        target = ndarray_destination(name, destination, dtype, out_shape)
        if nbytes == 0:
            return target
        if step == 1:
            if isinstance(destination, RawDestination) and destination.pre_registered:
                self._io.read_ranges_to_address(payload, destination.ptr, [(offset, 0, nbytes)])
            else:
                self._io.read_into(payload, target.view(np.uint8).reshape(-1), offset)
            return target
        span = np.empty((covered, *shape[1:]), dtype=dtype)
        self._io.read_into(payload, span.view(np.uint8).reshape(-1), offset)
        target[...] = span[::step]
        return target

    def _read_tensor(self, name: str, payload: Mapping[str, Any], spec: Mapping[str, Any],
                     rows: StructuredMemberSlice | None, destination: Any) -> Any:
        if spec.get("nested"):
            if destination is not None:
                raise ValueError(f"structured nested tensor member {name} does not support "
                                 "destinations")
            value = tensor_codec.nested_from_bytes(self._io.read(payload), spec)
            if rows is None:
                return value
            if rows.axis != 0:
                raise ValueError("structured nested tensor slicing currently supports axis=0 "
                                 "only")
            return tensor_codec.nested_rows(value, range(*rows.bounds(len(value))))
        if rows is not None:
            return self._read_tensor_rows(name, payload, spec, rows, destination)
        if destination is not None:
            _check_tensor_destination(name, destination)
            got = self._io.read_tensor_into(payload, destination)
            return destination if got is None else got
        if payload.get("kind") == "tensor":
            return self._io.read_tensor(payload)
        if payload.get("format") == "torch_save":
            return tensor_codec.torch_load_bytes(self._io.read(payload))
        return tensor_codec.from_bytes(self._io.read(payload))

    def _read_tensor_rows(self, name: str, payload: Mapping[str, Any],
                          spec: Mapping[str, Any], rows: StructuredMemberSlice,
                          destination: Any) -> Any:
        if payload.get("format") == "torch_save":
            if destination is not None:
                raise ValueError(f"structured torch_save tensor member {name} does not "
                                 "support destinations")
            if rows.axis != 0:
                raise ValueError("structured tensor slicing currently supports axis=0 only")
            value = tensor_codec.torch_load_bytes(self._io.read(payload))
            start, end, step = rows.bounds(len(value))
            return value[start:end:step]
        header, shape, row_bytes = tensor_row_layout(name, payload, spec)
        if rows.axis != 0:
            raise ValueError("structured tensor slicing currently supports axis=0 only")
        start, end, step = rows.bounds(int(shape[0]))
        if step != 1:
            raise ValueError("structured tensor slicing currently requires step=1")
        count = max(0, end - start)
        return self.read_tensor_rows(name, payload, header, shape, row_bytes,
                                     [(header + start * row_bytes, 0, count * row_bytes)]
                                     if count else [], count, destination)

    def read_tensor_rows(self, name: str, payload: Mapping[str, Any], header: int,
                         shape: list[int], row_bytes: int, ranges: list[tuple[int, int, int]],
                         count: int, destination: Any) -> Any:
        """A tensor of ``count`` rows gathered by ``ranges`` (source offsets in the stored
        object, destination offsets relative to the data), or written, with its patched
        header, into ``destination``."""
        data_bytes = count * row_bytes
        meta = tensor_codec.sliced_header(self._io.read_range(payload, 0, header),
                                          (count, *shape[1:]), data_bytes)
        if destination is None:
            data = bytearray(data_bytes)
            self._io.read_ranges_into(payload, data, ranges)
            return tensor_codec.from_bytes(meta + bytes(data))
        _check_tensor_destination(name, destination)
        if destination.size < header + data_bytes:
            raise ValueError(f"tensor destination has {destination.size} bytes, expected at "
                             f"least {header + data_bytes}")
        ctypes.memmove(destination.ptr, meta, header)
        if data_bytes:
            if isinstance(destination, RawDestination) and destination.pre_registered:
                self._io.read_ranges_to_address(
                    payload, destination.ptr, [(s, header + d, n) for s, d, n in ranges])
            else:
                data = bytearray(data_bytes)
                self._io.read_ranges_into(payload, data, ranges)
                ctypes.memmove(destination.ptr + header, bytes(data), data_bytes)
        return destination
