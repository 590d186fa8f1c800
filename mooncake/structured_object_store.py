"""``mooncake.structured_object_store``: the column/codec inference layer only.

Of the original module this provides how a batch of rows is split into leaf columns and
dict/list nodes and which codec each leaf gets: ``infer_structure``, ``MISSING``,
``_choose_leaf_codec``, ``_escape_key`` and the decision/leaf/node records, with the
original's names. The bundle store itself (``MooncakeBundleTransfer``, DataProto
references, manifests, the codecs' encoders and decoders) is not provided yet.
The implementation is :mod:`mooncake_plugins.store.structured.inference`.
"""

from __future__ import annotations

from mooncake_plugins.store.structured.inference import (
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

__all__ = ["MISSING", "infer_structure"]
