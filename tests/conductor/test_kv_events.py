"""vLLM KV events into the router's view: decoding and validation, re-hashing stored
blocks into the router's chain (the same ids a token prompt gets), evictions, clears,
a stream that stops, and the ZMQ subscription end to end (a PUB socket standing in for
the engine's publisher; a real engine's: tests/integrations/vllm)."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import msgpack
import pytest

from mooncake_plugins.conductor.router.instances import Instance
from mooncake_plugins.conductor.router.kv_events import KvEventError, KvEventIndex, decode_batch
from mooncake_plugins.conductor.router.prompts import Hasher

B = 4
TOKENS = list(range(100, 112))   # three blocks of 4


def stored(hashes, parent, tokens, size=B) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": size, "lora_id": None, "medium": "GPU"}


def batch(*events) -> bytes:
    return msgpack.packb([time.time(), list(events)])


def prompt_ids(tokens) -> list[int]:
    return list(Hasher(B).request("/v1/completions", {"prompt": tokens}).hash_ids)


def test_stored_blocks_get_the_ids_a_prompt_of_the_same_tokens_gets():
    inst = Instance("http://x")
    index = KvEventIndex(inst, B, 1000)
    index.apply(decode_batch(batch(stored([b"h1", b"h2"], None, TOKENS[:8]))), 1.0)
    index.apply(decode_batch(batch(stored([b"h3"], b"h2", TOKENS[8:]))), 2.0)
    ids = prompt_ids(TOKENS)
    assert inst.prefix(ids) == (3, 2.0)
    assert inst.prefix(prompt_ids(TOKENS[:4] + [0, 0, 0, 0]))[0] == 1   # diverges at block 2
    index.apply(decode_batch(batch({"type": "BlockRemoved", "block_hashes": [b"h2"],
                                    "medium": "GPU"})), 3.0)
    assert inst.prefix(ids)[0] == 1
    index.apply(decode_batch(batch({"type": "AllBlocksCleared"})), 4.0)
    assert inst.prefix(ids)[0] == 0 and not index.ours


def test_blocks_whose_parent_is_unknown_or_of_another_size_are_ignored(caplog):
    inst = Instance("http://x")
    index = KvEventIndex(inst, B, 1000)
    index.apply(decode_batch(batch(stored([7], 6, TOKENS[:4]))), 1.0)   # parent 6 unseen
    assert not inst.blocks
    index.apply(decode_batch(batch(stored([8], None, TOKENS[:8], size=8))), 1.0)
    assert not inst.blocks and "ignored" in caplog.text


@pytest.mark.parametrize("payload", [
    b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0]),
    batch({"type": "Nope"}), batch({"type": "BlockRemoved"}),
    batch(stored([1, 2], None, TOKENS[:5])), batch(stored([1], None, ["a"] * 4)),
    batch(stored([1], None, TOKENS[:4], size=0)),
], ids=["not-msgpack", "a-map", "no-events", "unknown-type", "removed-without-hashes",
        "two-hashes-five-tokens", "tokens-not-ints", "block-size-0"])
def test_malformed_batches_are_refused(payload):
    with pytest.raises(KvEventError):
        decode_batch(payload)


def test_the_router_reads_an_engines_events_and_ages_them_out_when_they_stop():
    pytest.importorskip("aiohttp")
    zmq = pytest.importorskip("zmq")
    from aiohttp.test_utils import TestClient, TestServer

    from mooncake_plugins.conductor.costmodel import CostModel
    from mooncake_plugins.conductor.policies import Slo, make_policy
    from mooncake_plugins.conductor.router.instances import Pool
    from mooncake_plugins.conductor.router.server import Router, RouterConfig

    async def main() -> None:
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        pool = Pool()
        pool.add("http://127.0.0.1:9", "both", f"tcp://127.0.0.1:{port}")
        cost, slo = CostModel(), Slo()
        router = Router(RouterConfig(make_policy("cache_aware", cost, slo), slo, cost,
                                     block_tokens=B, health_interval_s=0.1,
                                     kv_events_timeout_s=0.3), Hasher(B), pool)
        async with AsyncExitStack() as stack:
            client = await stack.enter_async_context(TestClient(TestServer(router.app())))

            async def cached() -> int:
                return (await (await client.get("/instances")).json())[0]["cached_blocks"]

            for _ in range(100):   # a SUB socket misses what is sent before it joined
                pub.send_multipart([b"", (0).to_bytes(8, "big"),
                                    batch(stored([b"a", b"b"], None, TOKENS[:8]))])
                await asyncio.sleep(0.05)
                if await cached() == 2:
                    break
            assert await cached() == 2
            (inst,) = list(pool)
            router._last_routed[inst.url] = pool.now()   # served a request, then silence
            deadline = time.monotonic() + 10   # aged out 0.3 s on, at a health check
            while await cached() != 0:
                assert time.monotonic() < deadline, "the silent engine's blocks were kept"
                await asyncio.sleep(0.02)
        pub.close(linger=0)

    asyncio.run(main())
