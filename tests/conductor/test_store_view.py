"""The router's view of the shared store (``router/store_view.py``) against a real master:
which leading blocks of a prompt every TP rank holds, under keys laid out as our vLLM
store connector writes them, learned without leases; and the router pricing a prompt the
store holds as a load from it."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack

import pytest
from helpers import free_port, wait_until
from local_master import put, running_master

from mooncake_plugins.conductor.costmodel import CostModel
from mooncake_plugins.conductor.policies import Slo, make_policy
from mooncake_plugins.conductor.router.lmcache_hashes import LmcacheChunkHashes
from mooncake_plugins.conductor.router.store_view import Layout, StoreView
from mooncake_plugins.conductor.router.vllm_hashes import VllmBlockHashes
from mooncake_plugins.errors import ObjectHasLease, SegmentAlreadyExists
from mooncake_plugins.store.master import MasterConfig
from mooncake_plugins.store.rpc import RpcClient
from mooncake_plugins.store.server import MasterServer, ServerOptions

BLOCK = 16
BASE = "vllm/tiny-0123456789ab/cpu-FullAttentionSpec-float32-bs16-kvh2-hd64-L2-pp1"


@pytest.fixture
def master() -> Iterator[tuple[MasterServer, RpcClient]]:
    with running_master() as m:
        yield m


def tokens(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 for i in range(blocks * BLOCK + 1)]


def test_the_blocks_every_rank_holds_are_counted(master) -> None:
    server, rpc = master
    prompt = tokens(1, 5)
    hexes = [h.hex() for h in VllmBlockHashes(BLOCK).of(prompt)]
    # TP 2: blocks 0-2 on both ranks, block 3 on rank 0 only; another model holds block 0
    put(rpc, [f"{BASE}/tp{r}of2/{h}" for h in hexes[:3] for r in (0, 1)])
    put(rpc, [f"{BASE}/tp0of2/{hexes[3]}", f"vllm/other-0/x/tp0of1/{hexes[0]}"])
    view = StoreView(f"127.0.0.1:{server.port}", VllmBlockHashes(BLOCK))
    try:
        assert view.prefix_blocks(prompt) == 3
        assert sorted((lay.base, lay.size) for lay in view.layouts) == sorted(
            [(BASE, 2), ("vllm/other-0/x", 1)])
        assert view.prefix_blocks(tokens(2, 5)) == 0     # another prompt: nothing held
        assert view.prefix_blocks(prompt[:3 * BLOCK]) == 2   # only blocks before its last token
        assert view.prefix_blocks(prompt[:5]) == 0
        # another engine's hashing (a PYTHONHASHSEED) names other blocks
        seeded = StoreView(f"127.0.0.1:{server.port}", VllmBlockHashes(BLOCK, seed="9"))
        assert seeded.prefix_blocks(prompt) == 0
        seeded.close()
    finally:
        view.close()
    # looking took no lease: the blocks can be removed at once
    rpc.call("remove", keys=[f"{BASE}/tp0of2/{hexes[0]}"], force=False)
    rpc.call("exist", keys=[f"{BASE}/tp1of2/{hexes[0]}"])    # a real reader's lease
    assert rpc.call("remove", keys=[f"{BASE}/tp1of2/{hexes[0]}"], force=False)[0][0] == \
        ObjectHasLease.code


def test_a_view_started_beside_an_empty_store_learns_the_layout_soon(master) -> None:
    """A router starts before any engine saved a block: the first look finds no layout;
    the layout is learned within a second of the first blocks saved, though they are of
    another prompt (not ``rediscover_s``, 30 s, later), and the prompt's own blocks count
    as soon as they are saved; once a layout is known, a prompt the store does not hold
    triggers no scan for ``rediscover_s``."""
    server, rpc = master
    view = StoreView(f"127.0.0.1:{server.port}", VllmBlockHashes(BLOCK))
    try:
        prompt, first = tokens(11, 4), tokens(13, 4)
        assert view.prefix_blocks(prompt) == 0 and not view.layouts
        put(rpc, [f"{BASE}/tp0of1/{h.hex()}" for h in VllmBlockHashes(BLOCK).of(first)])
        assert wait_until(lambda: view.prefix_blocks(prompt) == 0 and view.layouts, 2.0, 0.05)
        put(rpc, [f"{BASE}/tp0of1/{h.hex()}" for h in VllmBlockHashes(BLOCK).of(prompt)])
        assert view.prefix_blocks(prompt) == 4
        other = tokens(12, 4)
        assert view.prefix_blocks(other) == 0
        put(rpc, [f"vllm/other-1/x/tp0of1/{h.hex()}" for h in VllmBlockHashes(BLOCK).of(other)])
        time.sleep(1.0)
        assert view.prefix_blocks(other) == 0   # another layout: not looked for yet
    finally:
        view.close()


def test_vllm_in_tree_connector_keys_are_recognised(master) -> None:
    """vLLM's own MooncakeStoreConnector keys a block
    ``{model}@tp_rank:{r}@pcp0@dcp0@pp_rank:0@group:0@{hash}``: the TP size is learned
    from the ranks seen, and grows when a later look sees more."""
    server, rpc = master
    prompt = tokens(6, 5)
    hexes = [h.hex() for h in VllmBlockHashes(BLOCK).of(prompt)]
    model = "/models/tiny-llama"

    def key(rank: int, h: str) -> str:
        return f"{model}@tp_rank:{rank}@pcp0@dcp0@pp_rank:0@group:0@{h}"

    put(rpc, [key(0, h) for h in hexes[:3]])
    view = StoreView(f"127.0.0.1:{server.port}", VllmBlockHashes(BLOCK), rediscover_s=0)
    try:
        assert view.prefix_blocks(prompt) == 3
        (layout,) = view.layouts
        assert (layout.kind, layout.base, layout.size) == ("vllm", model, 1)
        # a second rank's key of block 0 appears: the next look learns TP 2 by probing
        # rank 1 (no scan of the master's keys), and only block 0 has both ranks

        def no_scan(first_hex: str) -> bool:
            raise AssertionError("the master's keys were scanned again")

        view._discover = no_scan   # type: ignore[method-assign]
        put(rpc, [key(1, hexes[0])])
        assert view.prefix_blocks(prompt) == 1
        assert [lay.size for lay in view.layouts] == [2]
        put(rpc, [key(1, h) for h in hexes[1:3]])
        assert view.prefix_blocks(prompt) == 3
        # ranks 2 and 3 at once: one look probes its way to TP 4
        put(rpc, [key(r, h) for r in (2, 3) for h in hexes[:3]])
        assert view.prefix_blocks(prompt) == 3
        assert [lay.size for lay in view.layouts] == [4]
    finally:
        view.close()


def test_lmcache_chunks_are_counted_where_every_worker_holds_them(master) -> None:
    """LMCache keys a chunk ``{model}@{world size}@{worker}@{hash}@{dtype}`` (our LMCache
    connector puts ``lmcache/`` before it): with chunks of two blocks and two workers,
    chunks 0-1 on both workers and chunk 2 on one are four whole blocks; a key whose
    worker is not below its world size is no layout; vLLM's block keys of the same prompt
    (another model, fewer blocks) are priced beside them."""
    server, rpc = master
    prompt = tokens(8, 8)
    chunks = LmcacheChunkHashes(2 * BLOCK, in_vllm=False)
    hexes = chunks.of(prompt)
    assert len(hexes) == 4 and any(h.startswith("-") for h in hexes + chunks.of(tokens(9, 8)))
    base = "lmcache/tiny-llama"
    put(rpc, [f"{base}@2@{w}@{h}@float" for h in hexes[:2] for w in (0, 1)])
    put(rpc, [f"{base}@2@0@{hexes[2]}@float", f"{base}@2@2@{hexes[3]}@float"])
    blocks = [h.hex() for h in VllmBlockHashes(BLOCK).of(prompt)]
    put(rpc, [f"{BASE}/tp0of1/{h}" for h in blocks[:3]])
    view = StoreView(f"127.0.0.1:{server.port}", VllmBlockHashes(BLOCK), lmcache=chunks)
    try:
        assert view.prefix_blocks(prompt) == 4
        assert sorted((lay.kind, lay.base, lay.size, lay.tail) for lay in view.layouts) == [
            ("lmcache", base, 2, "@float"), ("ours", BASE, 1, "")]
        put(rpc, [f"{base}@2@1@{hexes[2]}@float"])   # chunk 2 whole now
        assert view.prefix_blocks(prompt) == 6
        assert view.prefix_blocks(prompt[:6 * BLOCK]) == 5   # before the last token only
    finally:
        view.close()
    assert Layout.of(f"{base}@2@2@{hexes[3]}@float") is None
    assert Layout.of(f"{base}@2@0@-1f2e@float") == (Layout("lmcache", base, 2, "@float"), 0)
    assert Layout.of(f"{base}@2@1@{hexes[3]}@bfloat16") == (
        Layout("lmcache", base, 2, "@bfloat16"), 1)
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        LmcacheChunkHashes(256)   # builtin inside vLLM: random per engine without a seed
    with pytest.raises(ValueError, match="4294967295"):
        LmcacheChunkHashes(256, seed="fixed")
    with pytest.raises(ValueError, match="builtin, sha256, sha256_cbor"):
        LmcacheChunkHashes(256, "xxhash", seed="0")


def test_a_block_counts_only_where_every_pipeline_stage_holds_it(master) -> None:
    """vLLM's in-tree keys name the pipeline stage: stage 0 holds blocks 0-3 and stage 1
    blocks 0-1 of one model, so two blocks are whole; another model's single stage
    holding three blocks wins."""
    server, rpc = master
    prompt = tokens(6, 8)
    hexes = [h.hex() for h in VllmBlockHashes(BLOCK).of(prompt)]

    def key(model: str, pp: int, h: str) -> str:
        return f"{model}@tp_rank:0@pcp0@dcp0@pp_rank:{pp}@group:0@{h}"

    put(rpc, [key("/m/a", 0, h) for h in hexes[:4]] + [key("/m/a", 1, h) for h in hexes[:2]])
    view = StoreView(f"127.0.0.1:{server.port}", VllmBlockHashes(BLOCK), rediscover_s=0)
    try:
        assert view.prefix_blocks(prompt) == 2
        assert len(view.layouts) == 2
        put(rpc, [key("/m/b", 0, h) for h in hexes[:3]])
        view._next_discovery = 0.0
        assert view._discover(hexes[0])
        assert view.prefix_blocks(prompt) == 3
    finally:
        view.close()


def test_an_unreachable_master_counts_as_holding_nothing(caplog) -> None:
    view = StoreView("127.0.0.1:9", VllmBlockHashes(BLOCK), timeout_s=0.5)
    with caplog.at_level(logging.WARNING):
        assert view.prefix_blocks(tokens(1, 3)) == 0
        assert view.prefix_blocks(tokens(1, 3)) == 0
    assert len([r for r in caplog.records if "store master" in r.message]) == 1
    view.close()
    with pytest.raises(ValueError):
        StoreView("no-port", VllmBlockHashes(BLOCK))


@pytest.mark.etcd
def test_an_ha_group_is_followed_to_its_new_leader(etcd_server: str) -> None:
    endpoints = etcd_server.split("://", 1)[1]
    cluster = f"router-{uuid.uuid4().hex[:8]}"

    def start() -> MasterServer:
        server = MasterServer(MasterConfig(), ServerOptions(
            rpc_port=free_port(), enable_ha=True, etcd_endpoints=endpoints, cluster_id=cluster))
        assert server.start()
        return server

    def write(server: MasterServer, new_keys: list[str]) -> None:
        rpc = RpcClient("127.0.0.1", server.port)
        try:
            rpc.call("register_client", client_id="writer", host_id="h")
            try:
                rpc.call("mount_segment", client_id="writer", segment="seg", base=1 << 32,
                         nbytes=1 << 24)
            except SegmentAlreadyExists:   # a new leader knows it from the journal
                pass
            put(rpc, new_keys)
        finally:
            rpc.close()

    prompt = tokens(5, 4)
    keys = [f"{BASE}/tp0of1/{h.hex()}" for h in VllmBlockHashes(BLOCK).of(prompt)]
    first = start()
    view = StoreView(f"etcd://{endpoints}", VllmBlockHashes(BLOCK), rediscover_s=0,
                     timeout_s=0.5, cluster_id=cluster)
    second = None
    try:
        write(first, keys[:2])
        assert view.prefix_blocks(prompt) == 2
        assert view.address == f"127.0.0.1:{first.port}"
        first.close()   # resigns; the next master elected starts from its journal
        assert view.prefix_blocks(prompt) == 0   # no leader: nothing held, no waiting
        second = start()
        write(second, keys[2:3])
        # the request that finds the old leader gone counts nothing; a later one asks
        # the new leader (etcd is read again at most once a second)
        assert wait_until(lambda: view.prefix_blocks(prompt) == 3, timeout_s=20,
                          interval_s=0.2)
        assert view.address == f"127.0.0.1:{second.port}"
    finally:
        view.close()
        first.close()
        if second is not None:
            second.close()
    with pytest.raises(ValueError):
        StoreView("etcd://", VllmBlockHashes(BLOCK))


def test_the_router_prices_a_prefix_the_store_holds_as_a_load(master) -> None:
    pytest.importorskip("aiohttp")
    from aiohttp.test_utils import TestClient, TestServer
    from openai_double import OpenAIDouble

    from mooncake_plugins.conductor.router.instances import Pool
    from mooncake_plugins.conductor.router.prompts import Hasher
    from mooncake_plugins.conductor.router.server import Router, RouterConfig

    server, rpc = master
    prompt = tokens(3, 8)
    # a second prompt sharing the first 4 blocks; the store holds all 8 of both
    second = prompt[:4 * BLOCK] + tokens(4, 4)
    put(rpc, [f"{BASE}/tp0of1/{h.hex()}" for p in (prompt, second)
              for h in VllmBlockHashes(BLOCK).of(p)[4 if p is second else 0:]])
    cost = CostModel(prefill_s_per_token=1e-3, kv_bytes_per_token=1024,
                     transfer_bytes_per_s=1e9)   # loading is far cheaper than computing

    async def main(with_store: bool) -> str:
        async with AsyncExitStack() as stack:
            engine = await stack.enter_async_context(TestServer(OpenAIDouble("e").app()))
            pool = Pool()
            pool.add(str(engine.make_url("")).rstrip("/"))
            store = StoreView(f"127.0.0.1:{server.port}", VllmBlockHashes(BLOCK)) \
                if with_store else None
            router = Router(RouterConfig(make_policy("conductor", cost, Slo(30, 1), migrate=False),
                                         Slo(30, 1), cost, block_tokens=BLOCK, store=store),
                            Hasher(BLOCK), pool)
            client = await stack.enter_async_context(TestClient(TestServer(router.app())))
            for p in (prompt, second):
                answer = await client.post("/v1/completions", json={
                    "model": "m", "prompt": p, "max_tokens": 4})
                assert answer.status == 200
            return await (await client.get("/metrics")).text()

    page = asyncio.run(main(True))
    # all 8 blocks of the first; of the second only the 4 its engine does not hold
    assert f"conductor_pool_hit_tokens_total {12 * BLOCK}.0" in page
    assert "conductor_pool_hit_tokens_total 0.0" in asyncio.run(main(False))


def test_a_view_follows_the_masters_events_instead_of_asking_it(caplog) -> None:
    """A master publishing KV events: the view lists its keys once (blocks saved before
    the router started count), then prices every request from the events alone (no peek,
    no scan: the master is not called), learning new blocks, removals and a new layout
    from them."""
    pytest.importorskip("zmq")
    hashes = VllmBlockHashes(BLOCK)
    prompt = tokens(21, 5)
    keys = [f"{BASE}/tp{r}of2/{h.hex()}" for h in hashes.of(prompt) for r in (0, 1)]
    with running_master(events=True) as (server, rpc):
        put(rpc, keys[:4])                        # blocks 0-1 at both ranks, before the view
        view = StoreView(f"127.0.0.1:{server.port}", hashes)
        try:
            assert view.prefix_blocks(prompt) == 2         # asked the master meanwhile
            assert wait_until(lambda: view.feed is not None and view.feed.synced, 10)
            calls: list[str] = []
            real_call = view._rpc.call
            view._rpc.call = lambda method, **kw: (calls.append(method),
                                                   real_call(method, **kw))[1]
            assert view.prefix_blocks(prompt) == 2
            put(rpc, keys[4:8])                           # blocks 2-3
            assert wait_until(lambda: view.prefix_blocks(prompt) == 4, 5)
            rpc.call("remove", keys=[keys[2]], force=True)   # block 1, rank 0
            assert wait_until(lambda: view.prefix_blocks(prompt) == 1, 5)
            other = tokens(22, 3)
            put(rpc, [f"vllm/other-2/x/tp0of1/{h.hex()}" for h in hashes.of(other)])
            assert wait_until(lambda: view.prefix_blocks(other) == 3, 5)
            assert ("vllm/other-2/x", 1) in [(lay.base, lay.size) for lay in view.layouts]
            assert calls == [], calls
            assert view.feed.resyncs == 1
        finally:
            view.close()
    # a master without events: said once, and the view asks it per request
    with running_master() as (server, rpc), caplog.at_level(logging.INFO):
        put(rpc, keys[:2])
        view = StoreView(f"127.0.0.1:{server.port}", hashes)
        try:
            assert view.prefix_blocks(prompt) == 1 and view.prefix_blocks(prompt) == 1
            assert view.feed is None
            assert len([r for r in caplog.records if "publishes no KV events" in r.message]) == 1
        finally:
            view.close()


def test_a_feed_that_missed_events_lists_the_keys_again() -> None:
    """The feed against a ZMQ publisher of the test's own (a stand-in for the master's):
    a gap in the sequence numbers, or a malformed message, makes it list the keys again;
    removals of one medium drop a listed key."""
    zmq = pytest.importorskip("zmq")
    import msgpack

    from mooncake_plugins.conductor.router.store_events import StoreEventFeed

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
    listings: list[int] = []
    master_keys = {"k1", "k2"}

    def list_keys() -> list[str]:
        listings.append(1)
        return sorted(master_keys)

    seq = 0

    def send(*events: tuple[str, str, str], gap: int = 0, raw: bytes | None = None) -> None:
        """Publish ``events`` (applied to the stand-in master's keys first, as a master
        does), after ``gap`` lost messages."""
        nonlocal seq
        for kind, key, _ in events:
            (master_keys.add if kind == "stored" else master_keys.discard)(key)
        seq += 1 + gap
        payload = raw if raw is not None else msgpack.packb([0, [
            {"event_type": t, "object_key": k, "medium": m} for t, k, m in events], 0])
        pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    seen: list[str] = []

    def on_stored(key: str) -> bool:
        seen.append(key)
        return key.startswith("k")

    feed = StoreEventFeed(endpoint, list_keys, on_stored)
    try:
        assert wait_until(lambda: feed.synced, 10)
        assert feed.holds(["k1", "k2", "k3"]) == [True, True, False]
        # the subscription reached the publisher once an event gets through
        assert wait_until(lambda: (send(("stored", "k3", "cpu")),
                                   feed.holds(["k3"]) == [True])[1], 10)
        send(("stored", "x-ignored", "cpu"), ("removed", "k1", "disk"))
        assert wait_until(lambda: feed.holds(["k1"]) == [False], 5)   # listed: any medium
        send(("stored", "k5", "cpu"), ("stored", "k5", "disk"), ("removed", "k5", "cpu"))
        assert wait_until(lambda: feed.holds(["k5"]) == [True], 5)    # its disk copy stays
        assert wait_until(lambda: "x-ignored" in seen, 5)
        assert feed.holds(["x-ignored"]) == [False] and {"k1", "k2", "k3"} <= set(seen)
        master_keys.add("k9")                    # a change whose message is lost
        send(("stored", "k4", "cpu"), gap=1)
        assert wait_until(lambda: len(listings) == 2 and feed.synced, 5)
        assert feed.holds(["k9", "k4", "k1"]) == [True, True, False]
        send(raw=b"\xc1")
        assert wait_until(lambda: len(listings) == 3 and feed.synced, 5)
    finally:
        feed.close()
        pub.close(linger=0)
        ctx.term()
