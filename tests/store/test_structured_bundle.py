"""The bundle store (``mooncake.structured_object_store``) over real store clients and a
live master: round trips, partial reads, tamper rejection and cleanup."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import require_module

from mooncake.dataproto_catalog import DataProtoCatalog, DataProtoCatalogTransfer
from mooncake.structured_object_store import (BundleTransferPolicy, MooncakeBundleTransfer,
                                              StructuredObjectPayload, export_dataproto_ref,
                                              import_dataproto_ref)
from mooncake_plugins.compat.store import MooncakeDistributedStore

torch = require_module("torch", "torch is not installed (pip install torch==2.13.0, the CPU wheel "
                                "that .ci/run installs)")


@pytest.fixture
def clients(master, metadata_server):
    """Two store clients of one master: a writer and a reader."""
    made = []
    for _ in range(2):
        store = MooncakeDistributedStore()
        assert store.setup("localhost", metadata_server.url, 16 << 20, 4 << 20, "tcp", "",
                           master.address) == 0
        made.append(store)
    yield made
    for store in made:
        assert store.close() == 0


def _keys_of(manifest: dict) -> list[str]:
    return [chunk["key"] for spec in (manifest["meta"], *manifest["buffers"].values())
            for chunk in spec["chunks"]]


def test_structured_object_round_trip_and_partial_reads(clients):
    writer, reader = (MooncakeBundleTransfer(c, key_prefix="sbt") for c in clients)
    weights = np.arange(12 * 8, dtype=np.float32).reshape(12, 8)
    tensor = torch.arange(40, dtype=torch.int64).reshape(10, 4)
    ref = writer.put_structured_object(
        StructuredObjectPayload({"kind": "demo"}, {"weights": weights, "raw": b"xyz",
                                                   "tensor": tensor}),
        chunk_bytes=64)
    assert len(ref.manifest["buffers"]["weights"]["chunks"]) == weights.nbytes // 64

    handle = {"manifest_key": ref.manifest_key}      # the reader fetches the manifest
    whole = reader.materialize(reader.read_spec(handle))
    assert whole.metadata["kind"] == "demo"
    assert np.array_equal(whole.objects["weights"], weights)
    assert whole.objects["raw"] == b"xyz"
    assert torch.equal(whole.objects["tensor"], tensor)

    part = reader.materialize(reader.read_spec(handle).select_members(["weights", "tensor"])
                              .slice_member("weights", 0, 3, 11, 2)
                              .slice_member("tensor", 0, 2, 7))
    assert np.array_equal(part.objects["weights"], weights[3:11:2])
    assert torch.equal(part.objects["tensor"], tensor[2:7])
    into = np.empty((4, 8), dtype=np.float32)
    reader.materialize_into(reader.read_spec(handle).slice_member("weights", 0, 8, 12),
                            {"weights": into})
    assert np.array_equal(into, weights[8:12])

    keys = [ref.manifest_key, *_keys_of(ref.manifest)]
    assert all(clients[0].is_exist(k) == 1 for k in keys)
    reader.remove_bundle(handle)
    assert all(clients[0].is_exist(k) == 0 for k in keys)


def test_dataproto_append_rows_handles_and_cleanup(clients):
    writer, reader = (MooncakeBundleTransfer(c, key_prefix="sbt-dp") for c in clients)
    ids = np.arange(24, dtype=np.int64).reshape(6, 4)
    text = np.asarray(["a", None, "ccc", "", "eeeee", "f"], dtype=object)
    ragged = np.empty(6, dtype=object)
    ragged[:] = [np.arange(i, dtype=np.int32) for i in range(6)]
    samples = np.asarray([{"t": torch.arange(i + 1), "n": i} for i in range(6)], dtype=object)
    ref = writer.put_dataproto({"batch": {"ids": ids},
                                "non_tensor_batch": {"text": text, "ragged": ragged,
                                                     "samples": samples},
                                "meta_info": {"step": 3}}, stage="rollout")
    first_manifest = ref.stage_refs["rollout"].manifest_key
    ref = writer.append_dataproto_fields(
        ref, {"batch": {"scores": np.linspace(0, 1, 6, dtype=np.float32)}}, stage="rollout")
    assert ref.encoded_non_tensor["samples"]["codec"] == "structured_recursive"
    handle = export_dataproto_ref(ref)
    json.dumps(handle)

    full = reader.get_dataproto(handle)
    assert np.array_equal(full["batch"]["ids"], ids)
    assert full["non_tensor_batch"]["text"].tolist() == text.tolist()
    rows = [5, 0, 3, 3]
    picked = reader.get_dataproto(import_dataproto_ref(handle), rows=rows)
    assert np.array_equal(picked["batch"]["ids"], ids[rows])
    assert picked["non_tensor_batch"]["text"].tolist() == text[rows].tolist()
    assert [r.tolist() for r in picked["non_tensor_batch"]["ragged"]] == \
        [ragged[i].tolist() for i in rows]
    for got, want in zip(picked["non_tensor_batch"]["samples"], samples[rows]):
        assert torch.equal(got["t"], want["t"]) and got["n"] == want["n"]
    sliced = reader.get_dataproto(handle, fields=["scores", "text"], rows=slice(1, 5))
    assert np.array_equal(sliced["batch"]["scores"], full["batch"]["scores"][1:5])
    assert sliced["non_tensor_batch"]["text"].tolist() == text[1:5].tolist()
    assert reader.get_dataproto(handle, fields=[], meta_info_keys=["step"])["meta_info"] == \
        {"step": 3}

    merged = reader._bundle_store.resolve_manifest(ref.stage_refs["rollout"])
    assert first_manifest in merged["cleanup_keys"]
    keys = [ref.stage_refs["rollout"].manifest_key, first_manifest, *_keys_of(merged)]
    reader.cleanup_dataproto(handle)
    assert all(clients[0].is_exist(k) == 0 for k in keys)


def test_tampered_manifests_are_refused_without_side_effects(clients):
    store = clients[0]
    transfer = MooncakeBundleTransfer(store, key_prefix="sbt-tamper")
    assert store.put("victim", b"keep me") == 0
    ref = transfer.put_bundle(b"meta", {"payload": b"abcdef"}, chunk_bytes=2)

    def rewrite(change) -> None:
        manifest = json.loads(json.dumps(ref.manifest))
        change(manifest)
        assert store.remove(ref.manifest_key, True) == 0
        assert store.put(ref.manifest_key, json.dumps(manifest).encode()) == 0

    rewrite(lambda m: m["buffers"]["payload"].update(chunks=[{"key": "victim", "bytes": 6}]))
    with pytest.raises(ValueError, match="namespace"):
        transfer.materialize(transfer.read_spec({"manifest_key": ref.manifest_key}))
    rewrite(lambda m: m.update(cleanup_keys=["victim"]))
    with pytest.raises(ValueError, match="cleanup_keys"):
        transfer.remove_bundle({"manifest_key": ref.manifest_key})
    assert store.get("victim") == b"keep me"
    with pytest.raises(ValueError, match="manifest_key"):
        transfer.remove_bundle({"manifest_key": "sbt-tamper/default/other/manifest",
                                "manifest": ref.manifest})
    rewrite(lambda m: None)
    transfer.remove_bundle(ref)
    assert store.is_exist(ref.manifest_key) == 0


class _FailingPuts:
    """A real store whose ``n``-th ``put`` fails (everything else passes through)."""

    def __init__(self, store: MooncakeDistributedStore, n: int) -> None:
        self._store, self._left = store, n

    def put(self, key, value, config=None):
        self._left -= 1
        if self._left == 0:
            raise RuntimeError("injected put failure")
        return self._store.put(key, value, config)

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.mark.parametrize("fail_at", [1, 3, 5])
def test_failed_put_leaves_nothing_behind(clients, fail_at):
    store = clients[0]
    transfer = MooncakeBundleTransfer(_FailingPuts(store, fail_at), key_prefix="sbt-fail")
    with pytest.raises(RuntimeError, match="injected put failure"):
        transfer.put_bundle(b"meta", {"a": b"0123456789", "b": b"xy"}, chunk_bytes=4,
                            policy=BundleTransferPolicy(copy_mode="copy"))
    assert store.remove_by_regex("^sbt-fail/.*", True) == 0     # nothing was left


def test_catalog_transfer_retires_and_removes_fragments(clients):
    store = clients[0]
    transfer = MooncakeBundleTransfer(store, key_prefix="sbt-catalog")
    catalog = DataProtoCatalog()
    published = DataProtoCatalogTransfer(
        transfer, lambda method, *a, **kw: getattr(catalog, method)(*a, **kw))
    data = {"batch": {"ids": np.arange(3)}}
    published.put(data, partition="p", keys=["k0", "k1", "k2"], tags=[{"i": i} for i in range(3)])
    plan = published.resolve("p", ["k2", "k0"])
    (fragment_id, handle), = plan["handles"].items()
    assert reader_rows(transfer, handle, plan) == [2, 0]
    published.append(fragment_id, handle, {"batch": {"score": np.ones(3)}}, partition="p",
                     keys=["k0", "k1", "k2"], stage="value")
    published.release_read(plan["read_token"])
    assert store.is_exist(fragment_id) == 1
    published.remove("p", ["k0", "k1", "k2"])
    assert store.is_exist(fragment_id) == 0
    assert catalog.list() == {}
    published.close()


def reader_rows(transfer: MooncakeBundleTransfer, handle: dict, plan: dict) -> list[int]:
    rows = [row for _, row in plan["field_groups"][0]["locations"]]
    return transfer.get_dataproto(handle, rows=rows)["batch"]["ids"].tolist()
