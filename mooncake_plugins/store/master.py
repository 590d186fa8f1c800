"""The master's object metadata: where every replica lives, leases, eviction, client liveness.

Bytes never pass through here. ``MasterService`` is pure logic (no I/O, clock injectable),
made thread-safe by one lock; ``server.py`` puts it behind RPC.

Object life: ``put_start`` allocates replicas (PROCESSING, invisible) -> the writer moves
the bytes -> ``put_end`` makes them visible (COMPLETE); ``put_revoke`` or a writer that
never finishes (``put_start_discard_timeout_s``) frees them. A small object can also take
one round trip: ``reserve`` places slots of one size ahead for a client, the client writes
into one and ``put_reserved`` makes it the object (a slot not used within that timeout is
freed; slots are not journaled, so a client drops its slots when it changes masters).
``get`` and ``exist`` grant a
read lease (as the original's ``ExistKey`` does); leased objects are neither evicted nor
removed (unless forced), and space freed while a lease runs is only reused after it ends.
A copy in flight holds its source's bytes the same way, but does not stop a removal.

Replica repair (repair.py): when a client dies, objects that lost replicas with its
segments get new ones on other live segments, copied by a client holding a surviving
replica (a copy task) and visible only once the copy ended.

Lock order: ``MasterService._lock`` only (allocators and LRU live under it). No file is
touched under it: disk replicas to delete are queued (:meth:`MasterService.take_disk_drops`)
and the server deletes them after the call returned.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import random
import re
import threading
import time
import uuid
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Callable

from ..errors import (ClientNotFound, InvalidKey, InvalidParams, JobNotFound, NoAvailableSpace,
                      ObjectAlreadyExists, ObjectHasLease, ObjectNotFound, ReplicaNotReady,
                      SegmentAlreadyExists, StoreError, StoreSegmentNotFound, TaskLimitExceeded,
                      UnavailableInCurrentStatus, store_error)
from .allocation import STRATEGIES, MountedSegment, align, order_segments
from .journal import OBJECT, SEGMENT, Journal, State
from .kv_events import DISK, MEMORY, KvEventPublisher
from .limits import MAX_OBJECT_NBYTES, MAX_SLOT_NBYTES, check_key
from .offload import relative_name
from .repair import RepairQueue
from .tasks import (COPY, FAILED, JOB_CANCELED, JOB_FAILED, JOB_SUCCEEDED, MOVE, SUCCESS, DrainJob,
                    TaskId, TaskQueue)

log = logging.getLogger(__name__)

MAX_LISTED_KEYS = 1000
MAX_SLOTS_PER_CALL = 64
MAX_CLIENT_SLOT_NBYTES = 4 << 20
SLOT_SHARE = 16
"""A client's slots hold at most 1/SLOT_SHARE of the pool's capacity (and
MAX_CLIENT_SLOT_NBYTES): reserved space is space eviction cannot reclaim."""

Shard = tuple[str, int, int]          # (segment name, address, nbytes)
MemoryReplica = list[Shard]


@dataclass
class MasterConfig:
    """Master tunables; names follow the original mooncake_master flags."""

    allocation_strategy: str = "random"
    eviction_high_watermark_ratio: float = 0.95
    eviction_ratio: float = 0.05
    default_kv_lease_ttl_ms: int = 5000
    default_kv_soft_pin_ttl_ms: int = 30 * 60 * 1000
    max_kv_soft_pin_ttl_ms: int = 24 * 60 * 60 * 1000
    allow_evict_soft_pinned_objects: bool = True
    client_ttl_s: float = 10.0
    restored_client_grace_s: float = 0.0
    """How long the owner of a segment restored from the journal (a new leader, a restarted
    master) has to heartbeat or register before its segments are dropped; 0: three client
    TTLs. Its clients are finding the new master meanwhile: one TTL is not a fair chance."""
    put_start_discard_timeout_s: float = 30.0
    stripe_nbytes: int = 16 << 20
    enable_offload: bool = False
    root_fs_dir: str = ""
    """Directory the SSD tier's files live under (needed by ``enable_offload``)."""
    task_pending_timeout_s: float = 300.0
    """A copy/move task its client has not picked up by then fails (0: never)."""
    task_processing_timeout_s: float = 300.0
    """A copy/move task its client has not finished by then fails (0: never)."""
    max_pending_tasks: int = 10000
    max_finished_tasks: int = 10000
    replica_repair_concurrency: int = 64
    """Copy tasks re-creating replicas lost with a dead client, at most this many at a
    time (0: lost replicas are not re-created)."""
    persist_puts: bool = False
    """Ask every client to keep each object it puts in the SSD tier (under its own
    ``ssd_offload_path``, else under ``root_fs_dir``), as the original does whenever its
    master has a ``root_fs_dir``. Needs ``enable_offload``."""

    def validate(self) -> None:
        if self.allocation_strategy not in STRATEGIES:
            raise InvalidParams(f"allocation_strategy must be one of {STRATEGIES}")
        if not 0 < self.eviction_high_watermark_ratio <= 1 or not 0 < self.eviction_ratio <= 1:
            raise InvalidParams("eviction ratios must be in (0, 1]")
        if not 0 <= self.default_kv_soft_pin_ttl_ms <= self.max_kv_soft_pin_ttl_ms:
            raise InvalidParams("default_kv_soft_pin_ttl must be in [0, max_kv_soft_pin_ttl]")
        if self.default_kv_lease_ttl_ms <= 0 or self.client_ttl_s <= 0:
            raise InvalidParams("lease and client TTLs must be > 0")
        if self.restored_client_grace_s < 0:
            raise InvalidParams("restored_client_grace_s must be >= 0")
        if self.replica_repair_concurrency < 0:
            raise InvalidParams("replica_repair_concurrency must be >= 0")
        if self.stripe_nbytes < 4096:
            raise InvalidParams("stripe_nbytes must be >= 4096")
        if self.enable_offload and not self.root_fs_dir:
            raise InvalidParams("enable_offload needs root_fs_dir: the directory the SSD tier's "
                                "files live under (the clients' ssd_offload_path)")
        if self.persist_puts and not self.enable_offload:
            raise InvalidParams("persist_puts needs enable_offload")
        if self.root_fs_dir and not os.path.isdir(self.root_fs_dir):
            raise InvalidParams(f"root_fs_dir {self.root_fs_dir!r} is not a directory")


SOFT_PIN_ACTIONS = ("preserve", "enable", "disable")


@dataclass
class PutConfig:
    """Per-put options (the original's ReplicateConfig).

    Soft pin (evicted only after unpinned objects): ``soft_pin_action`` "preserve" keeps
    the object's current pin (a new object has none), "enable" pins it for
    ``soft_pin_ttl_ms`` (None: the master's default; 0 unpins), "disable" unpins it.
    ``with_soft_pin`` is the older spelling of "enable" with the default TTL. A hard-pinned
    object is never evicted.
    """

    replica_num: int = 1
    preferred_segments: list[str] = field(default_factory=list)
    with_soft_pin: bool = False
    upsert: bool = False
    soft_pin_action: str = "preserve"
    soft_pin_ttl_ms: int | None = None
    with_hard_pin: bool = False

    def pin_ttl_ms(self, config: MasterConfig) -> int | None:
        """The soft pin TTL this put sets at put_end (0: unpin), None: leave the pin as is.

        Raises InvalidParams for a TTL without "enable", or one above the master's maximum.
        """
        action = "enable" if self.with_soft_pin and self.soft_pin_action == "preserve" \
            else self.soft_pin_action
        if action not in SOFT_PIN_ACTIONS:
            raise InvalidParams(f"soft_pin_action must be one of {SOFT_PIN_ACTIONS}, got {action!r}")
        if action != "enable":
            if self.soft_pin_ttl_ms is not None:
                raise InvalidParams(f"soft_pin_ttl_ms needs soft_pin_action 'enable', not {action!r}")
            return 0 if action == "disable" else None
        ttl = config.default_kv_soft_pin_ttl_ms if self.soft_pin_ttl_ms is None else self.soft_pin_ttl_ms
        if not 0 <= ttl <= config.max_kv_soft_pin_ttl_ms:
            raise InvalidParams(f"soft_pin_ttl_ms must be in [0, {config.max_kv_soft_pin_ttl_ms}], "
                                f"got {ttl}")
        return ttl


@dataclass(eq=False, slots=True)
class ObjectMeta:
    nbytes: int
    replicas: list[MemoryReplica] = field(default_factory=list)   # complete, readable
    pending: list[MemoryReplica] | None = None                   # being written
    pending_nbytes: int = 0
    writer: str = ""
    started: float = 0.0
    lease_until: float = 0.0        # no replica byte is freed before (readers and copiers)
    read_until: float = 0.0         # the latest lease granted to a reader
    soft_pin_until: float = 0.0
    pending_pin_ttl_ms: int | None = None   # applied at put_end (PutConfig.pin_ttl_ms)
    hard_pinned: bool = False
    pending_hard_pin: bool = False
    owner: str = ""                 # client whose put made the current replicas
    replica_num: int = 0            # memory replicas it should have: lost ones are re-created
    disk_name: str | None = None    # under root_fs_dir, derived from the key by the master

    @property
    def complete(self) -> bool:
        return bool(self.replicas) or self.disk_name is not None


@dataclass(eq=False, slots=True)
class Slot:
    """Space placed ahead for one small put of ``client_id`` (see :meth:`MasterService.reserve`)."""

    client_id: str
    nbytes: int
    replicas: list[MemoryReplica]
    made: float

    @property
    def cost(self) -> int:
        """Bytes its shards take in the segments' allocators."""
        return sum(align(s[2]) for r in self.replicas for s in r)


@dataclass(eq=False)
class ReplicaCopy:
    """New replicas of an object being written by a copy/move task (invisible until done)."""

    client_id: str
    source: MemoryReplica
    new: list[MemoryReplica]
    drop_segment: str | None    # a move: the source segment, whose replica goes at the end
    deadline: float             # monotonic: cancelled when replica_end has not come by then


@dataclass(eq=False)
class ClientInfo:
    client_id: str
    host_id: str
    last_seen: float
    segments: set[str] = field(default_factory=set)
    confirmed: bool = True      # False: restored from the journal, not heard from since


_GONE = ClientInfo("", "", 0.0, confirmed=False)
_MEMORY, _DISK = 1, 2   # media bits of MasterService._announced


def _check_slot_request(nbytes: object, replica_num: object, count: object) -> None:
    if not isinstance(nbytes, int) or not 0 < nbytes <= MAX_SLOT_NBYTES:
        raise InvalidParams(f"slot size must be in (0, {MAX_SLOT_NBYTES}], got {nbytes!r}")
    if not isinstance(replica_num, int) or not 1 <= replica_num <= 16:
        raise InvalidParams(f"replica_num must be in [1, 16], got {replica_num!r}")
    if not isinstance(count, int) or not 0 <= count <= MAX_SLOTS_PER_CALL:
        raise InvalidParams(f"count must be in [0, {MAX_SLOTS_PER_CALL}], got {count!r}")


class MasterService:
    """Object and segment metadata of one store cluster (thread-safe).

    Args:
        config: tunables.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, config: MasterConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or MasterConfig()
        self.config.validate()
        self._clock = clock
        self._lock = threading.Lock()
        self._disk_drops: list[str] = []    # disk replica names nothing refers to any more
        self._objects: OrderedDict[str, ObjectMeta] = OrderedDict()   # LRU order, oldest first
        # keys put_start reserved space for (a superset of the puts in flight: entries whose
        # put ended leave at the next reap), so the reaper never scans every object
        self._writing: dict[str, None] = {}
        self._segments: dict[str, MountedSegment] = {}
        self._clients: dict[str, ClientInfo] = {}
        self._deferred: list[tuple[float, MemoryReplica]] = []        # freed after a lease ends
        self._rng = random.Random()
        self._copies: dict[str, ReplicaCopy] = {}                    # by key, one at a time
        # cancelled copies whose writer may still be filling their new replicas: the space
        # stays reserved until their replica_end or deadline
        self._cancelled: list[tuple[str, ReplicaCopy]] = []
        self._draining: set[str] = set()                             # segments taking no new data
        self._drained: set[str] = set()                              # ... and holding none
        self._drains: dict[str, DrainJob] = {}
        self._slots: dict[int, Slot] = {}            # by id, oldest first
        self._slot_nbytes: dict[str, int] = {}       # per client: bytes its slots hold
        # ids start at random: a restarted master never takes an earlier incarnation's slot
        self._slot_ids = itertools.count(random.getrandbits(62))
        self.max_finished_drains = 1000                              # oldest finished ones forgotten
        c = self.config
        self.tasks = TaskQueue(max_pending=c.max_pending_tasks, max_finished=c.max_finished_tasks,
                               pending_timeout_s=c.task_pending_timeout_s or math.inf,
                               processing_timeout_s=c.task_processing_timeout_s or math.inf,
                               clock=clock)
        self.repairs = RepairQueue(c.replica_repair_concurrency)
        self.counters = {"puts": 0, "gets": 0, "removes": 0, "evicted": 0, "offloaded_evictions": 0,
                         "expired_clients": 0, "discarded_puts": 0, "recovered_objects": 0,
                         "reserved_puts": 0}
        self._journal: Journal | None = None
        self.events: KvEventPublisher | None = None
        self._announced: dict[str, int] = {}   # key -> media told to subscribers (events on)
        self._freed = False      # space was freed since free_seq was last taken
        self.free_seq = 0
        """Journal changes to wait for before handing out space: the ones that freed it
        (else a crash could bring back an object whose bytes a new put overwrote)."""

    # -- durability (journal.py) --------------------------------------------------------
    def attach_journal(self, journal: Journal) -> None:
        """Record every change of committed state in ``journal`` from now on."""
        with self._lock:
            self._journal = journal

    # -- KV events (kv_events.py) -------------------------------------------------------
    def attach_events(self, publisher: KvEventPublisher) -> None:
        """Tell ``publisher`` each change of what is readable from now on, starting with a
        stored event for each medium of every readable object (after a restart or a
        failover, subscribers learn what the pool holds)."""
        with self._lock:
            self.events = publisher
            for key in self._objects:
                self._announce(key)

    def _announce(self, key: str) -> None:
        """Stored/removed events for the media (memory, disk) ``key`` gained or lost."""
        meta = self._objects.get(key)
        now = 0 if meta is None else (_MEMORY if meta.replicas else 0) | (
            _DISK if meta.disk_name is not None else 0)
        before = self._announced.pop(key, 0)
        if now:
            self._announced[key] = now
        for bit, medium in ((_MEMORY, MEMORY), (_DISK, DISK)):
            if now & bit and not before & bit:
                self.events.stored(key, medium)
            elif before & bit and not now & bit:
                self.events.removed(key, medium)

    def _note(self, key: str) -> None:
        """Record ``key``'s committed state (or that it is gone); tell subscribers."""
        if self.events is not None:
            self._announce(key)
        if self._journal is None:
            return
        meta = self._objects.get(key)
        value = None
        if meta is not None and meta.complete:
            left = meta.soft_pin_until - self._clock()
            value = [meta.nbytes, [list(r) for r in meta.replicas], meta.owner, meta.hard_pinned,
                     int((time.time() + left) * 1000) if left > 0 else 0, meta.disk_name,
                     meta.replica_num]
        self._journal.record(OBJECT, key, value)

    def _note_segment(self, name: str) -> None:
        if self._journal is None:
            return
        seg = self._segments.get(name)
        self._journal.record(SEGMENT, name, None if seg is None else
                             [seg.client_id, seg.host_id, seg.base, seg.nbytes])

    def _take_free_seq(self) -> None:
        """Before space leaves the lock: make handing it out wait for the frees so far."""
        if self._freed and self._journal is not None:
            self.free_seq, self._freed = self._journal.seq, False

    def restore(self, state: State) -> int:
        """Rebuild segments and objects from a journal's state (before serving); returns
        the number of objects restored.

        The segments' owners are known again but unconfirmed: their segments take new data
        at once (after segments whose owner is back), and those that stay silent for
        ``restored_client_grace_s`` (three client TTLs by default) are dropped as usual;
        repairs wait for them. The allocators hold exactly the journaled replicas. Replicas
        on unknown segments are dropped; objects left with fewer replicas than they should
        have are queued for repair.
        """
        with self._lock:
            now = self._clock()
            for (kind, name), value in state.items():
                if kind != SEGMENT:
                    continue
                client_id, host_id, base, nbytes = value
                c = self._clients.setdefault(client_id, ClientInfo(client_id, host_id, now,
                                                                   confirmed=False))
                c.segments.add(name)
                self._segments[name] = MountedSegment(name, client_id, base, nbytes, host_id)
            used: dict[str, list[tuple[int, int]]] = defaultdict(list)
            wall_ms = time.time() * 1000
            for (kind, key), value in state.items():
                if kind != OBJECT:
                    continue
                nbytes, replicas, owner, hard, pin_ms, disk = value[:6]
                kept = [[tuple(s) for s in r] for r in replicas
                        if all(s[0] in self._segments for s in r)]
                meta = ObjectMeta(nbytes, kept, owner=owner, hard_pinned=hard, disk_name=disk,
                                  soft_pin_until=now + (pin_ms - wall_ms) / 1000 if pin_ms else 0.0,
                                  replica_num=value[6] if len(value) > 6 else len(replicas))
                if not meta.complete:
                    self._note(key)
                    continue
                self._objects[key] = meta
                for r in kept:
                    for name, address, n in r:
                        used[name].append((address - self._segments[name].base, n))
            bad = {(name, self._segments[name].base + off, n)
                   for name, blocks in used.items()
                   for off, n in self._segments[name].allocator.rebuild(blocks)}
            if bad:
                log.error("journal: %d replica shards overlap others or leave their segment: "
                          "dropping those replicas", len(bad))
                for key, meta in list(self._objects.items()):
                    good = [r for r in meta.replicas if not any(s in bad for s in r)]
                    if len(good) < len(meta.replicas):
                        self._free([s for r in meta.replicas if r not in good for s in r
                                    if s not in bad])
                        meta.replicas = good
                        if not meta.complete:
                            del self._objects[key]
                        self._note(key)
            for key, meta in self._objects.items():
                if 0 < len(meta.replicas) < meta.replica_num:
                    self.repairs.add(key)
            self.counters["recovered_objects"] = len(self._objects)
            return len(self._objects)

    # -- clients and segments ---------------------------------------------------------
    def register_client(self, client_id: str, host_id: str) -> None:
        with self._lock:
            c = self._clients.get(client_id)
            if c is None:
                self._clients[client_id] = ClientInfo(client_id, host_id, self._clock())
            else:
                c.last_seen, c.confirmed = self._clock(), True

    def unregister_client(self, client_id: str) -> None:
        """A client that is closing: forget it now, not a heartbeat TTL later (that is
        for clients that died). Its unfinished tasks fail, its copies are cancelled and its
        segments go as with an unmount; an unknown client is no error (it expired first)."""
        with self._lock:
            c = self._clients.pop(client_id, None)
            if c is None:
                return
            self.tasks.fail_client(client_id, "its client closed")
            self._cancel_copies(self._clock(), set(), {client_id})
            self._drop_slots(lambda slot: slot.client_id == client_id)
            self._drop_segments(set(c.segments))
        log.info("client %s closed", client_id)

    def heartbeat(self, client_id: str) -> None:
        """Refresh a client's TTL. Raises ClientNotFound when it expired (it must remount)."""
        with self._lock:
            c = self._client(client_id)
            c.last_seen, c.confirmed = self._clock(), True

    def touch_clients(self, client_ids: set[str]) -> None:
        """Count these registered clients as heard from now (their connections are open)."""
        with self._lock:
            now = self._clock()
            for cid in client_ids:
                c = self._clients.get(cid)
                if c is not None and c.confirmed:
                    c.last_seen = now

    def _client(self, client_id: str) -> ClientInfo:
        c = self._clients.get(client_id)
        if c is None:
            raise ClientNotFound(f"client {client_id!r} is not registered with this master")
        return c

    def mount_segment(self, client_id: str, name: str, base: int, nbytes: int) -> None:
        if not isinstance(name, str) or not name or base < 0 or nbytes < 4096 \
                or base + nbytes > 1 << 64:
            raise InvalidParams(f"bad segment {name!r} base={base} nbytes={nbytes}")
        with self._lock:
            client = self._client(client_id)
            old = self._segments.get(name)
            if old is not None:
                owner = self._clients.get(old.client_id)
                if old.client_id == client_id or owner is None or owner.confirmed:
                    raise SegmentAlreadyExists(f"segment {name!r} is mounted already")
                # restored from the journal, and its name is now another process's: the
                # bytes recorded there are gone with the process that had them
                self._drop_segments({name}, repair=True)
            self._segments[name] = MountedSegment(name, client_id, base, nbytes, client.host_id)
            client.segments.add(name)
            self._note_segment(name)
        log.info("mounted segment %s (%d bytes) of client %s", name, nbytes, client_id)

    def unmount_segment(self, client_id: str, name: str) -> None:
        with self._lock:
            seg = self._segments.get(name)
            if seg is None or seg.client_id != client_id:
                raise StoreSegmentNotFound(f"client {client_id!r} has no segment {name!r}")
            self._drop_segments({name})
        log.info("unmounted segment %s of client %s", name, client_id)

    def _drop_segments(self, names: set[str], repair: bool = False) -> None:
        """Forget segments and every replica with a shard on them (memory is gone with its
        owner). Their shards on other segments are freed, after the read lease if any.
        ``repair`` (the owner died): objects left short of replicas are queued for repair;
        otherwise (an unmount) they keep fewer replicas from now on."""
        for name in names:
            seg = self._segments.pop(name, None)
            if seg is not None:
                c = self._clients.get(seg.client_id)
                if c:
                    c.segments.discard(name)
                self._note_segment(name)
        for key, cp in list(self._copies.items()):
            if self._on(cp.source, names) or any(self._on(r, names) for r in cp.new):
                self._cancel_copy(key)
        self._drop_slots(lambda slot: any(self._on(r, names) for r in slot.replicas),
                         client_may_write=True)
        for _, cp in self._cancelled:  # their space there went with the segment
            kept = [[s for s in r if s[0] not in names] for r in cp.new]
            cp.new = [r for r in kept if r]
        self._draining -= names
        self._drained -= names
        deferred = [(t, [s for s in r if s[0] not in names]) for t, r in self._deferred]
        self._deferred = [(t, r) for t, r in deferred if r]
        queued = 0
        for key in list(self._objects):
            meta = self._objects[key]
            lost = [r for r in meta.replicas if self._on(r, names)]
            if lost:
                meta.replicas = [r for r in meta.replicas if not self._on(r, names)]
                rest = [[s for s in r if s[0] not in names] for r in lost]
                self._free_after_lease(meta, [r for r in rest if r])
            if meta.pending is not None and any(self._on(r, names) for r in meta.pending):
                self._free([s for r in meta.pending for s in r if s[0] not in names])
                meta.pending = None
            if not meta.complete and meta.pending is None:
                del self._objects[key]
            if lost:
                if not repair:  # its holder left on purpose: the object keeps fewer replicas
                    meta.replica_num = min(meta.replica_num, len(meta.replicas))
                elif meta.replicas and len(meta.replicas) < meta.replica_num:
                    self.repairs.add(key)
                    queued += 1
                self._note(key)
        if queued:
            log.warning("%d objects lost replicas with segments %s: %s", queued, sorted(names),
                        "re-creating them elsewhere" if self.repairs.enabled
                        else "replica repair is off (replica_repair_concurrency=0)")

    @staticmethod
    def _on(replica: MemoryReplica, names: set[str]) -> bool:
        """Whether ``replica`` has a shard on one of the segments ``names``."""
        return any(s[0] in names for s in replica)

    # -- allocation -------------------------------------------------------------------
    def _free(self, replica: MemoryReplica) -> None:
        self._freed = True
        for name, address, nbytes in replica:
            seg = self._segments.get(name)
            if seg is not None:
                seg.allocator.free(address - seg.base, nbytes)

    def _free_after_lease(self, meta: ObjectMeta, replicas: list[MemoryReplica]) -> None:
        now = self._clock()
        for r in replicas:
            if meta.lease_until > now:
                self._deferred.append((meta.lease_until, r))
            else:
                self._free(r)

    def _allocate_replica(self, nbytes: int, candidates: list[MountedSegment],
                          high: bool = False, max_shards: int | None = None
                          ) -> MemoryReplica | None:
        """Place one replica on ``candidates`` (striped when large, over ``max_shards``
        segments at most); removes used ones from it. ``high``: at the top of the
        segments' free space."""
        nshards = max(1, min(math.ceil(nbytes / self.config.stripe_nbytes), len(candidates),
                             max_shards or len(candidates)))
        while nshards >= 1:
            sizes = [nbytes // nshards + (1 if i < nbytes % nshards else 0) for i in range(nshards)]
            placed: MemoryReplica = []
            used: list[MountedSegment] = []
            for size in sizes:
                for seg in candidates:
                    if seg in used:
                        continue
                    off = seg.allocator.allocate_high(size) if high else seg.allocator.allocate(size)
                    if off is not None:
                        placed.append((seg.name, seg.base + off, size))
                        used.append(seg)
                        break
                else:
                    break
            if len(placed) == nshards:
                for seg in used:
                    candidates.remove(seg)
                return placed
            self._free(placed)
            nshards = nshards - 1 if nshards > 1 else 0
        return None

    def _allocate(self, client_id: str, nbytes: int, cfg: PutConfig,
                  high: bool = False) -> list[MemoryReplica]:
        client = self._clients.get(client_id)
        candidates = order_segments([s for s in self._segments.values()
                                     if s.name not in self._draining],
                                    self.config.allocation_strategy,
                                    cfg.preferred_segments, client.host_id if client else None,
                                    self._rng)
        # segments restored from the journal take data at once (their owners count as alive
        # until the grace runs out), after those whose owner is back: one may have died
        # while no master watched
        candidates.sort(key=lambda s: s.name not in cfg.preferred_segments
                        and not self._clients.get(s.client_id, _GONE).confirmed)
        if not candidates:
            raise StoreSegmentNotFound("no segment is mounted: start a client with a global segment")
        replicas: list[MemoryReplica] = []
        for i in range(cfg.replica_num):
            # stripe no wider than leaves a segment for each replica still to place (a
            # replica striped over every segment would leave none for the next); wider
            # only where that is the one way to place this replica at all
            room = len(candidates) - (cfg.replica_num - 1 - i)
            r = self._allocate_replica(nbytes, candidates, high, max(1, room))
            if r is None and room < len(candidates):
                r = self._allocate_replica(nbytes, candidates, high)
            if r is None:
                break
            replicas.append(r)
        if not replicas:
            raise NoAvailableSpace(f"no room for {nbytes} bytes in {len(self._segments)} segments")
        if len(replicas) < cfg.replica_num:
            log.warning("only %d of %d replicas placed for %d bytes", len(replicas),
                        cfg.replica_num, nbytes)
        return replicas

    def _capacity(self) -> tuple[int, int]:
        total = sum(s.nbytes for s in self._segments.values())
        used = sum(s.allocator.used for s in self._segments.values())
        return used, total

    def _evict(self, need_nbytes: int) -> int:
        """Free space by LRU (leased and in-flight objects are skipped; soft-pinned go last)."""
        used, total = self._capacity()
        target = max(need_nbytes, int(total * self.config.eviction_ratio))
        now = self._clock()
        freed = 0
        passes = [False, True] if self.config.allow_evict_soft_pinned_objects else [False]
        for allow_pinned in passes:
            victims = []  # chosen in LRU order first, then freed: no copy of the whole key list
            for key, meta in self._objects.items():
                if freed >= target:
                    break
                if (not meta.replicas or meta.pending is not None or meta.lease_until > now
                        or meta.hard_pinned or key in self._copies
                        or (meta.soft_pin_until > now and not allow_pinned)):
                    continue
                freed += sum(s[2] for r in meta.replicas for s in r)
                victims.append((key, meta))
            for key, meta in victims:
                for r in meta.replicas:
                    self._free(r)
                meta.replicas = []
                self.counters["evicted"] += 1
                if meta.disk_name is not None:
                    self.counters["offloaded_evictions"] += 1  # still readable from disk
                else:
                    del self._objects[key]
                self._note(key)
        return freed

    # -- puts ---------------------------------------------------------------------------
    def put_start(self, client_id: str, key: str, nbytes: int, cfg: PutConfig) -> list[MemoryReplica]:
        """Reserve replicas for ``key`` (invisible until put_end).

        Raises:
            InvalidKey, InvalidParams, ObjectAlreadyExists, NoAvailableSpace,
            StoreSegmentNotFound, ClientNotFound.
        """
        check_key(key)
        if not isinstance(nbytes, int) or not 0 < nbytes <= MAX_OBJECT_NBYTES:
            raise InvalidParams(f"object size must be in (0, {MAX_OBJECT_NBYTES}], got {nbytes!r}")
        if not 1 <= cfg.replica_num <= 16:
            raise InvalidParams(f"replica_num must be in [1, 16], got {cfg.replica_num}")
        pin_ttl_ms = cfg.pin_ttl_ms(self.config)
        with self._lock:
            self._client(client_id)
            now = self._clock()
            self._check_writable(key, cfg.upsert, now)
            replicas = self._place(client_id, nbytes, cfg)
            meta = self._objects.get(key)
            if meta is None:
                meta = self._objects[key] = ObjectMeta(nbytes)
            meta.pending, meta.pending_nbytes, meta.writer, meta.started = replicas, nbytes, client_id, now
            self._writing[key] = None
            meta.pending_pin_ttl_ms, meta.pending_hard_pin = pin_ttl_ms, cfg.with_hard_pin
            self._take_free_seq()
            return replicas

    def _check_writable(self, key: str, upsert: bool, now: float) -> None:
        """Raise ObjectAlreadyExists unless a put may write ``key`` now; a put of it that
        was abandoned (older than the discard timeout) is discarded first."""
        meta = self._objects.get(key)
        if meta is None:
            return
        if meta.pending is not None:
            if now - meta.started < self.config.put_start_discard_timeout_s:
                raise ObjectAlreadyExists(f"{key!r} is being written by another put")
            self._discard_pending(key, meta)
            meta = self._objects.get(key)
        if meta is not None and meta.complete and not upsert:
            raise ObjectAlreadyExists(f"{key!r} exists; use upsert to replace it")

    def _place(self, client_id: str, nbytes: int, cfg: PutConfig,
               high: bool = False) -> list[MemoryReplica]:
        """Replicas for a new object, evicting first above the high watermark or when
        nothing fits (``high``: see :meth:`_allocate_replica`)."""
        used, total = self._capacity()
        if total and (used + nbytes * cfg.replica_num) > total * self.config.eviction_high_watermark_ratio:
            self._evict(nbytes * cfg.replica_num)
        try:
            return self._allocate(client_id, nbytes, cfg, high)
        except NoAvailableSpace:
            self._evict(nbytes * cfg.replica_num)
            return self._allocate(client_id, nbytes, cfg, high)

    def put_end(self, client_id: str, key: str) -> None:
        """Make the written replicas visible; an upserted object's old replicas are freed."""
        with self._lock:
            meta = self._objects.get(key)
            if meta is None or meta.pending is None or meta.writer != client_id:
                raise ObjectNotFound(f"no put of {key!r} by {client_id!r} is in progress "
                                     f"(it may have been discarded or its segment lost)")
            replicas, meta.pending = meta.pending, None
            self._commit(key, meta, client_id, replicas, meta.pending_nbytes,
                         meta.pending_pin_ttl_ms, meta.pending_hard_pin)

    def _commit(self, key: str, meta: ObjectMeta, client_id: str, replicas: list[MemoryReplica],
                nbytes: int, pin_ttl_ms: int | None, hard_pin: bool) -> None:
        """Make ``replicas`` the object's; the ones they replace are freed after the lease."""
        self._cancel_copy(key)  # a copy of the replaced bytes must not land
        old = meta.replicas
        meta.replicas, meta.nbytes, meta.owner = replicas, nbytes, client_id
        meta.replica_num = len(replicas)
        if pin_ttl_ms is not None:
            meta.soft_pin_until = self._clock() + pin_ttl_ms / 1000 if pin_ttl_ms else 0.0
        meta.hard_pinned = hard_pin
        self._drop_disk(meta)
        self._free_after_lease(meta, old)
        self._objects.move_to_end(key)
        self.counters["puts"] += 1
        self._note(key)

    # -- one-round-trip puts of small objects ---------------------------------------------
    def reserve(self, client_id: str, nbytes: int, replica_num: int, count: int) -> list[tuple[int, list[MemoryReplica]]]:
        """Place up to ``count`` slots of ``nbytes`` x ``replica_num`` for ``client_id``'s
        next puts: ``(slot id, replicas)`` each. Fewer (or none) when the client's share
        of the pool (:data:`SLOT_SHARE`) is used up or no room is left.

        Raises:
            InvalidParams, ClientNotFound.
        """
        _check_slot_request(nbytes, replica_num, count)
        with self._lock:
            self._client(client_id)
            cfg = PutConfig(replica_num=replica_num)
            cap = min(MAX_CLIENT_SLOT_NBYTES, self._capacity()[1] // SLOT_SHARE)
            held = self._slot_nbytes.get(client_id, 0)
            out: list[tuple[int, list[MemoryReplica]]] = []
            now = self._clock()
            while len(out) < count and held + nbytes * replica_num <= cap:
                try:
                    replicas = self._place(client_id, nbytes, cfg, high=True)
                except (NoAvailableSpace, StoreSegmentNotFound):
                    break
                # a slot promises every replica, each whole on one segment (a slot that
                # lost part of itself with a segment would leave its client writing into
                # space handed out again)
                if len(replicas) < replica_num or any(len(r) > 1 for r in replicas):
                    for r in replicas:
                        self._free(r)
                    break
                rid = next(self._slot_ids)
                slot = self._slots[rid] = Slot(client_id, nbytes, replicas, now)
                held += slot.cost
                out.append((rid, replicas))
            if out:
                self._slot_nbytes[client_id] = held
                self._take_free_seq()
            return out

    def put_reserved(self, client_id: str, key: str, slot_id: int, cfg: PutConfig) -> None:
        """Make slot ``slot_id``, which ``client_id`` has written, the object ``key`` (as
        ``put_start`` + ``put_end``). The slot is used up either way.

        Raises:
            InvalidKey, InvalidParams, ObjectAlreadyExists, ObjectNotFound (no such slot
            of this client: expired, or its segment gone), UnavailableInCurrentStatus (its
            segment is draining).
        """
        with self._lock:
            slot = self._slots.get(slot_id)
            if slot is None or slot.client_id != client_id:
                raise ObjectNotFound(f"no slot {slot_id} of client {client_id!r} is reserved "
                                     f"(it expired, or its segment is gone)")
            self._drop_slot(slot_id, slot, free=False)
            try:
                check_key(key)
                pin_ttl_ms = cfg.pin_ttl_ms(self.config)
                if any(self._on(r, self._draining) for r in slot.replicas):
                    raise UnavailableInCurrentStatus(f"slot {slot_id} is on a draining segment")
                self._check_writable(key, cfg.upsert, self._clock())
                meta = self._objects.get(key)
            except BaseException:
                for r in slot.replicas:
                    self._free(r)
                raise
            if meta is None:
                meta = self._objects[key] = ObjectMeta(slot.nbytes)
            self._commit(key, meta, client_id, slot.replicas, slot.nbytes, pin_ttl_ms,
                         cfg.with_hard_pin)
            self.counters["reserved_puts"] += 1

    def _drop_slot(self, slot_id: int, slot: Slot, free: bool = True) -> None:
        del self._slots[slot_id]
        left = self._slot_nbytes[slot.client_id] - slot.cost
        if left:
            self._slot_nbytes[slot.client_id] = left
        else:
            del self._slot_nbytes[slot.client_id]
        if free:
            for r in slot.replicas:
                self._free(r)

    def _drop_slots(self, pred: Callable[[Slot], bool], client_may_write: bool = False) -> None:
        """Free the slots ``pred`` picks (shards on segments that are gone free nothing).
        ``client_may_write``: their client lives on and may still be writing into them, so
        their space is freed only once it can no longer use them (as an unused slot's)."""
        for rid, slot in [(rid, slot) for rid, slot in self._slots.items() if pred(slot)]:
            self._drop_slot(rid, slot, free=not client_may_write)
            if client_may_write:
                until = slot.made + self.config.put_start_discard_timeout_s
                self._deferred.extend((until, r) for r in slot.replicas)

    def put_revoke(self, client_id: str, key: str) -> None:
        with self._lock:
            meta = self._objects.get(key)
            if meta is None or meta.pending is None or meta.writer != client_id:
                raise ObjectNotFound(f"no put of {key!r} by {client_id!r} is in progress")
            self._discard_pending(key, meta)

    def _discard_pending(self, key: str, meta: ObjectMeta) -> None:
        for r in meta.pending or []:
            self._free(r)
        meta.pending = None
        if not meta.complete:
            del self._objects[key]

    def add_disk_replica(self, key: str) -> None:
        """Record that ``key``'s SSD-tier file (:func:`offload.relative_name` under
        ``root_fs_dir``) was written: the object survives eviction from memory.

        Raises:
            InvalidParams (offload disabled), InvalidKey, ObjectNotFound.
        """
        if not self.config.enable_offload:
            raise InvalidParams("the master was started without --enable_offload")
        check_key(key)
        with self._lock:
            meta = self._objects.get(key)
            if meta is None or not meta.complete:
                raise ObjectNotFound(f"{key!r} is not a complete object")
            meta.disk_name = relative_name(key)
            self._note(key)

    def _drop_disk(self, meta: ObjectMeta) -> None:
        if meta.disk_name is not None:
            self._disk_drops.append(meta.disk_name)
            meta.disk_name = None

    def take_disk_drops(self) -> list[str]:
        """Disk replica names no object refers to any more (each returned once): the caller
        deletes their files under ``root_fs_dir``, outside this service's lock."""
        if not self._disk_drops:  # the common case, without the lock
            return []
        with self._lock:
            drops, self._disk_drops = self._disk_drops, []
        return drops

    # -- reads --------------------------------------------------------------------------
    def get(self, key: str) -> tuple[int, list[MemoryReplica], str | None, float]:
        """Replicas of a complete object and a read lease.

        Returns:
            (nbytes, memory replicas, disk replica name or None, lease ttl in seconds).
        Raises:
            InvalidKey, ObjectNotFound, ReplicaNotReady.
        """
        code, info = self.get_many([key])[0]
        if code:
            raise store_error(code, info)
        return tuple(info)  # type: ignore[return-value]

    def get_many(self, keys: list[str]) -> list[list]:
        """:meth:`get` for many keys under one lock: ``[0, [nbytes, replicas, disk, ttl]]``
        or ``[code, message]`` per key (the RPC reply as is)."""
        ttl = self.config.default_kv_lease_ttl_ms / 1000
        out: list[list] = []
        with self._lock:
            until = self._clock() + ttl
            for key in keys:
                meta = self._objects.get(key) if isinstance(key, str) else None
                if meta is None or not meta.complete:
                    try:
                        check_key(key)
                        err: StoreError = (ReplicaNotReady(f"{key!r} is still being written")
                                           if meta is not None else ObjectNotFound(f"no object {key!r}"))
                    except InvalidKey as exc:
                        err = exc
                    out.append([err.code, str(err)])
                    continue
                meta.lease_until = max(meta.lease_until, until)
                meta.read_until = max(meta.read_until, until)
                self._objects.move_to_end(key)
                out.append([0, [meta.nbytes, meta.replicas, meta.disk_name, ttl]])
            self.counters["gets"] += len(keys)
        return out

    def exist(self, key: str) -> bool:
        """Whether a complete object is stored under ``key`` (an invalid key never is); one
        that is gets a read lease, as a get would (the original's ``ExistKey``)."""
        return self.exist_many([key])[0]

    def exist_many(self, keys: list[str], lease: bool = True) -> list[bool]:
        """:meth:`exist` for many keys under one lock; ``lease=False`` only looks."""
        with self._lock:
            until = self._clock() + self.config.default_kv_lease_ttl_ms / 1000
            out = []
            for key in keys:
                meta = self._objects.get(key) if isinstance(key, str) else None
                found = meta is not None and meta.complete
                if found and lease:
                    meta.lease_until = max(meta.lease_until, until)
                    meta.read_until = max(meta.read_until, until)
                out.append(found)
            return out

    def keys_with_suffix(self, suffix: str, limit: int) -> list[str]:
        """Up to ``limit`` keys of complete objects ending with ``suffix`` (any keys for
        ``""``; no lease): how a router finds the key layout its engines store a block
        hash under."""
        return self._keys_where(lambda key: key.endswith(suffix), limit)

    def keys_containing(self, part: str, limit: int) -> list[str]:
        """Up to ``limit`` keys of complete objects with ``part`` in them (no lease): a
        router's look for the layout of keys that go on after the hash (LMCache's)."""
        return self._keys_where(lambda key: part in key, limit)

    def _keys_where(self, match: Callable[[str], bool], limit: int) -> list[str]:
        """A scan of every key, done on a copy of the key list so that the lock is held
        only to copy it and to check the matches (with 300k objects: the scan takes
        about 130 ms, which other calls waited out while it held the lock)."""
        if not 1 <= limit <= MAX_LISTED_KEYS:
            raise InvalidParams(f"limit must be in 1..{MAX_LISTED_KEYS}")
        with self._lock:
            keys = list(self._objects)
        matches = [key for key in keys if match(key)]
        with self._lock:
            complete = [key for key in matches
                        if (meta := self._objects.get(key)) is not None and meta.complete]
        return complete[:limit]

    # -- removal ------------------------------------------------------------------------
    def remove(self, key: str, force: bool = False) -> None:
        """Remove an object. Raises InvalidKey, ObjectNotFound, or ObjectHasLease unless ``force``."""
        check_key(key)
        with self._lock:
            meta = self._objects.get(key)
            if meta is None or not meta.complete:
                raise ObjectNotFound(f"no object {key!r}")
            self._remove(key, meta, force)

    def _remove(self, key: str, meta: ObjectMeta, force: bool) -> None:
        # readers' leases refuse it; a copy's is kept for its source bytes (freed after it)
        if meta.read_until > self._clock() and not force:
            raise ObjectHasLease(f"{key!r} is being read (lease); retry or force")
        if meta.pending is not None:
            for r in meta.pending:
                self._free(r)
        self._cancel_copy(key)
        self._free_after_lease(meta, meta.replicas)
        self._drop_disk(meta)
        del self._objects[key]
        self.counters["removes"] += 1
        self._note(key)

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        """Remove complete objects whose key matches ``pattern`` (re.search); returns the count."""
        try:
            rx = re.compile(pattern)
        except re.error as exc:
            raise InvalidParams(f"bad regex {pattern!r}: {exc}") from None
        return self._remove_where(lambda k: rx.search(k) is not None, force)

    def remove_all(self, force: bool = False) -> int:
        return self._remove_where(lambda k: True, force)

    def _remove_where(self, pred: Callable[[str], bool], force: bool) -> int:
        n = 0
        with self._lock:
            for key in [k for k, m in self._objects.items() if m.complete and pred(k)]:
                try:
                    self._remove(key, self._objects[key], force)
                    n += 1
                except ObjectHasLease:
                    continue
        return n

    # -- copy/move tasks and replica clearing -------------------------------------------
    def _check_target(self, name: str) -> MountedSegment:
        seg = self._segments.get(name)
        if seg is None:
            raise InvalidParams(f"segment {name!r} is not mounted")
        if name in self._draining:
            raise UnavailableInCurrentStatus(f"segment {name!r} is being drained")
        return seg

    def _complete(self, key: str) -> ObjectMeta:
        check_key(key)
        meta = self._objects.get(key)
        if meta is None or not meta.replicas:
            raise ObjectNotFound(f"no object {key!r} in memory")
        return meta

    def _owner_of(self, segment: str) -> str:
        return self._segments[segment].client_id

    def create_copy_task(self, key: str, targets: list[str]) -> TaskId:
        """Queue a copy of ``key`` to each of ``targets`` (run by the client owning a source
        replica). Raises InvalidParams (no or unmounted targets), ObjectNotFound,
        UnavailableInCurrentStatus (a draining target)."""
        with self._lock:
            if not targets:
                raise InvalidParams("a copy needs at least one target segment")
            meta = self._complete(key)
            for t in targets:
                self._check_target(t)
            sources = sorted({s[0] for r in meta.replicas for s in r})
            source = self._rng.choice(sources)
            return self.tasks.submit(COPY, key, source, list(dict.fromkeys(targets)),
                                     self._owner_of(source))

    def create_move_task(self, key: str, source: str, target: str) -> TaskId:
        """Queue a move of ``key``'s replica on ``source`` to ``target`` (run by ``source``'s
        client). Raises ObjectNotFound, InvalidParams (same or unknown segments),
        UnavailableInCurrentStatus."""
        with self._lock:
            meta = self._complete(key)
            if source == target:
                raise InvalidParams("a move needs different source and target segments")
            self._check_target(target)
            if not any(s[0] == source for r in meta.replicas for s in r):
                raise InvalidParams(f"{key!r} has no replica on segment {source!r}")
            return self.tasks.submit(MOVE, key, source, [target], self._owner_of(source))

    def replica_start(self, client_id: str, key: str, source: str, targets: list[str],
                      move: bool) -> tuple[int, MemoryReplica, list[MemoryReplica]]:
        """Reserve a replica of ``key`` on each target that has none yet, for ``client_id``
        to fill from its replica on ``source``; the object is leased meanwhile. A copy whose
        replica_end has not come within ``put_start_discard_timeout_s`` is cancelled.

        Returns:
            (nbytes, source replica, new replicas in the order of the targets that need one).
        Raises:
            ObjectNotFound, InvalidParams, ObjectAlreadyExists (a copy of it is running, or
            a cancelled one of this client is still finishing), NoAvailableSpace,
            UnavailableInCurrentStatus.
        """
        with self._lock:
            meta = self._complete(key)
            if key in self._copies or any(k == key and cp.client_id == client_id
                                          for k, cp in self._cancelled):
                raise ObjectAlreadyExists(f"another copy of {key!r} is running")
            src = next((r for r in meta.replicas if any(s[0] == source for s in r)), None)
            if src is None:
                raise InvalidParams(f"{key!r} has no replica on segment {source!r}")
            held = {r[0][0] for r in meta.replicas if len(r) == 1}
            new: list[MemoryReplica] = []
            try:
                for t in dict.fromkeys(targets):
                    seg = self._check_target(t)
                    if t in held:
                        continue
                    r = self._allocate_replica(meta.nbytes, [seg])
                    if r is None:
                        raise NoAvailableSpace(f"no room for {meta.nbytes} bytes of {key!r} on {t!r}")
                    new.append(r)
            except StoreError:
                for r in new:
                    self._free(r)
                raise
            deadline = self._clock() + self.config.put_start_discard_timeout_s
            self._copies[key] = ReplicaCopy(client_id, src, new, source if move else None, deadline)
            meta.lease_until = max(meta.lease_until, deadline)
            self._take_free_seq()
            return meta.nbytes, src, new

    def replica_end(self, client_id: str, key: str, ok: bool) -> None:
        """Publish (``ok``) or drop the replicas ``replica_start`` reserved; a move also
        drops the source replica (after the readers' leases). Raises ObjectNotFound when
        the copy was cancelled (the object was removed or replaced, a segment went away,
        its task failed or its deadline passed): its replicas are freed, never published."""
        with self._lock:
            cp = self._copies.get(key)
            if cp is None or cp.client_id != client_id:
                gone = next((c for k, c in self._cancelled if k == key and c.client_id == client_id),
                            None)
                if gone is not None:
                    self._cancelled = [(k, c) for k, c in self._cancelled if c is not gone]
                    for r in gone.new:
                        self._free(r)
                raise ObjectNotFound(f"no copy of {key!r} by {client_id!r} is running (cancelled?)")
            del self._copies[key]
            meta = self._objects[key]
            # the copy's own lease ends; readers' (and cancelled copiers') leases stay
            meta.lease_until = max([meta.read_until, self._clock()]
                                   + [c.deadline for k, c in self._cancelled if k == key])
            if not ok:
                for r in cp.new:
                    self._free(r)
                return
            meta.replicas.extend(cp.new)
            if cp.drop_segment is not None:
                gone = [r for r in meta.replicas if any(s[0] == cp.drop_segment for s in r)]
                meta.replicas = [r for r in meta.replicas if r not in gone]
                self._free_after_lease(meta, gone)
            else:  # a copy adds replicas the object keeps (a repair restores lost ones)
                if self.repairs.running_for(key, client_id):
                    self.repairs.recreated += len(cp.new)
                meta.replica_num = max(meta.replica_num, len(meta.replicas))
            self._note(key)

    def _cancel_copy(self, key: str) -> None:
        """Stop a running copy of ``key``: it is never published. Its new replicas stay
        reserved until its replica_end or deadline, since its writer may still be filling them."""
        cp = self._copies.pop(key, None)
        if cp is not None:
            self._cancelled.append((key, cp))

    def _cancel_copies(self, now: float, expired: set[tuple[str, str]], dead: set[str]) -> None:
        """Cancel copies past their deadline, by a client in ``dead`` or of an
        ``expired`` (client id, key) task; free cancelled ones past their deadline."""
        for key, cp in list(self._copies.items()):
            if cp.deadline <= now or cp.client_id in dead or (cp.client_id, key) in expired:
                log.warning("cancelling the copy of %r by %s", key, cp.client_id)
                self._cancel_copy(key)
        keep = []
        for key, cp in self._cancelled:
            if cp.deadline > now:
                keep.append((key, cp))
            else:
                for r in cp.new:
                    self._free(r)
        self._cancelled = keep

    def complete_task(self, client_id: str, task_id: TaskId, ok: bool, message: str) -> None:
        """Record the outcome ``client_id`` reports for its task; a failed one's copy is
        cancelled. Raises TaskNotFound, InvalidParams (not that client's running task)."""
        with self._lock:
            key = self.tasks.complete(client_id, task_id, ok, message)
            cp = self._copies.get(key)
            if not ok and cp is not None and cp.client_id == client_id:
                self._cancel_copy(key)
        # a drain's next move and the next repair start now, not at the next reaper pass
        self.advance_drains()
        self.advance_repairs()

    def set_draining(self, segments: list[str], draining: bool) -> None:
        """Stop (or resume) placing new replicas on ``segments``. Raises StoreSegmentNotFound."""
        with self._lock:
            missing = [n for n in segments if n not in self._segments]
            if missing:
                raise StoreSegmentNotFound(f"segments {missing} are not mounted")
            if draining:
                self._draining.update(segments)
            else:
                self._draining.difference_update(segments)

    # -- drain jobs: empty segments before they go --------------------------------------
    def create_drain_job(self, segments: list[str], targets: list[str], max_concurrency: int) -> str:
        """Stop placing data on ``segments`` and move every replica there to ``targets`` (any
        other segment when empty), ``max_concurrency`` objects at a time; returns the job id.

        Raises InvalidParams, StoreSegmentNotFound, UnavailableInCurrentStatus (a segment
        is being drained already).
        """
        if not segments or len(set(segments)) != len(segments) or max_concurrency <= 0:
            raise InvalidParams("a drain needs distinct segments and max_concurrency > 0")
        with self._lock:
            for name in segments:
                if name not in self._segments:
                    raise StoreSegmentNotFound(f"segment {name!r} is not mounted")
                if name in self._draining:
                    raise UnavailableInCurrentStatus(f"segment {name!r} is drained already")
            for name in targets:
                if name in segments or name not in self._segments:
                    raise InvalidParams(f"target {name!r} is not a mounted segment outside the drain")
                self._check_target(name)
            job = DrainJob(str(uuid.uuid4()), list(segments), list(targets), max_concurrency)
            self._drains[job.id] = job
            self._draining.update(segments)
        log.info("drain job %s: moving everything off %s", job.id, segments)
        self.advance_drains()
        return job.id

    def query_drain_job(self, job_id: str) -> dict:
        with self._lock:
            return self._job(job_id).to_wire()

    def cancel_drain_job(self, job_id: str) -> None:
        """Stop a drain (moves under way finish); its segments take new data again."""
        with self._lock:
            job = self._job(job_id)
            if job.finished:
                raise UnavailableInCurrentStatus(f"drain job {job_id} is finished already")
            job.status, job.updated_ms = JOB_CANCELED, int(time.time() * 1000)
            self._draining.difference_update(job.segments)
            self._prune_drains()

    def _job(self, job_id: str) -> DrainJob:
        job = self._drains.get(job_id)
        if job is None:
            raise JobNotFound(f"no drain job {job_id!r}")
        return job

    def segment_status(self, name: str) -> str:
        """OK, DRAINING (no new data) or DRAINED (and none left). Raises StoreSegmentNotFound."""
        with self._lock:
            if name not in self._segments:
                raise StoreSegmentNotFound(f"segment {name!r} is not mounted")
            return self._segment_status(name)

    def _segment_status(self, name: str) -> str:
        return "DRAINED" if name in self._drained else "DRAINING" if name in self._draining else "OK"

    def advance_drains(self) -> None:
        """Account finished moves of running drain jobs, start the next ones, finish jobs."""
        with self._lock:
            for job in self._drains.values():
                if not job.finished:
                    self._advance(job)
            self._prune_drains()

    def _prune_drains(self) -> None:
        """Forget the oldest finished drain jobs beyond ``max_finished_drains``."""
        finished = [i for i, job in self._drains.items() if job.finished]
        for job_id in finished[:max(0, len(finished) - self.max_finished_drains)]:
            del self._drains[job_id]

    def _advance(self, job: DrainJob) -> None:
        for tid, key in list(job.active.items()):
            status = self.tasks.status(tid)
            if status == SUCCESS:
                job.succeeded_units += 1
            elif status == FAILED or status is None:
                job.failed_units += 1
                job.failed_keys.add(key)
            else:
                continue
            del job.active[tid]
        names = set(job.segments)
        busy = set(job.active.values())
        left = False
        for key, meta in self._objects.items():
            on = [s[0] for r in meta.replicas for s in r if s[0] in names]
            if meta.pending is not None and any(self._on(r, names) for r in meta.pending):
                left = True
            if not on or key in job.failed_keys:
                continue
            left = True
            if key in busy or key in self._copies or len(job.active) >= job.max_concurrency:
                continue
            target = self._drain_target(meta, job)
            if target is None:
                log.warning("drain %s: no segment has room for %r (%d bytes)", job.id, key, meta.nbytes)
                job.failed_units += 1
                job.failed_keys.add(key)
                continue
            try:
                job.active[self.tasks.submit(MOVE, key, on[0], [target], self._owner_of(on[0]))] = key
            except TaskLimitExceeded:
                break  # the task queue is full: the next pass submits the rest
        job.updated_ms = int(time.time() * 1000)
        if not left and not job.active:
            job.status = JOB_FAILED if job.failed_units else JOB_SUCCEEDED
            if job.status == JOB_SUCCEEDED:
                self._drained.update(names & set(self._segments))
            log.info("drain job %s %s: %d moved, %d failed", job.id,
                     "succeeded" if job.status == JOB_SUCCEEDED else "failed",
                     job.succeeded_units, job.failed_units)

    def _drain_target(self, meta: ObjectMeta, job: DrainJob) -> str | None:
        """A target already holding ``meta`` whole, else the one with the largest free run."""
        pool = job.targets or [n for n in self._segments if n not in self._draining]
        held = {r[0][0] for r in meta.replicas if len(r) == 1}
        for name in pool:
            if name in held and name not in self._draining:
                return name
        room = [(self._segments[n].allocator.largest_free, n) for n in pool
                if n in self._segments and n not in self._draining]
        best = max(room, default=None)
        return best[1] if best and best[0] >= meta.nbytes else None

    # -- replica repair (repair.py): re-create replicas lost with a dead client -------------
    def advance_repairs(self) -> None:
        """Account finished repair copies, then start copy tasks for waiting objects."""
        rq = self.repairs
        if not rq.enabled:
            return
        with self._lock:
            now = self._clock()
            whole = 0
            for tid, run in rq.running():
                key, status = run.key, self.tasks.status(tid)
                if status == SUCCESS:
                    rq.succeeded(tid)
                    meta = self._objects.get(key)
                    if meta is not None and 0 < len(meta.replicas) < meta.replica_num:
                        rq.add(key)  # some targets had no room, or another holder died since
                    else:
                        whole += 1
                elif status == FAILED or status is None:
                    log.warning("replica repair of %r: copy task %s failed: %s", key, tid,
                                self.tasks.message(tid))
                    rq.failed_task(tid, now)
            started, blocked = self._start_repairs(now) if rq.has_room else (0, 0)
        if whole or started:
            log.info("replica repair: %d objects whole again, %d copies started; %s", whole,
                     started, rq.stats())
        if blocked:
            log.warning("replica repair: no live segment has room for new replicas of %d more "
                        "objects (they stay readable from their surviving replicas; %d wait "
                        "for room)", blocked, rq.stats()["repairs_blocked"])

    def _start_repairs(self, now: float) -> tuple[int, int]:
        """Start copy tasks for waiting objects while fewer than ``max_running`` run, never
        filling the pool past the eviction watermark. Returns (started, newly blocked)."""
        rq = self.repairs
        due = rq.due(now)
        if not due:
            return 0, 0
        used, total = self._capacity()
        room = int(total * self.config.eviction_high_watermark_ratio) - used
        free = {s.name: s.allocator.largest_free for s in self._segments.values()
                if s.name not in self._draining and self._clients.get(s.client_id, _GONE).confirmed}
        for _, run in rq.running():
            if run.key not in self._copies:   # handed out, its space not reserved yet
                room -= run.nbytes * len(run.targets)
                for name in run.targets:
                    free[name] = free.get(name, 0) - run.nbytes
        started = blocked = 0
        for key in due:
            meta = self._objects.get(key)
            if meta is None or not meta.replicas or len(meta.replicas) >= meta.replica_num:
                rq.drop(key)
                continue
            if not rq.has_room:
                break
            source = self._repair_source(meta)
            if meta.pending is not None or key in self._copies or source is None:
                rq.later(key)
                continue
            holding = {s[0] for r in meta.replicas for s in r}
            fits = sorted((n for n, f in free.items() if f >= meta.nbytes and n not in holding),
                          key=free.__getitem__, reverse=True)
            targets = fits[:max(0, min(meta.replica_num - len(meta.replicas), room // meta.nbytes))]
            if not targets:
                blocked += rq.block(key)
                continue
            try:
                tid = self.tasks.submit(COPY, key, source, targets, self._owner_of(source))
            except TaskLimitExceeded:
                rq.later(key)
                break
            rq.start(key, tid, self._owner_of(source), targets, meta.nbytes)
            for name in targets:  # an estimate until the copy reserves its space
                free[name] -= meta.nbytes
            room -= meta.nbytes * len(targets)
            started += 1
        return started, blocked

    def _repair_source(self, meta: ObjectMeta) -> str | None:
        """A segment of a replica whose every shard's owner is heard from (one whole on one
        segment preferred), None when there is none."""
        live = [r for r in meta.replicas
                if all(self._clients.get(self._segments[s[0]].client_id, _GONE).confirmed
                       for s in r)]
        return min(live, key=len)[0][0] if live else None

    def batch_replica_clear(self, client_id: str, keys: list[str], segment: str = "") -> list[str]:
        """Drop ``client_id``'s objects among ``keys`` (``segment`` given: only their replicas
        there). Leased, in-flight or foreign objects are skipped; returns the keys cleared."""
        cleared = []
        with self._lock:
            now = self._clock()
            for key in keys:
                meta = self._objects.get(key) if isinstance(key, str) else None
                if (meta is None or not meta.complete or meta.owner != client_id
                        or meta.lease_until > now or meta.pending is not None
                        or key in self._copies):
                    continue
                if not segment:
                    self._remove(key, meta, force=False)
                    cleared.append(key)
                    continue
                gone = [r for r in meta.replicas if any(s[0] == segment for s in r)]
                if not gone:
                    continue
                meta.replicas = [r for r in meta.replicas if r not in gone]
                meta.replica_num = min(meta.replica_num, len(meta.replicas))
                for r in gone:
                    self._free(r)
                if not meta.complete:
                    del self._objects[key]
                self._note(key)
                cleared.append(key)
        return cleared

    # -- housekeeping -------------------------------------------------------------------
    def reap(self) -> None:
        """Expire silent clients and tasks, cancel copies that did not end in time, discard
        abandoned puts, free space whose lease ended, advance drains and repairs."""
        with self._lock:
            now = self._clock()
            ttl = self.config.client_ttl_s
            grace = self.config.restored_client_grace_s or 3 * ttl
            dead = [c for c in self._clients.values()
                    if now - c.last_seen > (ttl if c.confirmed else grace)]
            self._cancel_copies(now, set(self.tasks.expire()), {c.client_id for c in dead})
            for c in dead:
                self.tasks.fail_client(c.client_id, "its client stopped sending heartbeats")
                if c.confirmed:
                    log.warning("client %s missed heartbeats for %.1f s: dropping its segments "
                                "%s", c.client_id, now - c.last_seen, sorted(c.segments))
                else:
                    log.warning("client %s did not come back within %.1f s of the recovery: "
                                "dropping its segments %s", c.client_id, now - c.last_seen,
                                sorted(c.segments))
                self._drop_slots(lambda slot, cid=c.client_id: slot.client_id == cid)
                self._drop_segments(set(c.segments), repair=True)
                del self._clients[c.client_id]
                self.counters["expired_clients"] += 1
            for key in list(self._writing):
                meta = self._objects.get(key)
                if meta is not None and meta.pending is not None:
                    if now - meta.started <= self.config.put_start_discard_timeout_s:
                        continue
                    log.warning("discarding put of %r abandoned by %s", key, meta.writer)
                    self._discard_pending(key, meta)
                    self.counters["discarded_puts"] += 1
                del self._writing[key]
            while self._slots:
                rid, slot = next(iter(self._slots.items()))
                if now - slot.made <= self.config.put_start_discard_timeout_s:
                    break
                self._drop_slot(rid, slot)
            keep = []
            for until, r in self._deferred:
                if until > now:
                    keep.append((until, r))
                else:
                    self._free(r)
            self._deferred = keep
        self.advance_drains()
        self.advance_repairs()

    # -- admin queries (admin.py): they grant no lease and leave the LRU order alone ----
    def describe(self, keys: list[str]) -> list[dict | None]:
        """Each key's readable copies, None where no complete object has that key:
        ``nbytes``, ``replicas`` (each a list of ``(segment, address, nbytes)`` shards)
        and ``disk_name`` (its SSD-tier file, or None)."""
        with self._lock:
            out: list[dict | None] = []
            for key in keys:
                meta = self._objects.get(key)
                out.append(None if meta is None or not meta.complete else {
                    "nbytes": meta.nbytes, "replicas": [list(r) for r in meta.replicas],
                    "disk_name": meta.disk_name})
            return out

    def all_keys(self) -> list[str]:
        """The keys of every complete object, least recently used first."""
        with self._lock:
            return [key for key, meta in self._objects.items() if meta.complete]

    def segments_detail(self) -> list[dict]:
        """Each mounted segment: name, owner, range, bytes in use and drain status."""
        with self._lock:
            return [{"name": seg.name, "client_id": seg.client_id, "host_id": seg.host_id,
                     "base": seg.base, "nbytes": seg.nbytes, "used": seg.allocator.used,
                     "status": self._segment_status(seg.name)}
                    for seg in self._segments.values()]

    def stats(self) -> dict:
        """Counters and sizes: ``used_bytes`` is held by objects (and puts in flight),
        ``reserved_bytes`` by slots placed ahead for small puts."""
        with self._lock:
            used, total = self._capacity()
            reserved = sum(self._slot_nbytes.values())
            writing = (self._objects.get(k) for k in self._writing)
            return {"objects": len(self._objects) - sum(1 for m in writing
                                                        if m is not None and not m.complete),
                    "segments": len(self._segments), "clients": len(self._clients),
                    "used_bytes": used - reserved, "capacity_bytes": total,
                    "reserved_slots": len(self._slots), "reserved_bytes": reserved,
                    **self.counters,
                    **self.repairs.stats()}
