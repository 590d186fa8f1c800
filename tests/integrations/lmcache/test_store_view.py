"""The router's view of a store LMCache fills: LMCache's own token database names a
prompt's chunks, its storage stack saves some of them on our master (through its in-tree
``mooncakestore`` connector on our drop-in package, and through our connector), and the
router's :class:`StoreView`, given LMCache's chunk hashing, counts the leading chunks
held, in its own blocks."""

from __future__ import annotations

import logging
import random

import pytest
from lmcache.v1.token_database import ChunkedTokenDatabase
from test_intree import intree_extra

import lmc
from mooncake_plugins.conductor.router.lmcache_hashes import LmcacheChunkHashes
from mooncake_plugins.conductor.router.store_view import StoreView
from mooncake_plugins.conductor.router.vllm_hashes import VllmBlockHashes

BLOCK = 8   # the router's block: an LMCache chunk of 16 tokens is two
SEED = 23


def prompt(seed: int, tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(tokens)]


@pytest.mark.parametrize("connector", ["intree", "ours"])
def test_the_router_counts_the_chunks_lmcache_saved(store, connector, caplog):
    extra = intree_extra(store.address, save_chunk_meta=False) if connector == "intree" \
        else lmc.ours(store.address)
    cfg = lmc.config(["mooncakestore" if connector == "intree" else "mooncake_plugins"], extra)
    b = lmc.Backends(cfg)
    try:
        tokens = prompt(1, 4 * lmc.CHUNK + 3)
        keys = [key for _, _, key in ChunkedTokenDatabase(cfg, b.metadata).process_tokens(
            tokens=tokens)]
        hashes = LmcacheChunkHashes(lmc.CHUNK, in_vllm=False)   # no vLLM in this venv
        assert hashes.of(tokens) == [key.chunk_hash_hex for key in keys]   # full chunks only
        objs = [b.chunk(SEED, i) for i in range(3)]
        try:
            b.put(keys[:3], objs)
        finally:
            for obj in objs:
                obj.ref_count_down()
        view = StoreView(store.address, VllmBlockHashes(BLOCK), lmcache=hashes)
        try:
            assert view.prefix_blocks(tokens) == 3 * lmc.CHUNK // BLOCK
            (layout,) = view.layouts
            assert (layout.kind, layout.size) == ("lmcache", 1)
            assert layout.base == ("lmcache/" if connector == "ours" else "") + lmc.MODEL
            assert view.prefix_blocks(prompt(2, 4 * lmc.CHUNK)) == 0   # another prompt
            # the three chunks are the whole prompt: its last token is computed again
            assert view.prefix_blocks(tokens[:3 * lmc.CHUNK]) == 3 * lmc.CHUNK // BLOCK - 1
        finally:
            view.close()
        # a router not told of LMCache says so once and counts nothing
        blind = StoreView(store.address, VllmBlockHashes(BLOCK), rediscover_s=0)  # looks each time
        try:
            with caplog.at_level(logging.WARNING):
                assert blind.prefix_blocks(tokens) == 0
                assert blind.prefix_blocks(tokens) == 0
            assert caplog.text.count("--store-lmcache-chunk-size") == 1, caplog.text
        finally:
            blind.close()
    finally:
        b.close()
