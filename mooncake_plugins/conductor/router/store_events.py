"""The store master's KV events as the router's store view reads them: which block keys
the pool holds, kept in memory from the master's event stream (``--enable_kv_events``;
``store/kv_events.py``), so that pricing a request costs the master nothing.

:class:`StoreEventFeed` connects a ZMQ SUB socket to the master's publisher, lets the
subscription reach it, then lists the master's keys once (``list_keys``: its admin
``/get_all_keys``, streamed) and applies every event received from the subscription on,
in order, over that listing. It is :attr:`~StoreEventFeed.synced` from then until a
sequence gap (events the master or ZMQ dropped), after which it lists again; meanwhile
the view asks the master as without events. Each listed or stored key goes to
``on_stored``, which says whether to hold it (block keys; the view learns layouts from
them on the way).

A key in the listing has no medium: a ``removed`` event of either medium drops it. Where
it had both (a disk copy that stays after eviction from memory) the feed then says it is
not held until its next ``stored`` event: the router prices a load that could have been
as a recomputation, never the other way round.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable

import msgpack

log = logging.getLogger(__name__)

SETTLE_S = 0.3
"""Time given to a new subscription to reach the publisher before the keys are listed
(ZMQ drops what a PUB sends before; on one network a subscription takes milliseconds)."""
RETRY_S = 2.0
"""Wait before listing again after a failed listing."""
_MEDIA = {"cpu": 1, "disk": 2}
_LISTED = 4


class StoreEventFeed:
    """Follows one master's KV events in a thread of its own (pyzmq).

    Args:
        endpoint: the master's PUB endpoint, ``tcp://host:port``.
        list_keys: every key the master holds now (blocking; raises on failure).
        on_stored: called with each key listed or stored (in the feed's thread); whether
            to hold it (the others are ignored).
    """

    def __init__(self, endpoint: str, list_keys: Callable[[], Iterable[str]],
                 on_stored: Callable[[str], bool]) -> None:
        import zmq

        self.endpoint = endpoint
        self._list_keys, self._on_stored = list_keys, on_stored
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._held: dict[str, int] = {}
        self._synced = False
        self._last_seq: int | None = None
        self.resyncs = 0          # listings taken (the first one included)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-events", daemon=True)
        self._thread.start()

    @property
    def synced(self) -> bool:
        """Whether :meth:`holds` follows the master (listed, and no event missed since)."""
        return self._synced

    def holds(self, keys: Iterable[str]) -> list[bool]:
        held = self._held
        return [key in held for key in keys]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()

    # -- the feed's thread -------------------------------------------------------------
    def _run(self) -> None:
        self._stop.wait(SETTLE_S)
        while not self._stop.is_set():
            if not self._synced and not self._resync():
                self._stop.wait(RETRY_S)
                continue
            if self._sock.poll(100):
                self._take(self._sock.recv_multipart(), self._held)

    def _resync(self) -> bool:
        """List the master's keys, then apply what arrived meanwhile; whether it worked."""
        self.resyncs += 1
        try:
            held = {key: _LISTED for key in self._list_keys() if self._on_stored(key)}
        except Exception as exc:   # any failure: stay unsynced, the view asks the master
            log.warning("store events: listing the master's keys failed (%s); the router "
                        "asks the master per request meanwhile", exc)
            return False
        self._last_seq = None
        while self._sock.poll(0):
            self._take(self._sock.recv_multipart(), held)
        self._held = held
        self._synced = True
        log.info("store events: following %s (%d block keys held)", self.endpoint, len(held))
        return True

    def _take(self, frames: list[bytes], held: dict[str, int]) -> None:
        """Apply one message; a gap or a malformed one unsyncs the feed."""
        try:
            _, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big")
            _, events, _ = msgpack.unpackb(payload)
            changes = [(e["event_type"], e["object_key"], _MEDIA[e["medium"]]) for e in events]
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("store events: a malformed message from %s (%s): listing again",
                        self.endpoint, exc)
            self._synced = False
            return
        if self._last_seq is not None and seq != self._last_seq + 1:
            log.warning("store events: %d messages missed before %d: listing again",
                        seq - self._last_seq - 1, seq)
            self._synced = False
        self._last_seq = seq
        for kind, key, bit in changes:
            if not isinstance(key, str):
                continue
            if kind == "stored" and self._on_stored(key):
                held[key] = (held.get(key, 0) & ~_LISTED) | bit
            elif kind == "removed" and key in held:
                left = held[key] & ~bit & ~_LISTED
                if left:
                    held[key] = left
                else:
                    del held[key]

