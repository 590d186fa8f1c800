"""LMCache's scheduler role: a scheduler process (``scheduler.py``) built through
LMCache's own construction path answers prefix lookups of what a worker (this process,
LMCache's storage stack in the worker role) stored.

Our connector, selected by ``remote_url: external://...`` (LMCache 0.5.6 builds no
``remote_storage_plugins`` backend in the scheduler role), runs there lookup-only over
LMCache's stand-in CPU backend. For the in-tree connector LMCache's scheduler-side path is
its ``external_lookup_client: mooncakestore://``, which runs on the drop-in package."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import LineChild
from lmcache.v1.storage_backend.connector import SafeLocalCPUBackend
from lmcache.v1.token_database import ChunkedTokenDatabase

import lmc
import mooncake_lmcache
from mooncake_lmcache.connector import MooncakePluginsConnector
from test_intree import intree_extra

HERE = Path(__file__).resolve().parent
SEED = 13
PROMPT = list(range(1000, 1000 + 3 * lmc.CHUNK))  # three full chunks


def scheduler(**fields: Any) -> LineChild:
    return LineChild([sys.executable, str(HERE / "scheduler.py"), json.dumps(fields)],
                     timeout_s=120)


def lookup(sched: LineChild, tokens: list[int]) -> int:
    return int(sched.ask("lookup " + ",".join(map(str, tokens))))


def store_prompt(b: lmc.Backends, cfg: Any, tokens: list[int]) -> None:
    """What a worker does after a prefill: each full chunk stored under LMCache's key."""
    db = ChunkedTokenDatabase(cfg, b.metadata)
    keys = [key for _, _, key in db.process_tokens(tokens)]
    objs = [b.chunk(SEED, i) for i in range(len(keys))]
    try:
        b.put(keys, objs)
    finally:
        for o in objs:
            o.ref_count_down()


def assert_prefix_lookups(sched: LineChild) -> None:
    chunk = lmc.CHUNK
    assert lookup(sched, PROMPT) == 3 * chunk
    assert lookup(sched, PROMPT + [7, 8, 9]) == 3 * chunk  # an unstored tail
    assert lookup(sched, PROMPT[:2 * chunk] + [5] * chunk) == 2 * chunk  # diverges
    assert lookup(sched, [5] * (2 * chunk)) == 0


def test_our_connector_answers_lookups_in_the_scheduler_role(store):
    extra = lmc.ours(store.address)
    url = mooncake_lmcache.EXTERNAL_REMOTE_URL
    cfg = lmc.config([], extra, remote_url=url)
    worker = lmc.Backends(cfg)
    try:
        assert list(worker.all) == ["LocalCPUBackend", "RemoteBackend"]
        conn = worker.remote.connection.getWrappedConnector()
        assert not conn.lookup_only and conn.io.region_count == 1  # the worker's pool
        sched = scheduler(extra_config=extra, remote_url=url,
                          enable_scheduler_bypass_lookup=True)
        try:
            assert sched.info == {"backends": ["RemoteBackend"],
                                  "connector": "MooncakePluginsConnector",
                                  "lookup_only": True, "registered": 0, "mounted": False}
            assert lookup(sched, PROMPT) == 0
            store_prompt(worker, cfg, PROMPT)
            assert_prefix_lookups(sched)
            store.stop_master()
            assert lookup(sched, PROMPT) == 0  # a store fault is a miss
        finally:
            sched.close()
    finally:
        worker.close()


def test_scheduler_role_gets_and_puts_are_refused(store):
    """Built over LMCache's stand-in, the connector has no pool: asked for chunks, it says
    why instead of touching memory it does not have."""
    cfg = lmc.config([], lmc.ours(store.address), remote_url=mooncake_lmcache.EXTERNAL_REMOTE_URL)
    b = lmc.Backends(cfg)  # for LMCache's event loop
    conn = MooncakePluginsConnector(b.loop, SafeLocalCPUBackend(cfg), cfg)
    try:
        assert conn.lookup_only and conn.batched_contains([lmc.key(0)]) == 0
        for coro in (conn.batched_get([lmc.key(0)]), conn.batched_put([lmc.key(0)], [])):
            with pytest.raises(RuntimeError, match="scheduler role"):
                asyncio.run_coroutine_threadsafe(coro, b.loop).result(30)
    finally:
        conn._close()
        b.close()


def test_intree_external_lookup_client_on_the_dropin(store):
    extra = intree_extra(store.address, save_chunk_meta=False)
    cfg = lmc.config(["mooncakestore"], extra)
    worker = lmc.Backends(cfg)
    try:
        sched = scheduler(extra_config={},
                          external_lookup_client=f"mooncakestore://{store.address}")
        try:
            assert sched.info["backends"] is None  # no engine: the client asks the store
            store_prompt(worker, cfg, PROMPT)
            assert_prefix_lookups(sched)
        finally:
            sched.close()
    finally:
        worker.close()
