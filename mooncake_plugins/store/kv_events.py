"""The master's KV events: objects becoming readable and going away, on ZMQ PUB, in the
wire format of the original master's publisher (RFC kvcache-ai/Mooncake #1527).

Each message is three frames, as vLLM's and the original's publishers send them: a topic
(empty), an 8-byte big-endian sequence number (one per batch; a batch dropped under
pressure leaves a gap, so a subscriber can tell it missed some) and a msgpack payload
``[timestamp_ms, [event, ...], 0]``. Each event is a map: ``event_id``, ``timestamp``,
``event_type`` (``stored`` / ``removed``; with legacy names on, ``type`` is vLLM's
``BlockStored`` / ``BlockRemoved`` too), ``tenant_id``, ``backend_id``, ``medium``
(``cpu``: a memory replica; ``disk``: the SSD tier), ``object_key``, ``seq_hashes`` (the
key read as a decimal or ``0x`` hex u64 block hash, as the original parses it; ``[]``
otherwise) and the block fields a pool does not know (``model_name`` ... ``dp_rank``, nil).

The queue between the master and the sending thread holds at most ``queue_capacity``
events: when full, the oldest is dropped and counted. With ``replay_endpoint`` a ROUTER
socket answers ``(identity, b"", start_seq)`` with every kept batch from ``start_seq``
on and an end marker (sequence -1), as vLLM's publisher does, so a subscriber that saw a
gap can catch up.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import InvalidParams

log = logging.getLogger(__name__)

MEMORY, DISK = "cpu", "disk"
"""The media an event names: the original's words for a memory and a disk replica."""

MAX_BATCH = 64
SEND_HWM = 10000
END_SEQ = (-1).to_bytes(8, "big", signed=True)
U64_MAX = (1 << 64) - 1
_HASH_KEY = re.compile(r"0[xX][0-9a-fA-F]+|[0-9]+")


def seq_hash(key: str) -> int | None:
    """``key`` as the u64 block hash the original reads from it: decimal, or hex after
    ``0x``; None when it is neither (an ordinary object name)."""
    if not _HASH_KEY.fullmatch(key):
        return None
    value = int(key[2:], 16) if key[:2] in ("0x", "0X") else int(key)
    return value if value <= U64_MAX else None


@dataclass
class KvEventConfig:
    """The master's ``--kv_events_*`` flags."""

    bind_endpoint: str
    backend_id: str
    emit_legacy_compat: bool = True
    emit_object_key: bool = True
    queue_capacity: int = 65536
    replay_endpoint: str = ""
    replay_batches: int = 10000

    def validate(self) -> None:
        if not self.bind_endpoint:
            raise InvalidParams("--enable_kv_events needs --kv_events_bind_endpoint "
                              "(e.g. tcp://0.0.0.0:5557)")
        if not self.backend_id:
            raise InvalidParams("--kv_events_backend_id must not be empty")
        if self.queue_capacity < 1:
            raise InvalidParams(f"--kv_events_queue_capacity must be at least 1, "
                              f"got {self.queue_capacity}")
        if self.replay_batches < 1:
            raise InvalidParams(f"--kv_events_replay_batches must be at least 1, "
                              f"got {self.replay_batches}")


class KvEventPublisher:
    """Publishes the events the master reports (:meth:`stored`, :meth:`removed`) from a
    thread of its own; never blocks the caller. InvalidParams when pyzmq is missing or an
    endpoint cannot be bound."""

    def __init__(self, config: KvEventConfig) -> None:
        config.validate()
        try:
            import zmq
        except ImportError:
            raise InvalidParams("--enable_kv_events needs pyzmq: pip install "
                              "'mooncake-plugins[events]'") from None
        self.config = config
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        endpoint = config.bind_endpoint
        try:
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
            self.replay_endpoint = ""
            if config.replay_endpoint:
                endpoint = config.replay_endpoint
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(endpoint)
                self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise InvalidParams(f"kv events: cannot bind {endpoint}: {exc}") from None
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[str, str, str, str]] = collections.deque()
        self._kept: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.replay_batches)
        self._stopping = False
        self._next_event_id = 1
        self._next_seq = 1
        self.published_batches = self.published_events = 0
        self.dropped_events = self.skipped_unparsed_keys = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("kv events published on %s (backend_id=%s)%s", self.endpoint,
                 config.backend_id,
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")

    def stored(self, key: str, medium: str, tenant: str = "default") -> None:
        self._enqueue(("stored", key, medium, tenant))

    def removed(self, key: str, medium: str, tenant: str = "default") -> None:
        self._enqueue(("removed", key, medium, tenant))

    def _enqueue(self, event: tuple[str, str, str, str]) -> None:
        with self._cond:
            if len(self._queue) >= self.config.queue_capacity:
                self._queue.popleft()
                self.dropped_events += 1
                self._next_seq += 1     # a gap the subscriber sees
            self._queue.append(event)
            self._cond.notify()

    def stats(self) -> dict[str, Any]:
        """The original's ``/kv_events/status`` fields."""
        with self._cond:
            return {"enabled": True, "published_batches": self.published_batches,
                    "published_events": self.published_events,
                    "dropped_events": self.dropped_events,
                    "skipped_unparsed_keys": self.skipped_unparsed_keys}

    def close(self) -> None:
        """Send what is queued, then stop (idempotent)."""
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._cond.notify()
        self._thread.join()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    # -- the sending thread ------------------------------------------------------------
    def _run(self) -> None:
        wait_s = 0.05 if self._replay is not None else None
        while True:
            with self._cond:
                if not self._queue and not self._stopping:
                    self._cond.wait(wait_s)
                batch = [self._queue.popleft() for _ in range(min(MAX_BATCH, len(self._queue)))]
                stop = self._stopping and not self._queue
            try:
                if batch:
                    self._send(batch)
                if self._replay is not None:
                    self._serve_replay()
            except Exception:   # the master goes on; the subscriber sees a gap
                log.exception("kv events: a batch of %d events was not sent", len(batch))
                with self._cond:
                    self.dropped_events += len(batch)
            if stop:
                return

    def _send(self, batch: list[tuple[str, str, str, str]]) -> None:
        cfg = self.config
        now_ms = int(time.time() * 1000)
        events = []
        skipped = 0
        for kind, key, medium, tenant in batch:
            block = seq_hash(key)
            if block is None:
                skipped += 1
                if not cfg.emit_object_key:
                    continue
            events.append(self._event(kind, key, medium, tenant, block, now_ms))
        if not events:
            with self._cond:
                self.skipped_unparsed_keys += skipped
            return
        payload = msgpack.packb([now_ms, events, 0])
        with self._cond:
            seq = self._next_seq
            self._next_seq += 1
        self._pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
        if self._replay is not None:
            self._kept.append((seq, payload))
        with self._cond:
            self.skipped_unparsed_keys += skipped
            self.published_batches += 1
            self.published_events += len(events)

    def _event(self, kind: str, key: str, medium: str, tenant: str, block: int | None,
               now_ms: int) -> dict[str, Any]:
        cfg = self.config
        stored = kind == "stored"
        event: dict[str, Any] = {"event_id": self._next_event_id, "timestamp": now_ms,
                                 "event_type": kind}
        self._next_event_id += 1
        if cfg.emit_legacy_compat:
            event["type"] = "BlockStored" if stored else "BlockRemoved"
        event.update({"model_name": None, "block_size": None, "additional_salt": None,
                      "lora_name": None, "tenant_id": tenant, "backend_id": cfg.backend_id,
                      "group_id": None, "medium": medium, "dp_rank": None})
        if cfg.emit_object_key:
            event["object_key"] = key
        event["seq_hashes"] = [] if block is None else [block]
        if cfg.emit_legacy_compat:
            # vLLM's BlockStored carries signed 64-bit hashes
            event["block_hashes"] = [] if block is None else [
                block - (1 << 64) if block >= 1 << 63 else block]
        if stored:
            event.update({"base_block_idx": 0, "parent_hash": None, "token_ids": None})
            if cfg.emit_legacy_compat:
                event["parent_block_hash"] = None
        else:
            event["base_block_idx"] = None
        return event

    def _serve_replay(self) -> None:
        """Answer the replay requests waiting: ``(identity, b"", start_seq)``."""
        zmq = self._zmq
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv events: a malformed replay request (%d frames) ignored",
                            len(frames))
                continue
            who, start = frames[0], int.from_bytes(frames[2], "big")
            try:
                for seq, payload in list(self._kept):
                    if seq >= start:
                        self._replay.send_multipart((who, b"", b"", seq.to_bytes(8, "big"),
                                                     payload), zmq.NOBLOCK)
                self._replay.send_multipart((who, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
            except zmq.Again:
                log.warning("kv events: a replay stopped: the subscriber reads too slowly")
