"""``mooncake.structured_object_store``: the original's structured object / bundle store.

``MooncakeBundleTransfer`` stores bundles (metadata plus named byte buffers), structured
objects (typed members: arrays, tensors, bytes) and DataProtos (one structured object per
stage, non-tensor columns in typed codecs) through any store with the original's method
names. The implementation is :mod:`mooncake_plugins.compat.structured`; this module gives
it the original's names, private ones included.

Two of those names are hooks the original's tests replace: ``_concat_arrays_into`` (the
gather copy used for direct-copy payloads) and ``_has_tensor_codec_helpers`` (whether
tensors are stored as tensor objects). Setting either here sets it in the implementation.
"""

from __future__ import annotations

import importlib
import sys
import types

from mooncake_plugins.compat.structured.inference import (
    MAX_DEPTH as _INFER_MAX_DEPTH,
    MAX_LIST_LEN as _INFER_MAX_LIST_LEN,
    MAX_STRUCT_KEYS as _INFER_MAX_STRUCT_KEYS,
    MISSING,
    CodecDecision as _CodecDecision,
    InferredLeaf as _InferredLeaf,
    InferredNode as _InferredNode,
    Missing as _Missing,
    choose_leaf_codec as _choose_leaf_codec,
    escape_key as _escape_key,
    infer_structure,
)

_IMPL = "mooncake_plugins.compat.structured."
# name here -> (implementation module, name there); loaded on first use, so importing
# this module for the inference layer alone does not import numpy
_LAZY = {
    "MooncakeBundleTransfer": ("bundle_transfer", "MooncakeBundleTransfer"),
    "DATAPROTO_REF_HANDLE_TYPE": ("dataproto", "HANDLE_TYPE"),
    "DATAPROTO_REF_HANDLE_VERSION": ("dataproto", "HANDLE_VERSION"),
    "STORAGE_GROUP_ID": ("dataproto", "STORAGE_GROUP_ID"),
    "export_dataproto_ref": ("dataproto", "export_dataproto_ref"),
    "export_ref": ("dataproto", "export_dataproto_ref"),
    "import_dataproto_ref": ("dataproto", "import_dataproto_ref"),
    "import_ref": ("dataproto", "import_dataproto_ref"),
    "is_dataproto_ref_handle": ("dataproto", "is_dataproto_ref_handle"),
    "_decode_manifest": ("manifest", "decode_manifest"),
    "_encode_manifest": ("manifest", "encode_manifest"),
    "_encode_with_schema": ("non_tensor", "encode_with_schema"),
    "_DirectCopyPayload": ("payloads", "DirectCopyPayload"),
    "_MultiBufferPayload": ("payloads", "MultiBufferPayload"),
    "_RawDestinationBuffer": ("payloads", "RawDestination"),
    "_TensorObjectBufferPayload": ("payloads", "TensorObjectBuffer"),
    "_TensorPayload": ("payloads", "TensorPayload"),
    "raw_destination": ("payloads", "raw_destination"),
    "tensor_object_buffer": ("payloads", "tensor_object_buffer"),
    "_concat_arrays_into": ("payloads", "concat_arrays_into"),
    "_has_tensor_codec_helpers": ("tensor_codec", "has_tensor_codec"),
    "_config_for_grouped_keys": ("writes", "config_for_keys"),
    "_encode_typed_ragged_values": ("codecs", "encode_typed_ragged"),
    "_decode_typed_ragged_values": ("codecs", "decode_typed_ragged"),
    "_encode_typed_ragged_regular_ndarray_rows": ("codecs", "encode_regular_ndarray_rows"),
    "_encode_msgpack_ragged_values": ("codecs", "encode_msgpack_rows"),
    "_decode_msgpack_ragged_values": ("codecs", "decode_msgpack_rows"),
    **{name: ("records", name) for name in (
        "AUTO_PARALLEL_MIN_BYTES", "AUTO_PARALLEL_MIN_CHUNKS", "DEFAULT_BUNDLE_CHUNK_BYTES",
        "MISSING_OBJECT_ERROR", "BundleTransferPolicy", "FieldSchema", "MooncakeDataProtoRef",
        "RemoteBundleRef", "StructuredFieldLocation", "StructuredMemberSlice",
        "StructuredObjectPayload", "StructuredObjectReadSpec", "StructuredObjectResult")},
    "STRUCTURED_FIELD_SPECS_KEY": ("records", "FIELD_SPECS_KEY"),
}
# hooks the original's tests replace: assigning one here assigns it in the implementation
_HOOKS = ("_concat_arrays_into", "_has_tensor_codec_helpers")


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    return getattr(importlib.import_module(_IMPL + module), attr)


def _hook_property(name: str) -> property:
    """The hook ``name`` as a data descriptor of this module: reading and assigning it
    reach the implementation's attribute, deleting it puts the implementation's own value
    back, so tools that save and restore attributes (pytest's monkeypatch,
    unittest.mock) leave the implementation as they found it."""
    module, attr = _LAZY[name]
    own: list[object] = []          # the implementation's value before the first assignment

    def impl() -> types.ModuleType:
        return importlib.import_module(_IMPL + module)

    def get(_self: types.ModuleType) -> object:
        return getattr(impl(), attr)

    def put(_self: types.ModuleType, value: object) -> None:
        if not own:
            own.append(getattr(impl(), attr))
        setattr(impl(), attr, value)

    def reset(_self: types.ModuleType) -> None:
        if own:
            setattr(impl(), attr, own[0])

    return property(get, put, reset, doc=f"hook: {_IMPL}{module}.{attr}")


class _HookForwardingModule(types.ModuleType):
    """This module's class: its hooks are properties that forward to the implementation."""


for _hook in _HOOKS:
    setattr(_HookForwardingModule, _hook, _hook_property(_hook))
del _hook

sys.modules[__name__].__class__ = _HookForwardingModule

__all__ = [
    "AUTO_PARALLEL_MIN_BYTES", "AUTO_PARALLEL_MIN_CHUNKS", "DATAPROTO_REF_HANDLE_TYPE",
    "DATAPROTO_REF_HANDLE_VERSION", "DEFAULT_BUNDLE_CHUNK_BYTES", "MISSING",
    "MISSING_OBJECT_ERROR", "STORAGE_GROUP_ID", "STRUCTURED_FIELD_SPECS_KEY",
    "BundleTransferPolicy", "FieldSchema", "MooncakeBundleTransfer", "MooncakeDataProtoRef",
    "RemoteBundleRef", "StructuredFieldLocation", "StructuredMemberSlice",
    "StructuredObjectPayload", "StructuredObjectReadSpec", "StructuredObjectResult",
    "export_dataproto_ref", "export_ref", "import_dataproto_ref", "import_ref",
    "infer_structure", "is_dataproto_ref_handle", "raw_destination", "tensor_object_buffer",
]
