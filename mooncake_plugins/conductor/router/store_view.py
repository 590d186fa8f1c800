"""Which leading blocks of a prompt the shared store (our master) holds: the router's
``pool_prefix``.

Two key layouts are recognised, both ending in vLLM's block hash:

- our vLLM store connector's, ``{base}/tp{rank}of{size}/{hash}``, the base naming the
  model and KV layout (:mod:`mooncake_plugins.store.block_keys`);
- vLLM's in-tree ``MooncakeStoreConnector``'s (run on our drop-in ``mooncake`` package),
  ``{model}@tp_rank:{rank}@pcp{i}@dcp{j}@pp_rank:{k}@group:{g}@{hash}``; its TP size is
  not in the key, so it is taken as the highest rank seen for a prompt's first block,
  plus one, and the next rank is probed now and then; a block counts only where every
  pipeline stage seen holds it (each stage keys its own layers).

A third, LMCache's (its in-tree ``mooncakestore`` connector on our drop-in package, or our
LMCache connector, which puts ``{key_prefix}lmcache/`` before it), keys a chunk of
LMCache's ``chunk_size`` tokens ``{model}@{world size}@{worker}@{hash}@{dtype}`` by
LMCache's own chunk hash (:mod:`.lmcache_hashes`): it is priced where the view is given
LMCache's hashing (``lmcache``), and a chunk counts where every worker holds it.

The router computes the prompt's vLLM block hashes (:mod:`.vllm_hashes`), and the first
time a prompt's first block is in the store it learns the layouts from the master
(``keys_with_suffix``; for LMCache's keys, which go on after the hash,
``keys_containing``: scans the master answers without taking leases, repeated at most
every ``rediscover_s`` while no known layout holds a prompt's first block, and sooner
while no layout is known at all, from any keys too: :data:`FIRST_REDISCOVERY_S`,
doubling); after that
one ``peek`` per request for every layout at once (no lease either: a router's look must
not keep blocks from eviction) says which blocks every rank has, and a vLLM layout's TP
size is checked by peeking the next rank's key of a held first block (no scan). A
master that cannot be reached costs a log line a minute and counts as holding nothing.

Where the master publishes KV events (``--enable_kv_events``; asked once per master with
the ``kv_events`` RPC), the view follows them instead (:mod:`.store_events`): it lists the
master's keys once, keeps the block keys the events say the pool holds, and learns
layouts from them, so a request is priced without a call to the master; until that feed
is synced (and again after it missed events) the view asks the master as above. A master
without events is said once in the log.

An HA master group (``etcd://host:port[;host:port]``) is followed as the store's clients
follow it: the leader published in etcd is asked; when it cannot be reached, etcd is read
again (at most once a second) and a new leader is used from the next request on. The
request that found the leader gone counts the store as holding nothing; the router never
waits for an election.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from ...errors import MooncakeError, RpcFailed
from ...store import block_keys
from ...store.ha import find_leader, parse_etcd_endpoints
from ...store.rpc import RpcClient, split_address
from .lmcache_hashes import LmcacheChunkHashes
from .store_events import StoreEventFeed
from .vllm_hashes import VllmBlockHashes

log = logging.getLogger(__name__)

_PP_RANK = re.compile(r"@pp_rank:\d+")
_VLLM_KEY = re.compile(r"^(?P<pre>.+)@tp_rank:(?P<rank>\d+)"
                       r"(?P<post>@pcp\d+@dcp\d+@pp_rank:\d+@group:\d+)@(?P<hash>[0-9a-f]+)$")
_LMCACHE_KEY = re.compile(r"^(?P<pre>.+)@(?P<size>\d+)@(?P<rank>\d+)@(?P<hash>-?[0-9a-f]+)"
                          r"@(?P<dtype>[a-z][a-z0-9_]*)$")


FIRST_REDISCOVERY_S = 0.1
"""While no layout is known, the first wait before looking again (it doubles each time,
up to ``rediscover_s``), at any keys the store lists too: a router started beside an
empty store learns the layout from the first blocks saved, whatever prompt they are of,
not ``rediscover_s`` later."""


@dataclass(frozen=True)
class Layout:
    """How one model's blocks are keyed in the store: ``size`` TP ranks, keyed as our
    connector does (``kind="ours"``, ``base``), as vLLM's in-tree connector does
    (``kind="vllm"``, ``base`` the key before ``@tp_rank:``, ``tail`` the part after the
    rank) or as LMCache does (``kind="lmcache"``, ``base`` the key before the world
    size, ``tail`` ``@{dtype}``; its blocks are LMCache's chunks)."""

    kind: str
    base: str
    size: int
    tail: str = ""

    @property
    def family(self) -> tuple[str, str, str]:
        """The layout but for its TP size."""
        return self.kind, self.base, self.tail

    @property
    def model(self) -> tuple[str, str, str]:
        """The family but for its pipeline stage: the stages of one model, each holding
        its own layers of a block, share it."""
        return self.kind, self.base, _PP_RANK.sub("@pp_rank:*", self.tail)

    def keys(self, hexes: Sequence[str]) -> list[str]:
        """Every rank's key of each block, block-major."""
        if self.kind == "ours":
            return block_keys.all_ranks(self.base, hexes, self.size)
        return [self.rank_key(r, h) for h in hexes for r in range(self.size)]

    def rank_key(self, rank: int, hex_hash: str) -> str:
        """A vLLM or LMCache layout's key of one block at one rank."""
        if self.kind == "lmcache":
            return f"{self.base}@{self.size}@{rank}@{hex_hash}{self.tail}"
        return f"{self.base}@tp_rank:{rank}{self.tail}@{hex_hash}"

    @staticmethod
    def of(key: str) -> tuple[Layout, int] | None:
        """The layout a block key belongs to (its size as far as this key tells) and
        its rank; None for any other key."""
        parsed = block_keys.parse(key)
        if parsed is not None:
            return Layout("ours", parsed[0], parsed[2]), parsed[1]
        m = _VLLM_KEY.match(key)
        if m is not None:
            return Layout("vllm", m["pre"], int(m["rank"]) + 1, m["post"]), int(m["rank"])
        m = _LMCACHE_KEY.match(key)
        if m is None or not int(m["rank"]) < int(m["size"]):
            return None
        return Layout("lmcache", m["pre"], int(m["size"]), f"@{m['dtype']}"), int(m["rank"])


MAX_PROBED_RANKS = 64
"""Most ranks a vLLM layout's TP size grows by in one look."""
LEADER_LOOKUP_S = 1.0
"""Least time between two reads of an HA group's leader from etcd."""


class StoreView:
    """The store's view for the router.

    Args:
        master: ``host:port`` of the master's RPC, or ``etcd://host:port[;host:port]`` of
            an HA group's etcd (the leader is followed).
        hashes: the engines' block hashing (block size, algorithm, seed).
        lmcache: LMCache's chunk hashing, where the engines run LMCache on the store
            (None: its keys are not priced).
        rediscover_s: while no known layout holds a prompt's first block (or a vLLM
            layout's TP size may be larger than seen), look for layouts at most this
            often.
        timeout_s: RPC timeout.
        cluster_id: the HA group's ``--cluster_id`` (with ``etcd://`` only).
        events: follow the master's KV events where it publishes them (False: always
            ask the master).
    """

    def __init__(self, master: str, hashes: VllmBlockHashes, rediscover_s: float = 30.0,
                 timeout_s: float = 2.0, cluster_id: str = "mooncake",
                 lmcache: LmcacheChunkHashes | None = None, events: bool = True) -> None:
        self.hashes = hashes
        self.lmcache = lmcache
        self._unpriced: set[str] = set()   # LMCache layouts seen without its hashing
        self.layouts: list[Layout] = []
        self._timeout_s = timeout_s
        self._etcd: str | None = None
        self._rpc: RpcClient | None = None
        if master.startswith("etcd://"):
            self._etcd = master[len("etcd://"):]
            parse_etcd_endpoints(self._etcd)   # ValueError (InvalidArgument) on bad input
            self._cluster_id = cluster_id
        else:
            self._rpc = RpcClient(*split_address(master), timeout_s)
        self._events = events
        self.feed: StoreEventFeed | None = None
        self._feed_asked: str | None = None   # the master last asked where it publishes
        self._feed_retry_at = 0.0
        self._next_lookup = 0.0
        self._rediscover_s = rediscover_s
        self._unknown_wait_s = min(FIRST_REDISCOVERY_S, rediscover_s)
        self._next_discovery = 0.0
        self._next_warning = 0.0

    @property
    def address(self) -> str:
        """The master asked now (``host:port``; the etcd URL while no leader is known)."""
        return self._rpc.address if self._rpc is not None else f"etcd://{self._etcd}"

    def prefix_blocks(self, token_ids: Sequence[int]) -> int:
        """Leading blocks of the prompt ``token_ids`` the store holds for every rank of
        one layout (blocking: one or two RPCs). Only blocks before the prompt's last
        token count, as the connector loads no more."""
        usable = (len(token_ids) - 1) // self.hashes.block_size
        if usable <= 0:
            return 0
        hexes = {"block": [h.hex() for h in self.hashes.of(token_ids, usable)],
                 "chunk": [] if self.lmcache is None else self.lmcache.of(token_ids)}
        try:
            feed = self._feed()
            if feed is not None and feed.synced:   # layouts come with the events
                return self._best(hexes, usable, feed.holds)
            best = self._best(hexes, usable)
            # a vLLM layout's TP size is a lower bound: the next rank is probed too
            unsure = any(layout.kind == "vllm" for layout in self.layouts)
            if (best == 0 or unsure) and time.monotonic() >= self._next_discovery:
                # while no layout is known (a new or emptied store) look again soon,
                # then less and less often; once one is, every rediscover_s
                wait = self._rediscover_s if self.layouts else self._unknown_wait_s
                self._unknown_wait_s = min(2 * self._unknown_wait_s, self._rediscover_s)
                self._next_discovery = time.monotonic() + wait
                first_chunk = hexes["chunk"][0] if hexes["chunk"] else None
                if self._discover(hexes["block"][0], first_chunk) if best == 0 \
                        else self._grow(hexes["block"][0]):
                    self._next_discovery = time.monotonic() + self._rediscover_s
                    best = self._best(hexes, usable)
            return best
        except MooncakeError as exc:
            if time.monotonic() >= self._next_warning:
                self._next_warning = time.monotonic() + 60
                log.warning("store master %s: %s (the store's blocks are not priced)",
                            self.address, exc)
            if self._etcd is not None and self._rpc is not None:
                self._rpc.close()   # the leader may have changed: read etcd next time
                self._rpc = None
                self._close_feed()
            return 0

    def _feed(self) -> StoreEventFeed | None:
        """The event feed of the master asked now, started the first time it is asked
        (None: events off here, or that master publishes none)."""
        if not self._events:
            return None
        master = self._master()
        if self._feed_asked == master.address or time.monotonic() < self._feed_retry_at:
            return self.feed
        self._close_feed()
        try:
            info = master.call("kv_events")
        except RpcFailed:
            # down, or a master of before the kv_events call (it closes the line): ask
            # again after rediscover_s
            self._feed_retry_at = time.monotonic() + self._rediscover_s
            return None
        self._feed_asked = master.address
        endpoint = info.get("endpoint", "") if isinstance(info, dict) else ""
        port = info.get("metrics_port", 0) if isinstance(info, dict) else 0
        if not endpoint or not port:
            log.info("store master %s publishes no KV events (--enable_kv_events): "
                     "the router asks it per request", master.address)
            return None
        if importlib.util.find_spec("zmq") is None:
            log.warning("store master %s publishes KV events but pyzmq is missing here "
                        "(pip install 'mooncake-plugins[conductor]'): asking it per request",
                        master.address)
            return None
        host = split_address(master.address)[0]
        self.feed = StoreEventFeed(_reachable(endpoint, host),
                                   lambda: _all_keys(host, port, self._timeout_s), self._learn)
        log.info("store master %s: following its KV events at %s", master.address,
                 self.feed.endpoint)
        return self.feed

    def _close_feed(self) -> None:
        if self.feed is not None:
            self.feed.close()
            self.feed = None
        self._feed_asked = None

    def _learn(self, key: str) -> bool:
        """A key the master holds, from the events or their listing: whether it is a
        block key (the feed holds those), learning its layout if new or wider (the feed's
        thread; the layout list is replaced whole)."""
        seen = Layout.of(key)
        if seen is None:
            return False
        layout = seen[0]
        if layout.kind == "lmcache" and self.lmcache is None:
            self._warn_unpriced(layout)
            return True
        known = next((k for k in self.layouts if k.family == layout.family), None)
        if known is not None and known.size >= layout.size:
            return True
        self.layouts = [k for k in self.layouts if k.family != layout.family] + [layout]
        log.info("store layout learned from events: %s (%s keys, TP %d)", layout.base,
                 layout.kind, layout.size)
        return True

    def _warn_unpriced(self, layout: Layout) -> None:
        if layout.base not in self._unpriced:
            self._unpriced.add(layout.base)
            log.warning("the store holds LMCache chunks of %s: give the router LMCache's "
                        "chunk size and hashing (--store-lmcache-chunk-size) to price them",
                        layout.base)

    def _master(self) -> RpcClient:
        """The RPC client of the master to ask (an HA group's leader, read from etcd)."""
        if self._rpc is not None:
            return self._rpc
        assert self._etcd is not None
        if time.monotonic() < self._next_lookup:
            raise RpcFailed(f"no leader of {self._cluster_id!r} in etcd://{self._etcd} yet")
        self._next_lookup = time.monotonic() + LEADER_LOOKUP_S
        leader = find_leader(self._etcd, self._cluster_id)
        if leader is None:
            raise RpcFailed(f"no leader of {self._cluster_id!r} published in "
                            f"etcd://{self._etcd}")
        log.info("store master: the leader of %r is %s (term %d)", self._cluster_id,
                 leader.address, leader.term)
        self._rpc = RpcClient(*split_address(leader.address), self._timeout_s)
        return self._rpc

    def _best(self, hexes: dict[str, list[str]], usable: int,
              holds: Callable[[list[str]], list] | None = None) -> int:
        """The most leading blocks (of at most ``usable``) one model holds whole: at
        every TP rank of every pipeline stage seen (LMCache: its chunks, at every
        worker, in blocks). ``holds`` says which keys the pool holds (default: ask the
        master)."""
        layouts = self.layouts
        if not layouts:
            return 0
        keys = [layout.keys(hexes["chunk" if layout.kind == "lmcache" else "block"])
                for layout in layouts]
        flat = [k for each in keys for k in each]
        present = holds(flat) if holds is not None else self._master().call("peek", keys=flat)
        held: dict[tuple[str, str, str], int] = {}
        at = 0
        for layout, each in zip(layouts, keys):
            n = block_keys.leading_blocks(present[at:at + len(each)], layout.size)
            at += len(each)
            if layout.kind == "lmcache":   # whole chunks, before the prompt's last token
                assert self.lmcache is not None
                n = min(usable, n * self.lmcache.chunk_size // self.hashes.block_size)
            held[layout.model] = min(held.get(layout.model, n), n)
        return max(held.values())

    def _discover(self, first_hex: str, first_chunk: str | None = None) -> bool:
        """Learn the layouts that hold the block ``first_hex`` or LMCache's chunk
        ``first_chunk`` (a vLLM layout's size grows to the highest rank seen), or while
        none is known and none does, those of any keys the store lists; whether any is
        new or grew."""
        found: dict[tuple[str, str, str], Layout] = {}   # the largest seen per family

        def look(method: str, **params: str) -> None:
            for key in self._master().call(method, **params, limit=256):
                seen = Layout.of(key) if isinstance(key, str) else None
                if seen is None:
                    continue
                layout = seen[0]
                if layout.kind == "lmcache" and self.lmcache is None:
                    self._warn_unpriced(layout)
                elif layout.family not in found or found[layout.family].size < layout.size:
                    found[layout.family] = layout

        look("keys_with_suffix", suffix=first_hex)
        if first_chunk is not None:
            look("keys_containing", part=f"@{first_chunk}@")
        if not found and not self.layouts:
            look("keys_with_suffix", suffix="")
        changed = False
        for layout in found.values():
            if layout in self.layouts:
                continue
            self.layouts = [known for known in self.layouts if known.family != layout.family]
            log.info("store layout learned: %s (%s keys, TP %d)", layout.base, layout.kind,
                     layout.size)
            self.layouts.append(layout)
            changed = True
        return changed

    def _grow(self, first_hex: str) -> bool:
        """Probe each vLLM layout's next rank for the block ``first_hex`` (one ``peek``
        per step, no scan); whether a TP size grew."""
        grown = False
        for _ in range(MAX_PROBED_RANKS):
            vllm = [i for i, layout in enumerate(self.layouts) if layout.kind == "vllm"]
            present = self._master().call("peek", keys=[
                self.layouts[i].rank_key(self.layouts[i].size, first_hex) for i in vllm])
            if not any(present):
                break
            for i, found in zip(vllm, present):
                if found:
                    layout = self.layouts[i]
                    self.layouts[i] = Layout(layout.kind, layout.base, layout.size + 1,
                                             layout.tail)
                    log.info("store layout %s: TP %d seen", layout.base, layout.size + 1)
            grown = True
        return grown

    def close(self) -> None:
        self._close_feed()
        if self._rpc is not None:
            self._rpc.close()


def _reachable(endpoint: str, host: str) -> str:
    """``endpoint`` as a subscriber connects to it: a wildcard bind address (``*``,
    ``0.0.0.0``, ``::``) becomes ``host``, the master's address."""
    scheme, _, rest = endpoint.partition("://")
    addr, _, port = rest.rpartition(":")
    if addr in ("*", "0.0.0.0", "[::]", "::", "[*]"):
        addr = f"[{host}]" if ":" in host else host
    return f"{scheme}://{addr}:{port}"


def _all_keys(host: str, port: int, timeout_s: float) -> Iterator[str]:
    """Every key the master at ``host`` holds, from its admin ``/get_all_keys`` (one per
    line, streamed)."""
    import urllib.request

    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/get_all_keys"
    with urllib.request.urlopen(url, timeout=max(timeout_s, 10.0)) as reply:
        for line in reply:
            key = line.rstrip(b"\n").decode("utf-8", "replace")
            if key:
                yield key
