"""LMCache's in-tree ``mooncakestore`` connector, unchanged, on our drop-in ``mooncake``
package: both of its ``setup`` forms (the dict API, and the positional one it falls back
to on TypeError) and both of its modes (chunk metadata stored with the chunk:
``put_parts`` + ``batch_get_buffer``; zero-copy: ``batch_put_from`` + ``batch_get_into``)."""

from __future__ import annotations

from typing import Any

import pytest

import lmc
import mooncake.store

SEED = 11


def intree_extra(address: str, **more: Any) -> dict[str, Any]:
    """The keys LMCache documents for it (``master_server_address``, not the original's
    ``master_server_addr``), with small sizes."""
    return {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
            "master_server_address": address, "protocol": "tcp",
            "global_segment_size": "33554432", "local_buffer_size": "16777216",
            "transfer_timeout": 10, **more}


class PositionalOnly(mooncake.store.MooncakeDistributedStore):
    """A build without the dict ``setup`` (before Mooncake PR #1445)."""

    calls: list[tuple] = []

    def setup(self, *args: Any, **kwargs: Any) -> int:
        if args and isinstance(args[0], dict):
            raise TypeError("setup(): incompatible function arguments")
        PositionalOnly.calls.append(args)
        return super().setup(*args, **kwargs)


@pytest.mark.parametrize("form", ["dict", "positional"])
@pytest.mark.parametrize("save_chunk_meta", [True, False], ids=["chunk-meta", "zero-copy"])
def test_intree_connector_round_trips(store, monkeypatch, form, save_chunk_meta):
    if form == "positional":
        PositionalOnly.calls = []
        monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", PositionalOnly)
    extra = intree_extra(store.address, save_chunk_meta=save_chunk_meta)
    b = lmc.Backends(lmc.config(["mooncakestore"], extra))
    try:
        assert list(b.all) == ["LocalCPUBackend", "RemoteBackend-mooncakestore"]
        assert b.remote.connection is not None
        if form == "positional":
            assert [a[6] for a in PositionalOnly.calls] == [store.address]
        tokens = [lmc.CHUNK] * 4 + [3]
        objs = [b.chunk(SEED, i, t) for i, t in enumerate(tokens)]
        keys = [lmc.key(i) for i in range(len(objs))]
        try:
            b.put(keys, objs)
        finally:
            for o in objs:
                o.ref_count_down()
        assert all(b.remote.contains(k) for k in keys)
        assert not b.remote.contains(lmc.key(77))
        got = b.remote.batched_get_blocking(keys + [lmc.key(77)])
        try:
            assert got[-1] is None
            assert [lmc.digest(o) if o is not None else None for o in got[:-1]] == \
                [lmc.expected_digest(SEED, i, t) for i, t in enumerate(tokens)]
        finally:
            for o in got:
                if o is not None:
                    o.ref_count_down()
    finally:
        b.close()


def test_intree_remote_url_form(store):
    b = lmc.Backends(lmc.config([], intree_extra(store.address, save_chunk_meta=False),
                                remote_url="mooncakestore://127.0.0.1:50051/"))
    try:
        obj = b.chunk(SEED, 0)
        try:
            b.remote.submit_put_task(lmc.key(0), obj).result(30)
        finally:
            obj.ref_count_down()
        got = b.remote.batched_get_blocking([lmc.key(0)])
        assert lmc.digest(got[0]) == lmc.expected_digest(SEED, 0)
        got[0].ref_count_down()
    finally:
        b.close()


def test_failed_setup_reads_as_missing_not_present(store):
    dead = f"127.0.0.1:{store.address.rsplit(':', 1)[1]}"
    store.stop_master()  # LMCache ignores setup's return code ...
    b = lmc.Backends(lmc.config(["mooncakestore"], intree_extra(dead)))
    try:
        # ... so every later call raises (logged by LMCache) instead of returning a code
        # that its `if store.is_exist(...)` would read as "present".
        assert not b.remote.contains(lmc.key(0))
        assert b.remote.batched_get_blocking([lmc.key(0)]) == [None]
    finally:
        b.close()
