"""Column/codec inference of structured objects (``mooncake_plugins.compat.structured``)
and its original names in ``mooncake.structured_object_store``."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys

import numpy as np
import pytest
from helpers import require_module

from mooncake_plugins.compat.structured import (
    MAX_DEPTH,
    MAX_LIST_LEN,
    MAX_STRUCT_KEYS,
    MISSING,
    choose_leaf_codec,
    escape_key,
    infer_structure,
)


@pytest.fixture
def torch():
    """torch for the tensor cases; the rest of this file needs none (CI has the CPU wheel)."""
    return require_module("torch", "torch is not installed (pip install torch==2.13.0, "
                                   "the CPU wheel that .ci/run installs)")


def infer(rows, path="r"):
    leaves, nodes = [], []
    infer_structure(path, rows, leaves, nodes)
    return leaves, nodes


def nest(levels):
    value = 1
    for _ in range(levels):
        value = {"a": value}
    return value


# --- leaf codecs ---------------------------------------------------------------------

def test_accepted_tensor_codec(torch):
    d = choose_leaf_codec([torch.ones(2, 3), torch.zeros(5)])
    assert (d.accepted, d.codec) == (True, "ragged_tensor")
    assert d.metadata == {"dtype": "torch.float32"}


@pytest.mark.parametrize("rows, codec, meta", [
    ([np.arange(3), np.ones(2)], "typed_ragged", {"recursive_source": "ndarray"}),
    ([[1, 2, 3], (4.5,), []], "typed_ragged", {"dtype": "float64"}),
    ([1, True, 3], "ndarray", {"dtype": "int64"}),
    ([1, np.int32(3)], "ndarray", {"dtype": "int32"}),          # numpy's promotion
    ([True, False], "ndarray", {"dtype": "bool"}),
    ([np.float32(1), 2.0], "ndarray", {"dtype": "float32"}),
    ([b"a", bytearray(b"b"), memoryview(b"c")], "bytes_ragged", {}),
    ([[b"x", b"y"], [b"z"]], "media_list_ragged", {}),
    (["a", None, "b"], "utf8_ragged", {}),
    ([{"a": 1}, [1, "x"], ("t",)], "msgpack_ragged", {}),
    ([[1, "x"], [2]], "msgpack_ragged", {}),           # not numeric: generic objects
    ([[[1, 2], [3]], [[4]]], "msgpack_ragged", {}),    # ragged nesting: no common array
])
def test_accepted_codecs(rows, codec, meta):
    d = choose_leaf_codec(rows)
    assert (d.accepted, d.codec, d.metadata) == (True, codec, meta)


@pytest.mark.parametrize("rows, codec, reason", [
    ([], "msgpack_ragged", "all rows are null"),
    ([None, MISSING], "msgpack_ragged", "all rows are null"),
    ([np.array(["s"]), np.array([1])], "msgpack_ragged", "object ndarray rows"),
    ([2 ** 70, 1], "ndarray", "integer out of range for int64"),
    ([300, np.int8(1)], "ndarray", "integer out of range for int8"),
    ([1, "a"], "msgpack_ragged", "no codec matched"),
    ([{"ok": 1}] * 200 + [object()], "msgpack_ragged", "no codec matched"),
])
def test_rejected_codecs(rows, codec, reason):
    d = choose_leaf_codec(rows)
    assert not d.accepted
    assert d.codec == codec
    assert d.reason.startswith(reason)


@pytest.mark.parametrize("rows, codec, reason", [
    (lambda t: [t.ones(1), t.ones(1, dtype=t.int64)], "ragged_tensor", "mixed tensor dtype"),
    (lambda t: [t.ones(1), [1.0]], "msgpack_ragged", "no codec matched"),
])
def test_rejected_tensor_codecs(torch, rows, codec, reason):
    test_rejected_codecs(rows(torch), codec, reason)


def test_tensor_shapes_may_differ_but_not_dtypes(torch):
    assert choose_leaf_codec([torch.ones(1), torch.ones(2, 2), None]).accepted
    assert not choose_leaf_codec([torch.ones(1), torch.ones(1, dtype=torch.float16)]).accepted


# --- structure -----------------------------------------------------------------------

def test_scalar_column_is_one_leaf():
    leaves, nodes = infer([1, 2, None])
    assert nodes == []
    assert [(leaf.path, leaf.values) for leaf in leaves] == [("r", [1, 2, None])]


def test_dict_children_missing_keys_and_null_rows():
    rows = [{"b": 1, "a": "x"}, None, {"a": None}]
    leaves, nodes = infer(rows)
    assert [(n.path, n.node_type, n.children, n.row_mask) for n in nodes] == [
        ("r", "dict", ["a", "b"], [True, False, True])]
    by_path = {leaf.path: leaf for leaf in leaves}
    assert [leaf.path for leaf in leaves] == ["r.a", "r.b"]   # key order
    assert by_path["r.a"].values == ["x", None, None]
    assert by_path["r.b"].values == [1, None, MISSING]
    assert by_path["r.b"].decision.codec == "ndarray"


def test_list_positions_lengths_and_missing():
    rows = [[{"k": 1}, {"k": 2}], None, [{"k": 3}], ({"k": 4}, None)]
    leaves, nodes = infer(rows)
    lst = nodes[0]
    assert (lst.node_type, lst.children, lst.lengths, lst.row_mask) == (
        "list", [0, 1], [2, 0, 1, 2], [True, False, True, True])
    assert [n.path for n in nodes] == ["r", "r[0]", "r[1]"]    # parent before children
    second = next(n for n in nodes if n.path == "r[1]")
    assert second.row_mask == [True, False, False, False]
    by_path = {leaf.path: leaf.values for leaf in leaves}
    assert by_path == {"r[0].k": [1, None, 3, 4], "r[1].k": [2, None, None, None]}


def test_short_list_position_is_missing_not_none():
    leaves, _ = infer([[[1], [2]], [[3]]])
    assert {leaf.path: leaf.values for leaf in leaves}["r[1]"] == [[2], MISSING]


def test_what_stays_a_leaf():
    numeric_lists = infer([[1, 2], [3]])
    assert numeric_lists[1] == [] and numeric_lists[0][0].decision.codec == "typed_ragged"
    long_list = [[{"k": i} for i in range(MAX_LIST_LEN + 1)]]
    assert infer(long_list)[1] == []
    wide = [{f"k{i}": i for i in range(MAX_STRUCT_KEYS + 1)}]
    assert infer(wide)[1] == []
    assert len(infer([{f"k{i}": i for i in range(MAX_STRUCT_KEYS)}])[0]) == MAX_STRUCT_KEYS
    non_str_keys = infer([{1: "a"}, {2: "b"}])
    assert non_str_keys[1] == [] and non_str_keys[0][0].decision.codec == "msgpack_ragged"
    mixed = infer([{"a": 1}, [1]])
    assert mixed[1] == [] and mixed[0][0].decision.codec == "msgpack_ragged"


def test_dict_of_tensors(torch):
    rows = [{"t": torch.arange(2), "s": 1.0}, {"t": torch.arange(3), "s": None}]
    leaves, nodes = infer(rows)
    codecs = {leaf.path: leaf.decision.codec for leaf in leaves}
    assert codecs == {"r.s": "ndarray", "r.t": "ragged_tensor"}
    assert {leaf.path: leaf for leaf in leaves}["r.t"].values[1] is rows[1]["t"]


# --- escaping and depth ---------------------------------------------------------------

@pytest.mark.parametrize("key, escaped", [
    ("plain", "plain"), ("a.b", "a\\.b"), ("a[0]", "a\\[0]"), ("a\\b", "a\\\\b"),
    ("\\.", "\\\\\\."), ("]", "]"),
])
def test_escape_key(key, escaped):
    assert escape_key(key) == escaped


def test_escaped_keys_in_paths():
    leaves, _ = infer([{"a.b": {"c[1]": 1}, "a": {"b": 2}}])
    assert sorted(leaf.path for leaf in leaves) == ["r.a.b", "r.a\\.b.c\\[1]"]


def test_depth_limit():
    leaves, nodes = infer([nest(MAX_DEPTH)])
    assert len(nodes) == MAX_DEPTH
    assert leaves[0].path == "r" + ".a" * MAX_DEPTH
    with pytest.raises(ValueError, match="deeper than 32"):
        infer([nest(MAX_DEPTH + 1)])


def test_depth_limit_counts_lists():
    def wrapped(levels):
        value = {"a": 1}
        for _ in range(levels):
            value = [value]
        return value

    leaves, nodes = infer([wrapped(MAX_DEPTH - 1)])     # list levels + the dict
    assert len(nodes) == MAX_DEPTH
    assert leaves[0].path == "r" + "[0]" * (MAX_DEPTH - 1) + ".a"
    with pytest.raises(ValueError):
        infer([wrapped(MAX_DEPTH)])


# --- MISSING ------------------------------------------------------------------------

def test_missing_is_a_singleton():
    assert repr(MISSING) == "<MISSING>"
    assert copy.deepcopy(MISSING) is MISSING
    assert pickle.loads(pickle.dumps(MISSING)) is MISSING
    assert type(MISSING)() is MISSING
    assert MISSING is not None


# --- the original's names --------------------------------------------------------------

def test_original_names_are_the_core():
    import mooncake.structured_object_store as sos

    assert sos.MISSING is MISSING
    assert sos.infer_structure is infer_structure
    assert sos._choose_leaf_codec is choose_leaf_codec
    assert sos._escape_key is escape_key
    leaves, nodes = [], []
    sos.infer_structure("r", [{"x": None}, {"y": 2}, None], leaves, nodes)
    assert isinstance(leaves[0], sos._InferredLeaf)
    assert isinstance(nodes[0], sos._InferredNode)
    assert isinstance(leaves[1].values[0], sos._Missing)


def test_import_loads_neither_torch_nor_numpy():
    code = ("import sys, mooncake.structured_object_store as s; "
            "s.infer_structure('r', [{'a': 'x', 'b': b'y'}], [], []); "
            "print('torch' in sys.modules, 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("hook, module, attr", [
    ("_concat_arrays_into", "payloads", "concat_arrays_into"),
    ("_has_tensor_codec_helpers", "tensor_codec", "has_tensor_codec"),
])
def test_hooks_patch_and_restore_the_implementation(hook, module, attr):
    """The original's tests monkeypatch these hooks; every pytest and unittest.mock
    version must set them in the implementation and put the original back."""
    import importlib
    from unittest import mock

    import mooncake.structured_object_store as sos

    impl = importlib.import_module(f"mooncake_plugins.compat.structured.{module}")
    original = getattr(impl, attr)
    assert getattr(sos, hook) is original

    def replacement():
        return None

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sos, hook, replacement)
        assert getattr(impl, attr) is replacement
        assert getattr(sos, hook) is replacement
    assert getattr(impl, attr) is original
    with mock.patch.object(sos, hook, replacement):
        assert getattr(impl, attr) is replacement
    assert getattr(impl, attr) is original
    assert getattr(sos, hook) is original
