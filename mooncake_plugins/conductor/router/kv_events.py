"""vLLM's KV cache events, read into the router's view of each instance's cache.

An engine started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557"}'`` publishes, on a ZMQ PUB socket, batches
``[topic, sequence, payload]`` whose payload is msgpack ``[ts, [event, ...], dp_rank?]``
with events ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
"block_size", ...}``, ``{"type": "BlockRemoved", "block_hashes", ...}`` and ``{"type":
"AllBlocksCleared"}``. vLLM's block hashes are its own (seeded, per engine), so each
stored block is re-hashed from its token ids into the router's chain
(:func:`.prompts.chain` over ``block_tokens`` ids), the parent's router id found through
the map of vLLM hashes kept per instance. The view then holds what the engine really
holds, including blocks of requests routed elsewhere or evicted since; it matches the
prompts the router hashes exactly when those are token ids or ``--tokenizer`` is given.
Every field is checked; a malformed batch is logged and skipped.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import msgpack

from .instances import Instance
from .prompts import chain_from

log = logging.getLogger(__name__)

MAX_EVENT_BYTES = 64 << 20


class KvEventError(ValueError):
    """A batch or event that does not have vLLM's shape."""


def decode_batch(payload: bytes) -> list[dict[str, Any]]:
    """The events of one batch, checked."""
    if len(payload) > MAX_EVENT_BYTES:
        raise KvEventError(f"batch of {len(payload)} bytes")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack's errors
        raise KvEventError(f"not msgpack: {exc}") from None
    if (not isinstance(batch, list) or len(batch) not in (2, 3)
            or not isinstance(batch[0], (int, float)) or not isinstance(batch[1], list)):
        raise KvEventError("a batch is [ts, [events], dp_rank?]")
    events = batch[1]
    for ev in events:
        if not isinstance(ev, dict) or ev.get("type") not in (
                "BlockStored", "BlockRemoved", "AllBlocksCleared"):
            raise KvEventError(f"unknown event {str(ev)[:80]}")
        if ev["type"] != "AllBlocksCleared" and not isinstance(ev.get("block_hashes"), list):
            raise KvEventError(f"{ev['type']} without block_hashes")
        if ev["type"] == "BlockStored":
            tokens, size = ev.get("token_ids"), ev.get("block_size")
            if (not isinstance(tokens, list) or not isinstance(size, int) or size <= 0
                    or not all(isinstance(t, int) for t in tokens)
                    or len(tokens) != size * len(ev["block_hashes"])):
                raise KvEventError("BlockStored needs token_ids of block_size per block")
    return events


def _key(h: Any) -> Any:
    """A vLLM block hash (bytes or int) as a dict key."""
    return bytes(h) if isinstance(h, (bytes, bytearray)) else h


class KvEventIndex:
    """One instance's vLLM block hashes -> the router's block ids."""

    def __init__(self, instance: Instance, block_tokens: int, capacity: int) -> None:
        self.instance = instance
        self.block_tokens = block_tokens
        self.capacity = capacity
        self.ours: dict[Any, int] = {}
        self.batches = 0
        self.last_batch_s = float("-inf")
        self._warned = False

    def forget(self) -> None:
        """Drop everything learned of the instance (its event stream is not trusted)."""
        self.ours.clear()
        self.instance.blocks.clear()

    def apply(self, events: list[dict[str, Any]], now: float) -> None:
        self.batches += 1
        self.last_batch_s = now
        for ev in events:
            kind = ev["type"]
            if kind == "AllBlocksCleared":
                self.ours.clear()
                self.instance.blocks.clear()
            elif kind == "BlockRemoved":
                for h in ev["block_hashes"]:
                    ours = self.ours.pop(_key(h), None)
                    if ours is not None:
                        self.instance.blocks.pop(ours, None)
            else:
                self._stored(ev, now)

    def _stored(self, ev: dict[str, Any], now: float) -> None:
        if ev["block_size"] != self.block_tokens:
            if not self._warned:
                log.warning("instance %s stores blocks of %d tokens; the router hashes %d "
                            "(--block-tokens): its KV events are ignored", self.instance.url,
                            ev["block_size"], self.block_tokens)
                self._warned = True
            return
        parent = ev.get("parent_block_hash")
        prev = None
        if parent is not None:
            prev = self.ours.get(_key(parent))
            if prev is None:
                return   # its prefix is unknown here (stored before we listened)
        n = self.block_tokens
        tokens = ev["token_ids"]
        blocks = [json.dumps(tokens[i:i + n]).encode() for i in range(0, len(tokens), n)]
        ids = chain_from(prev, blocks)
        for h, ours in zip(ev["block_hashes"], ids):
            self.ours[_key(h)] = ours
        self.instance.learn(ids, now, self.capacity)
        while len(self.ours) > 2 * self.capacity:
            self.ours.pop(next(iter(self.ours)))


async def subscribe(endpoint: str, index: KvEventIndex, clock: Any) -> None:
    """Read ``endpoint``'s batches into ``index`` until cancelled (pyzmq's asyncio API)."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    log.info("reading KV events of %s from %s", index.instance.url, endpoint)
    try:
        while True:
            frames = await sock.recv_multipart()
            try:
                if len(frames) != 3:
                    raise KvEventError(f"{len(frames)} frames, expected 3")
                index.apply(decode_batch(frames[2]), clock())
            except KvEventError as exc:
                log.warning("KV events of %s: skipped a batch: %s", index.instance.url, exc)
    finally:
        sock.close()
