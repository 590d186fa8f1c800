"""Structured objects: batches of rows and named members stored as typed payloads.

Modules, bottom up: :mod:`.inference` (column/codec inference), :mod:`.records` (public
records), :mod:`.payloads` (member payload kinds, pool-backed results), :mod:`.writes`
(configs, status, cleanup), :mod:`.transport` (store IO), :mod:`.manifest` (bundles),
:mod:`.tensor_codec`, :mod:`.objects` (typed members), :mod:`.codecs` and
:mod:`.non_tensor` (column codecs), :mod:`.dataproto` (handles, envelopes, selections),
:mod:`.row_reads` (partial reads), :mod:`.bundle_transfer` (``MooncakeBundleTransfer``)
and :mod:`.catalog_transfer` (``DataProtoCatalogTransfer``). ``mooncake.
structured_object_store`` exposes them under the original Mooncake's names.
"""

from .inference import (
    MAX_DEPTH,
    MAX_LIST_LEN,
    MAX_STRUCT_KEYS,
    MISSING,
    CodecDecision,
    InferredLeaf,
    InferredNode,
    Missing,
    choose_leaf_codec,
    escape_key,
    infer_structure,
)

__all__ = [
    "MAX_DEPTH", "MAX_LIST_LEN", "MAX_STRUCT_KEYS", "MISSING", "CodecDecision",
    "InferredLeaf", "InferredNode", "Missing", "choose_leaf_codec", "escape_key",
    "infer_structure",
]
