"""``mooncake.dataproto_catalog`` / ``mooncake_plugins.store.catalog``: managed fragments
(publish, pinned reads, retirement, append, drain) and handle validation, beyond the
original's own tests. The catalog is pure metadata, so no master is needed."""

from __future__ import annotations

import numpy as np
import pytest

import mooncake.dataproto_catalog as compat
from mooncake_plugins.store.catalog import DataProtoCatalog, normalize_handle


def frag(key: str, fields: list[str], rows: int = 2, **extra: object) -> dict:
    return {"type": "mooncake_dataproto_ref", "version": 1, "kind": "bundle_stages",
            "batch_size": rows, "stage_refs": {"s": {"manifest_key": key}},
            "field_index": {f: {"stage": "s", "member": f"batch.{f}", "section": "batch"}
                            for f in fields}, **extra}


def test_compat_module_is_the_core_class() -> None:
    assert compat.DataProtoCatalog is DataProtoCatalog


def test_normalize_fills_defaults_and_converts_numpy() -> None:
    ref = normalize_handle(frag("m/a", ["x"], meta_info={"n": np.int64(3),
                                                         "v": np.arange(2)}))
    assert ref.handle["partition"] == "default" and ref.handle["global_indexes"] is None
    assert ref.handle["meta_info"] == {"n": 3, "v": [0, 1]}
    assert type(ref.handle["meta_info"]["n"]) is int
    with pytest.raises(ValueError, match="storage_group_id"):
        normalize_handle(frag("m/a", ["x"], version=2))
    with pytest.raises(ValueError, match="unknown stage"):
        normalize_handle({**frag("m/a", ["x"]),
                          "field_index": {"x": {"stage": "t", "member": "m",
                                                "section": "batch"}}})
    with pytest.raises(TypeError, match="JSON-safe"):
        normalize_handle(frag("m/a", ["x"], meta_info={"o": object()}))


def test_unmanaged_fragments_are_never_retired() -> None:
    cat = DataProtoCatalog()
    cat.update("p", ["a", "b"], handle=frag("m/a", ["x"]))
    assert cat.remove("p", ["a", "b"]) == {"retired_handles": []}
    assert cat.list() == {}


def test_publish_is_idempotent_and_retires_after_last_reference() -> None:
    cat = DataProtoCatalog()
    first = cat.publish("op1", "p", ["a", "b"], tags=[{"t": 1}, {"t": 2}],
                        handle=frag("m/a", ["x"]))
    again = cat.publish("op1", "p", ["zz"], tags=[{}])  # replayed, not re-applied
    assert again == first and "zz" not in cat.list("p")["p"]
    cat.ack_publication("op1")

    assert cat.remove("p", ["a"])["retired_handles"] == []
    retired = cat.remove("p", ["b"])["retired_handles"]
    assert [h["stage_refs"]["s"]["manifest_key"] for h in retired] == ["m/a"]
    with pytest.raises(ValueError, match="pending retirement"):
        cat.publish("op2", "p", ["a", "b"], handle=frag("m/a", ["x"]))
    assert cat.ack_retired(retired) == {"retired_handles": []}


def test_pinned_read_delays_retirement_until_released() -> None:
    cat = DataProtoCatalog()
    cat.publish("op", "p", ["a", "b"], handle=frag("m/a", ["x"]))
    plan = cat.resolve("p", ["a", "b"], pin=True)
    assert cat.remove("p", ["a", "b"])["retired_handles"] == []
    with pytest.raises(RuntimeError, match="active read"):
        cat.drain()
    assert len(cat.release_read(plan["read_token"])["retired_handles"]) == 1
    assert len(cat.release_read(plan["read_token"])["retired_handles"]) == 1  # no-op


def test_replacing_a_field_retires_the_old_managed_fragment() -> None:
    cat = DataProtoCatalog()
    cat.publish("op1", "p", ["a"], handle=frag("m/old", ["x"], rows=1))
    result = cat.publish("op2", "p", ["a"], handle=frag("m/new", ["x"], rows=1))
    assert [h["stage_refs"]["s"]["manifest_key"] for h in result["retired_handles"]] \
        == ["m/old"]
    assert cat.resolve("p", ["a"])["field_groups"] == [
        {"fields": ["x"], "locations": [("m/new", 0)]}]


def test_publish_append_adds_fields_and_rejects_stale_handles() -> None:
    cat = DataProtoCatalog()
    base = frag("m/a", ["x"], partition="p")
    cat.publish("op1", "p", ["a", "b"], handle=base)
    grown = frag("m/a", ["x", "y"], partition="p")
    result = cat.publish_append("op2", "m/a", "p", ["a", "b"],
                                previous_handle=base, handle=grown)
    assert result["fields"] == ["x", "y"]
    assert cat.publish_append("op2", "m/a", "p", ["zz"], previous_handle=grown,
                              handle=grown) == result  # replayed
    moved = cat.publish_append("op5", "m/a", "p", ["a", "b"], previous_handle=grown,
                               handle=frag("m/a", ["x", "y", "w"]))
    assert "changed fragment identity" in moved["append_rejected"]  # partition differs
    assert cat.resolve("p", ["b", "a"], ["y"])["field_groups"] == [
        {"fields": ["y"], "locations": [("m/a", 1), ("m/a", 0)]}]
    stale = cat.publish_append("op3", "m/a", "p", ["a", "b"],
                               previous_handle=base, handle=frag("m/a", ["x", "z"], partition="p"))
    assert stale == {"append_rejected": "stale DataProto append handle: 'm/a'"}
    changed = cat.publish_append("op4", "m/a", "p", ["a", "b"], previous_handle=grown,
                                 handle={**frag("m/a", ["x", "y"], partition="p"), "field_index": {
                                     "x": {"stage": "s", "member": "other",
                                           "section": "batch"}}})
    assert "changed existing fields" in changed["append_rejected"]
    assert cat.resolve("p", ["a"])["fields"] == ["x", "y"]


def test_rejected_updates_change_nothing() -> None:
    cat = DataProtoCatalog()
    cat.update("p", ["a"], handle=frag("m/a", ["x"], rows=1, meta_info={"k": 1}))
    with pytest.raises(ValueError, match="collision"):
        cat.update("p", ["b"], tags=[{"t": 1}], handle=frag("m/a", ["y"], rows=1))
    with pytest.raises(ValueError, match="management mismatch"):
        cat.publish("op", "p", ["b"], handle=frag("m/a", ["x"], rows=1,
                                                   meta_info={"k": 1}))
    with pytest.raises(ValueError, match="does not match 2 logical keys"):
        cat.update("p", ["b", "c"], handle=frag("m/b", ["x"], rows=1))
    with pytest.raises(ValueError, match="unique"):
        cat.update("p", ["b", "b"], tags=[{}, {}])
    assert cat.list() == {"p": {"a": {}}}

    cat.update("p", ["a"], handle=frag("m/b", ["y"], rows=1, meta_info={"k": 2}))
    with pytest.raises(ValueError, match="conflicting DataProto meta_info"):
        cat.resolve("p", ["a"])  # x lives in m/a, y in m/b, their meta_info differ


def test_drain_retires_managed_fragments_and_blocks_writes() -> None:
    cat = DataProtoCatalog()
    cat.publish("op1", "p", ["a"], handle=frag("m/a", ["x"], rows=1))
    cat.update("p", ["b"], handle=frag("m/b", ["x"], rows=1))
    retired = cat.drain()["retired_handles"]
    assert [h["stage_refs"]["s"]["manifest_key"] for h in retired] == ["m/a"]
    assert cat.list() == {}
    with pytest.raises(RuntimeError, match="drained"):
        cat.update("p", ["a"], tags=[{}])
    assert cat.publish_append("op2", "m/a", "p", ["a"], previous_handle=retired[0],
                              handle=retired[0]) == {
        "append_rejected": "DataProto catalog is drained"}
    with pytest.raises(ValueError, match="mismatch"):
        cat.ack_retired([frag("m/a", ["other"], rows=1)])
    assert cat.ack_retired(retired) == {"retired_handles": []}


def test_republishing_a_fragment_keeps_it_alive() -> None:
    cat = DataProtoCatalog()
    cat.publish("op1", "p", ["a"], handle=frag("m/a", ["x"], rows=1))
    again = cat.publish("op2", "p", ["a"], tags=[{"t": 1}], handle=frag("m/a", ["x"], rows=1))
    assert again["retired_handles"] == [] and again["tags"] == [{"t": 1}]
    assert cat.resolve("p", ["a"])["handles"].keys() == {"m/a"}
    assert len(cat.remove("p", ["a"])["retired_handles"]) == 1
