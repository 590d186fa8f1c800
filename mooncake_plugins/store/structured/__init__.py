"""Structured objects: batches of rows (dicts, lists, tensors, scalars, text, bytes)
split into typed columns. So far the column/codec inference (:mod:`.inference`)."""

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
