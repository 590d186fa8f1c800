"""StoreClient: contributes a memory segment to the pool and puts/gets objects.

Bytes go straight between this process and the segments holding the replicas, through
the transfer engine (shared memory for same-host segments, tcp otherwise); the master
only answers where. Thread-safe: calls may come from many threads; a background thread
sends heartbeats, and re-registers (remounting the segment) when the master forgot us
or, with HA, when a new leader took over. One thread at a time does that failover, with
no lock held while it waits; the other threads whose calls failed share its outcome.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import uuid
from collections import OrderedDict, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

from ..config import EngineConfig, apply_protocol
from ..errors import (BufferTooSmall, ClientNotFound, InvalidArgument, InvalidKey, InvalidParams,
                      LeaseExpired, MooncakeError, NotSupported, ObjectNotFound, RpcFailed,
                      RpcTimeout, SegmentAlreadyExists, StoreError, StoreTransferFailed,
                      UnavailableInCurrentStatus, store_error)
from ..transfer import OpCode, TransferEngine, cuda, memory
from ..transfer.topology import host_id
from . import offload
from .limits import MAX_SLOT_NBYTES, check_key
from .rpc import RpcClient, split_address
from .tasks import run_task

log = logging.getLogger(__name__)

_SAME_TERM_RETRY_S = 2.0
"""After losing an HA master, how long a client waits for a new term before it tries the
failed term's master once more (a connection may have broken under a live leader)."""


@dataclass
class ReplicateConfig:
    """Placement of one put (the original's ``ReplicateConfig``, snake_case here)."""

    replica_num: int = 1
    preferred_segments: list[str] = field(default_factory=list)
    with_soft_pin: bool = False
    soft_pin_action: str = "preserve"     # "preserve" | "enable" | "disable" (master.PutConfig)
    soft_pin_ttl_ms: int | None = None
    with_hard_pin: bool = False

    def to_wire(self, upsert: bool) -> dict:
        return {"replica_num": self.replica_num, "preferred_segments": list(self.preferred_segments),
                "with_soft_pin": self.with_soft_pin, "upsert": upsert,
                "soft_pin_action": self.soft_pin_action, "soft_pin_ttl_ms": self.soft_pin_ttl_ms,
                "with_hard_pin": self.with_hard_pin}


def _pair(local: Sequence[tuple[int, int]], shards: Sequence[Sequence]) -> list[tuple[int, str, int, int]]:
    """Match local pieces against a replica's shards: ``(local, segment, remote, nbytes)`` runs.

    The object's bytes are laid out in order over both lists; a run ends wherever a piece
    or a shard does. Local room beyond the object (a larger buffer) is left untouched.
    """
    if len(local) == 1 and len(shards) == 1:  # the common case: one buffer, one shard
        seg, remote, n = shards[0]
        return [(local[0][0], seg, remote, n)]
    runs = []
    li, loff = 0, 0
    for seg, remote, n in shards:
        soff = 0
        while soff < n:
            address, room = local[li]
            take = min(room - loff, n - soff)
            if take > 0:
                runs.append((address + loff, seg, remote + soff, take))
            loff += take
            soff += take
            if loff == room:
                li, loff = li + 1, 0
    return runs


def _window(shards: Sequence[Sequence], offset: int, nbytes: int) -> list[tuple[str, int, int]]:
    """The ``(segment, address, nbytes)`` runs of a replica's shards that hold the object's
    bytes ``offset..offset+nbytes``."""
    runs = []
    for seg, remote, n in shards:
        if nbytes <= 0:
            break
        if offset >= n:
            offset -= n
            continue
        take = min(n - offset, nbytes)
        runs.append((seg, remote + offset, take))
        offset, nbytes = 0, nbytes - take
    return runs


@dataclass(frozen=True)
class Located:
    """Objects as :meth:`StoreClient.locate` found them, read-leased from ``since``
    (``time.monotonic()``): per key ``(nbytes, memory replicas in the order to try, disk
    replica name or None)``, or the key's error."""

    keys: list[str]
    found: list[tuple[int, list, str | None] | StoreError]
    since: float


@dataclass(eq=False)
class _Failover:
    """One failover in progress: the threads whose calls failed meanwhile wait on ``done``."""

    done: threading.Event = field(default_factory=threading.Event)
    error: MooncakeError | None = None


class DerivedForms:
    """The calls built on a client's batch primitives (``batch_put``, ``batch_put_parts``,
    ``batch_put_from_parts``, ``batch_get``, ``batch_get_into``): the single-key forms and
    ``batch_put_from``. Shared by :class:`StoreClient` and the dummy client of
    ``store.local``."""

    def batch_put_from(self, keys: Sequence[str], addresses: Sequence[int], sizes: Sequence[int],
                       config: ReplicateConfig | None = None,
                       upsert: bool = False) -> list[StoreError | None]:
        """Put objects from registered memory; returns a per-key error or None."""
        if not len(keys) == len(addresses) == len(sizes):
            raise InvalidParams("keys, addresses and sizes differ in length")
        return self.batch_put_from_parts(keys, [[(a, n)] for a, n in zip(addresses, sizes)],
                                         config, upsert)

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> None:
        """Store ``value`` (any buffer) under ``key``; an existing key keeps its object
        (ObjectAlreadyExists). Raises NoAvailableSpace, ..."""
        self._raise(self.batch_put([key], [value], config)[0])

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> None:
        """Store ``value``, replacing a previous object under ``key``."""
        self._raise(self.batch_put([key], [value], config, upsert=True)[0])

    def put_from(self, key: str, address: int, nbytes: int, config: ReplicateConfig | None = None,
                 upsert: bool = False) -> None:
        """Store ``nbytes`` at a registered ``address`` under ``key``."""
        self._raise(self.batch_put_from([key], [address], [nbytes], config, upsert)[0])

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None,
                  upsert: bool = False) -> None:
        """Store the concatenation of ``parts`` as one object."""
        self._raise(self.batch_put_parts([key], [parts], config, upsert)[0])

    def get(self, key: str) -> bytes:
        """The object's bytes. Raises ObjectNotFound, StoreTransferFailed, ..."""
        return self._value(self.batch_get([key])[0])

    def get_into(self, key: str, address: int, nbytes: int) -> int:
        """Read the object into registered memory; returns its size."""
        return self._value(self.batch_get_into([key], [address], [nbytes])[0])

    @staticmethod
    def _raise(err: StoreError | None) -> None:
        if err is not None:
            raise err

    @staticmethod
    def _value(out: Any) -> Any:
        if isinstance(out, Exception):
            raise out
        return out


SMALL_PUT_NBYTES = 64 << 10
"""A put whose values come to at most this many bytes copies them into a registered
scratch buffer instead of registering each value (5 us for a registration and its removal,
0.14 us to copy 4 KiB, measured here)."""


def _valid_key(key: object) -> bool:
    """Whether the master accepts ``key`` (:func:`limits.check_key`)."""
    try:
        check_key(key)
    except InvalidKey:
        return False
    return True


def _small_values(values: Sequence[Any]) -> list[memoryview] | None:
    """Byte views of ``values`` when they are contiguous host buffers of at most
    :data:`SMALL_PUT_NBYTES` in all, else None."""
    views, total = [], 0
    for v in values:
        try:
            view = memoryview(v).cast("B")
        except (TypeError, ValueError):   # no buffer protocol, or not contiguous
            return None
        total += view.nbytes
        if total > SMALL_PUT_NBYTES:
            return None
        views.append(view)
    return views


class _Scratch:
    """Registered buffers of :data:`SMALL_PUT_NBYTES`, each lent to one call at a time."""

    def __init__(self, engine: TransferEngine) -> None:
        self._engine = engine
        self._free: list[tuple[bytearray, Any]] = []
        self._lock = threading.Lock()

    def take(self) -> tuple[bytearray, Any]:
        with self._lock:
            if self._free:
                return self._free.pop()
        buf = bytearray(SMALL_PUT_NBYTES)
        return buf, self._engine.register(buf, private=True)

    def give(self, item: tuple[bytearray, Any], reuse: bool = True) -> None:
        if reuse:
            with self._lock:
                self._free.append(item)
        else:   # waits for slices still using it
            self._engine.unregister(item[1])

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for _, region in free:
            self._engine.unregister(region)


SLOT_POOL = 16
"""Reserved slots a client keeps per (object size, replica count) for puts of one master
round trip (:meth:`StoreClient._put_reserved`); batches of more keys take two."""
SLOT_POOL_NBYTES = 1 << 20
"""... and at most this many bytes of them per class."""
SLOT_CLASSES = 4
"""Classes with slots at once (the least recently used one's slots are left to expire)."""
SLOT_RETRY_S = 5.0
"""After the master granted no slot of a size (no room, the client's share used up, fewer
segments than replicas), puts of that size go the two-trip way this long without asking."""
SLOT_FRESH_S = 0.5
"""A slot is written only within this long of the master's last answer. Slots are not
journaled: a master that died took them along, and the one that replaces it may hand
the same space out again, so a client writes into them only while its master is surely
the one that placed them (and drops them all when it re-registers)."""


def _slot_target(nbytes: int, replica_num: int) -> int:
    return max(1, min(SLOT_POOL, SLOT_POOL_NBYTES // (nbytes * replica_num)))


def _allocate_segment(engine: TransferEngine, nbytes: int, location: str) -> Any:
    """The memory a client contributes (``address``, ``nbytes``): the engine's memfd-backed
    host memory, or a registered :class:`cuda.DeviceBuffer`."""
    if location in ("cpu", "*", ""):
        return engine.allocate(nbytes)
    kind, _, index = location.partition(":")
    if kind != "cuda" or not index.isdigit():
        raise InvalidParams(f"segment_location {location!r}: 'cpu' or 'cuda:N'")
    if not cuda.available():
        raise InvalidParams(f"a segment on {location} needs CUDA, and {cuda.why_unavailable()}")
    memory_ = cuda.DeviceBuffer(nbytes, int(index))
    try:
        engine.register_address(memory_.address, nbytes, location)
    except BaseException:
        memory_.close()
        raise
    return memory_


class StoreClient(DerivedForms):
    """One client of a Mooncake Store cluster.

    Args:
        master_address: ``host:port`` of the master, or ``etcd://h:p[;h:p]`` to follow the
            leader of an HA cluster (``cluster_id``).
        local_hostname, metadata_server, protocol: for the transfer engine (ignored when
            ``engine`` is given). protocol "tcp" still uses shared memory for same-host peers
            but never rdma, as the original's; "rdma" adds the rdma transport where this
            host has an RDMA device (tcp stays its fallback).
        global_segment_size: bytes this client contributes to the pool (0: none).
        enable_ssd_offload, ssd_offload_path: also keep every object written here in a file
            under ``ssd_offload_path`` (the SSD tier; the master must run with
            ``--enable_offload`` and ``--root_fs_dir`` naming the same directory, or a mount
            of the same shared filesystem). Disk replicas are read under
            ``ssd_offload_path`` too, or, without one, under the master's ``root_fs_dir``.
        failover_timeout_s: how long a call waits for a new leader (HA) before failing.
        segment_location: where the contributed memory lives: ``"cpu"`` (memfd-backed
            host memory) or ``"cuda:N"`` (device memory of GPU N, allocated here; peers
            reach it through cuda_ipc on this host and through our tcp server, which
            stages it, from other hosts).

    Raises:
        RpcFailed (master unreachable), InvalidParams (also a GPU segment where CUDA does
        not work, with the reason).
    """

    def __init__(self, master_address: str, *, local_hostname: str = "127.0.0.1",
                 metadata_server: str = "P2PHANDSHAKE", global_segment_size: int = 64 << 20,
                 protocol: str = "tcp", engine: TransferEngine | None = None,
                 enable_ssd_offload: bool = False, ssd_offload_path: str = "",
                 cluster_id: str = "mooncake", rpc_timeout_s: float = 10.0,
                 transfer_timeout_s: float = 30.0, failover_timeout_s: float = 30.0,
                 segment_location: str = "cpu") -> None:
        if protocol not in ("tcp", "shm", "rdma"):
            raise NotSupported(f"protocol {protocol!r} is not available here (tcp, shm, rdma)")
        if global_segment_size < 0:
            raise InvalidParams("global_segment_size must be >= 0")
        if enable_ssd_offload and not ssd_offload_path:
            raise InvalidParams("enable_ssd_offload needs ssd_offload_path")
        self.client_id = uuid.uuid4().hex
        self._host_id = host_id()
        self._rpc_timeout_s = rpc_timeout_s
        self._transfer_timeout_s = transfer_timeout_s
        self._failover_timeout_s = failover_timeout_s
        self._ha: tuple[str, str] | None = None
        self._term = 0   # HA: the leader term of the master behind self._rpc
        if master_address.startswith("etcd://"):
            from .ha import find_leader, wait_for_leader

            self._ha = (master_address[len("etcd://"):], cluster_id)
            leader = find_leader(*self._ha) or wait_for_leader(*self._ha, timeout_s=rpc_timeout_s)
            master_address, self._term = leader.address, leader.term
        self._rpc = RpcClient(*split_address(master_address), timeout_s=rpc_timeout_s)
        self._rpc_lock = threading.Lock()
        self._failover_run: _Failover | None = None   # guarded by _rpc_lock
        # reserved slots per (nbytes, replica_num): [(slot id, replicas, usable until)]
        self._slots: OrderedDict[tuple[int, int], list[tuple[int, list, float]]] = OrderedDict()
        # sizes put lately -> when to ask for slots of them again (0: now)
        self._seen_sizes: OrderedDict[tuple[int, int], float] = OrderedDict()
        self._slots_lock = threading.Lock()
        self._epoch = 0            # registrations since start: a slot is of the epoch it came in
        self._answered = 0.0       # monotonic time of the master's last answer
        self._owns_engine = engine is None
        self._offload_dir = ssd_offload_path if enable_ssd_offload else None
        self._ssd_path = ssd_offload_path
        self._master_root = ""
        self._offloader = ThreadPoolExecutor(1, thread_name_prefix="mc-offload") \
            if self._offload_dir else None
        self._local_segments: dict[str, bool] = {}
        self._closed = False
        self._refusing = False   # close() drained its background work: calls are refused
        self._stop = threading.Event()
        self._segment = None
        self._task_runner: ThreadPoolExecutor | None = None   # copy/move tasks from the master
        self._task_lock = threading.Lock()   # guards _task_runner against close()
        try:
            if engine is None:
                if segment_location.startswith("cuda"):
                    cuda.available()   # load the driver first: the engine then offers cuda_ipc
                cfg = EngineConfig.from_env()
                apply_protocol(cfg, protocol)
                cfg.transfer_timeout_s = transfer_timeout_s
                engine = TransferEngine(local_hostname, metadata_server, config=cfg)
            self.engine = engine
            self._scratch = _Scratch(engine)
            if global_segment_size:
                self._segment = _allocate_segment(engine, global_segment_size, segment_location)
            info = self._register_first()
        except BaseException:
            self._release(engine)
            raise
        self._lease_ttl_s = info["lease_ttl_ms"] / 1000
        if self._offload_dir and not info["enable_offload"]:
            log.warning("master has offload disabled: objects are not written to %s", self._offload_dir)
            self._offload_dir = None
        if self._offload_dir is None and info.get("persist_puts") and os.path.isdir(self._master_root):
            # the original's persistence: the master's root_fs_dir makes every client keep its puts
            self._offload_dir = self._master_root
            self._offloader = ThreadPoolExecutor(1, thread_name_prefix="mc-offload")
        interval = max(0.05, min(1.0, info["client_ttl_s"] / 3))
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, args=(interval,),
                                           name="mc-store-heartbeat", daemon=True)
        self._heartbeat.start()

    # -- master connection ------------------------------------------------------------
    @property
    def segment_name(self) -> str:
        return self.engine.segment_name

    @property
    def master_address(self) -> str:
        return self._rpc.address

    def _register(self, rpc: RpcClient) -> dict:
        """Register with ``rpc``'s master and mount our segment there (idempotent)."""
        info = rpc.call("register_client", client_id=self.client_id, host_id=self._host_id)
        self._master_root = info.get("root_fs_dir", "")
        if self._segment is not None:
            try:
                rpc.call("mount_segment", client_id=self.client_id, segment=self.segment_name,
                         base=self._segment.address, nbytes=self._segment.nbytes)
            except SegmentAlreadyExists:
                pass  # another of our threads remounted it a moment ago
        return info

    def _register_first(self) -> dict:
        """Register with the master found at start; under HA, with the next term's leader
        when that one is gone (its stale address was still published)."""
        try:
            return self._register(self._rpc)
        except (RpcFailed, RpcTimeout, NotSupported):
            if self._ha is None:
                raise
        stale = self._rpc
        self._rpc, self._term, info = self._follow_leader(self._term, self._rpc_timeout_s)
        stale.close()
        return info

    def _follow_leader(self, exclude_term: int, timeout_s: float) -> tuple[RpcClient, int, dict]:
        """HA: register with the leader of a term other than ``exclude_term``, at any address
        (a master restarted in place wins a new term at its old one); blocking.

        ``exclude_term``'s master is tried once more if no other term is published within
        ``_SAME_TERM_RETRY_S`` (it may still lead). A leader that does not take us is passed
        over for the next term. Returns the registered connection, its term and the reply.
        """
        from .ha import LeaderWaitTimeout, find_leader, wait_for_leader

        assert self._ha is not None
        deadline = time.monotonic() + timeout_s
        retried = False
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                leader = wait_for_leader(*self._ha, exclude_term=exclude_term, stop=self._stop,
                                         timeout_s=remaining if retried
                                         else min(remaining, _SAME_TERM_RETRY_S))
            except LeaderWaitTimeout:
                if retried or self._stop.is_set() or time.monotonic() >= deadline:
                    raise
                retried = True
                found = find_leader(*self._ha)
                if found is None or found.term != exclude_term:
                    continue
                leader = found
            rpc = RpcClient(*split_address(leader.address), timeout_s=self._rpc_timeout_s)
            try:
                return rpc, leader.term, self._register(rpc)
            except (RpcFailed, RpcTimeout, NotSupported) as exc:
                rpc.close()
                if time.monotonic() >= deadline or self._stop.is_set():
                    raise
                log.warning("store master %s (term %d) did not take this client: %s; "
                            "waiting for the next term", leader.address, leader.term, exc)
                exclude_term = leader.term
            except BaseException:
                rpc.close()
                raise

    def _failover(self, failed: RpcClient, unreachable: bool) -> None:
        """Register again: with the same master when it forgot us, else (HA) with the new leader.

        The first thread to find ``failed`` broken does it, without holding ``_rpc_lock``
        while it waits; others wait for its outcome (its error too). The new connection is
        published only once registration succeeded, so other threads never call a master
        that does not know us yet. ``close()`` ends the wait within about half a second.
        """
        with self._rpc_lock:
            if self._rpc is not failed:
                return  # another thread moved to a new master already
            failed_term = self._term
            run = self._failover_run
            mine = run is None
            if mine:
                run = self._failover_run = _Failover()
        if not mine:
            run.done.wait()
            if run.error is not None:  # a fresh exception: each thread gets its own traceback
                raise type(run.error)(str(run.error)) from run.error
            return
        try:
            self._forget_slots()   # the master that placed them may be gone
            rpc, term = failed, failed_term
            if unreachable and self._ha is not None:
                rpc, term, _ = self._follow_leader(failed_term, self._failover_timeout_s)
                log.warning("store master: %s (term %d) -> %s (term %d)", failed.address,
                            failed_term, rpc.address, term)
            else:
                self._register(rpc)
            with self._rpc_lock:
                if rpc is not failed:
                    self._rpc, self._term = rpc, term
                closed = self._closed
                self._forget_slots()   # and any a call granted meanwhile
            if rpc is not failed:
                failed.close()
                if closed:  # close() ran meanwhile and closed the connection it saw
                    rpc.close()
        except MooncakeError as exc:
            run.error = exc
            raise
        finally:
            with self._rpc_lock:
                self._failover_run = None
            run.done.set()

    def _check_open(self) -> None:
        if self._refusing:
            raise UnavailableInCurrentStatus("this StoreClient is closed")

    def _call(self, method: str, **args: Any) -> Any:
        """RPC with one retry after re-registering: with the same master when it forgot us
        or its connection broke (a restarted master), with the new leader under HA."""
        self._check_open()
        rpc = self._rpc
        try:
            out = rpc.call(method, **args)
            self._answered = time.monotonic()
            return out
        except ClientNotFound:
            self._failover(rpc, unreachable=False)
        except RpcTimeout:
            if self._ha is None:
                raise  # the master may have done it: no blind retry
            self._failover(rpc, unreachable=True)
        except NotSupported:  # "not the leader" under HA; a real refusal otherwise
            if self._ha is None:
                raise
            self._failover(rpc, unreachable=True)
        except RpcFailed:
            self._failover(rpc, unreachable=self._ha is not None)
        out = self._rpc.call(method, **args)
        self._answered = time.monotonic()
        return out

    def _heartbeat_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            rpc = self._rpc
            t0 = time.monotonic()
            try:
                tasks = rpc.call("heartbeat", client_id=self.client_id)
                self._answered = time.monotonic()
                if time.monotonic() - t0 > interval_s * 3:
                    log.warning("heartbeat to %s took %.1f s", rpc.address, time.monotonic() - t0)
                if tasks:
                    self._start_tasks(tasks)
            except ClientNotFound:
                log.warning("master %s forgot this client: registering again", rpc.address)
                self._safe_failover(rpc, unreachable=False)
            except (RpcFailed, NotSupported) as exc:
                if self._ha is not None:
                    self._safe_failover(rpc, unreachable=True)
                else:
                    log.warning("heartbeat to %s failed: %s", rpc.address, exc)
            except Exception:  # the beat must go on, or the master drops our segments
                log.exception("heartbeat to %s failed", rpc.address)

    def _start_tasks(self, tasks: list[dict]) -> None:
        with self._task_lock:
            if self._closed:
                log.info("closing: %d copy/move tasks left to time out on the master", len(tasks))
                return
            if self._task_runner is None:
                self._task_runner = ThreadPoolExecutor(2, thread_name_prefix="mc-store-task")
            for t in tasks:
                self._task_runner.submit(run_task, self, t)

    def call_master(self, method: str, **args: Any) -> Any:
        """One RPC to the master (re-registering first if it forgot this client)."""
        return self._call(method, **args)

    def _safe_failover(self, rpc: RpcClient, unreachable: bool) -> None:
        try:
            self._failover(rpc, unreachable)
        except MooncakeError as exc:
            log.warning("could not re-register with the store master: %s", exc)

    # -- buffers ----------------------------------------------------------------------
    def register_buffer(self, address: int, nbytes: int, location: str = "*") -> None:
        """Let ``put_from``/``get_into`` use ``[address, address+nbytes)`` (zero-copy).
        ``location``: as the engine's ``register_address`` (``"*"``: found from the pointer)."""
        self._check_open()
        self.engine.register_address(address, nbytes, location, private=True)

    def unregister_buffer(self, address: int) -> None:
        self._check_open()
        self.engine.unregister(address)

    @contextmanager
    def gpu_buffers(self, ranges: Iterable[tuple[int, int]]) -> Iterator[None]:
        """Register, for the ``with`` block, the GPU memory among ``(address, nbytes)``
        ranges that is not registered here yet (the original reads into and writes from
        any CUDA memory); host memory is left as it is."""
        self._check_open()
        added: list[int] = []
        try:
            if cuda.driver_in_process():
                for address, nbytes in ranges:
                    if nbytes > 0 and address not in added \
                            and not self.engine.is_registered(address, nbytes) \
                            and memory.kind_of(address, nbytes) == "cuda":
                        self.engine.register_address(address, nbytes, "*", private=True)
                        added.append(address)
            yield
        finally:
            for address in added:
                self.engine.unregister(address)

    def local_view(self, address: int, nbytes: int) -> memoryview:
        """A writable view of registered memory. Raises AddressError outside a registration."""
        self._check_open()
        return self.engine.local_view(address, nbytes)

    # -- puts ---------------------------------------------------------------------------
    def batch_put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Any]],
                        config: ReplicateConfig | None = None,
                        upsert: bool = False) -> list[StoreError | None]:
        """Put objects each the concatenation of several buffers, gathered straight into
        the segment (no joined copy first); per-key errors (None = ok)."""
        self._check_open()
        if len(keys) != len(parts):
            raise InvalidParams("keys and parts differ in length")
        regions: list[Any] = []
        try:
            pieces = [[self._stage(p, regions) for p in ps] for ps in parts]
            return self.batch_put_from_parts(keys, [[(a, n) for a, n in ps if n] for ps in pieces],
                                             config, upsert)
        finally:
            for r in regions:
                self.engine.unregister(r)

    def batch_put(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None, upsert: bool = False) -> list[StoreError | None]:
        """Put many objects in one master round trip each way; per-key errors (None = ok)."""
        self._check_open()
        if len(keys) != len(values):
            raise InvalidParams("keys and values differ in length")
        views = _small_values(values)
        if views is not None:
            return self._put_small(keys, views, config, upsert)
        regions: list[Any] = []
        try:
            ranges = [self._stage(v, regions) for v in values]
            return self.batch_put_from(keys, [a for a, _ in ranges], [n for _, n in ranges],
                                       config, upsert)
        finally:
            for r in regions:
                self.engine.unregister(r)

    def _put_small(self, keys: Sequence[str], views: list[memoryview],
                   config: ReplicateConfig | None, upsert: bool) -> list[StoreError | None]:
        """Put values copied into a registered scratch buffer of this client (cheaper than
        registering each value and removing it again). The buffer is lent again only after
        a put that went through whole: one that failed may have slices still reading it."""
        buf, region = self._scratch.take()
        ok = False
        try:
            ranges, at = [], 0
            for v in views:
                buf[at:at + v.nbytes] = v
                ranges.append((region.address + at, v.nbytes) if v.nbytes else (0, 0))
                at += v.nbytes
            out = self.batch_put_from(keys, [a for a, _ in ranges], [n for _, n in ranges],
                                      config, upsert)
            ok = not any(isinstance(e, StoreTransferFailed) for e in out)
            return out
        finally:
            self._scratch.give((buf, region), reuse=ok)

    def _stage(self, value: Any, regions: list[Any]) -> tuple[int, int]:
        """``(address, nbytes)`` of ``value`` in a private region of this call (``regions``).

        A value inside a region this call registered already (the same buffer under
        several keys) reuses it; one overlapping other registered memory (a user-registered
        buffer, a slice of a value staged before) is copied first.
        """
        try:
            address, nbytes = memory.address_of(value)
        except BufferError as exc:
            raise InvalidArgument(f"cannot put {type(value).__name__}: {exc}") from None
        if nbytes == 0:
            return 0, 0  # the master refuses it for this key only
        for r in regions:
            if r.address <= address and address + nbytes <= r.address + r.nbytes:
                return address, nbytes
        try:
            regions.append(self.engine.register(value, private=True))
        except InvalidArgument as exc:  # it overlaps registered memory: stage a copy
            try:
                copy = bytes(memoryview(value).cast("B"))
            except (TypeError, ValueError):
                raise exc from None
            regions.append(self.engine.register(copy, private=True))
        return regions[-1].address, regions[-1].nbytes

    def batch_put_from_parts(self, keys: Sequence[str], parts: Sequence[Sequence[tuple[int, int]]],
                             config: ReplicateConfig | None = None,
                             upsert: bool = False) -> list[StoreError | None]:
        """Put objects each gathered from several registered ``(address, nbytes)`` pieces."""
        self._check_open()
        if len(keys) != len(parts):
            raise InvalidParams("keys and parts differ in length")
        if not keys:
            return []
        sizes = [sum(n for _, n in p) for p in parts]
        config = config or ReplicateConfig()
        out = self._put_reserved(keys, parts, sizes, config, upsert)
        return out if out is not None else self._put_started(keys, parts, sizes, config, upsert)

    def _put_started(self, keys: Sequence[str], parts: Sequence[Sequence[tuple[int, int]]],
                     sizes: list[int], config: ReplicateConfig,
                     upsert: bool) -> list[StoreError | None]:
        """Put through put_start, the writes and put_end (two master round trips)."""
        cfg = config.to_wire(upsert)
        results = self._call("put_start", client_id=self.client_id, keys=list(keys),
                             sizes=sizes, config=cfg)
        errors: list[StoreError | None] = [None] * len(keys)
        plan: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)
        for i, (code, replicas) in enumerate(results):
            if code:
                errors[i] = store_error(code, replicas)
                continue
            for replica in replicas:
                for local, seg, remote, n in _pair(parts[i], replica):
                    plan[seg].append((local, remote, n, i))
        failed = self._run(OpCode.WRITE, plan)
        done = [k for i, k in enumerate(keys) if errors[i] is None and i not in failed]
        bad = [k for i, k in enumerate(keys) if errors[i] is None and i in failed]
        for i in failed:
            errors[i] = StoreTransferFailed(f"writing {keys[i]!r} failed: {failed[i]}")
        if bad:
            self._call("put_revoke", client_id=self.client_id, keys=bad)
        if done:
            ends = self._call("put_end", client_id=self.client_id, keys=done)
            index = {k: i for i, k in enumerate(keys)}
            for k, (code, msg) in zip(done, ends):
                if code:
                    errors[index[k]] = store_error(code, msg)
                elif self._offload_dir:
                    self._offload(k, parts[index[k]])
        return errors

    def _put_reserved(self, keys: Sequence[str], parts: Sequence[Sequence[tuple[int, int]]],
                      sizes: list[int], config: ReplicateConfig,
                      upsert: bool) -> list[StoreError | None] | None:
        """Put small objects of one size with one master round trip: write into slots the
        master reserved for this client, then ``put_reserved`` (which also refills them).
        None where this does not apply: mixed or large sizes, preferred segments, a size
        seen for the first time, no slots to be had, an invalid key. Keys whose slot was
        refused (expired, or its segment gone) or whose write failed go through
        :meth:`_put_started`."""
        nbytes, n = sizes[0], len(keys)
        # one replica: a slot of several can lose one with a segment while its client
        # goes on writing into the others, whose space the master then hands out again.
        # An invalid key: put_start refuses it before placing anything, whereas asking
        # for slots places them first, evicting other objects when the pool is full, for
        # a put that cannot succeed
        if (config.preferred_segments or not 0 < nbytes <= MAX_SLOT_NBYTES
                or config.replica_num != 1 or any(z != nbytes for z in sizes)
                or not all(map(_valid_key, keys))):
            return None
        cls = (nbytes, config.replica_num)
        if n > _slot_target(*cls):
            return None
        epoch = self._epoch
        taken = self._take_slots(cls, n)
        if taken is None:
            with self._slots_lock:
                ask_after = self._seen_sizes.pop(cls, None)   # None: a size not seen yet
                self._seen_sizes[cls] = 0.0 if ask_after is None else ask_after
                if len(self._seen_sizes) > 4 * SLOT_CLASSES:
                    self._seen_sizes.popitem(last=False)
                want = max(0, _slot_target(*cls) - len(self._slots.get(cls, ())))
            # a one-off size would only hold slots nobody uses; a refused one waits
            if ask_after is None or time.monotonic() < ask_after:
                return None
            # with slots left, this also asks whether the master that placed them still
            # answers (they were left alone because it had not lately)
            granted = self._call("reserve", client_id=self.client_id, nbytes=nbytes,
                                 replica_num=config.replica_num, count=want)
            if want and not granted["slots"]:   # no room, share used up, too few segments
                with self._slots_lock:
                    self._seen_sizes[cls] = time.monotonic() + SLOT_RETRY_S
            self._add_slots(cls, granted, epoch)
            taken = self._take_slots(cls, n)
            if taken is None:
                return None
        plan: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)
        for i, (_, replicas, _) in enumerate(taken):
            for replica in replicas:
                for local, seg, remote, m in _pair(parts[i], replica):
                    plan[seg].append((local, remote, m, i))
        failed = self._run(OpCode.WRITE, plan)
        written = [i for i in range(n) if i not in failed]
        retry = sorted(failed)
        errors: list[StoreError | None] = [None] * n
        if written:
            with self._slots_lock:   # in bulk, once half the slots are used
                left, target = len(self._slots.get(cls, ())), _slot_target(*cls)
                refill = target - left if left <= target // 2 else 0
            try:
                done, granted = self._call(
                    "put_reserved", client_id=self.client_id, keys=[keys[i] for i in written],
                    slots=[taken[i][0] for i in written], config=config.to_wire(upsert),
                    refill=[nbytes, config.replica_num, refill] if refill > 0 else [])
            except (RpcFailed, NotSupported):   # no master to be had: nor its slots
                self._forget_slots()
                raise
            self._add_slots(cls, granted, epoch)
            for i, (code, _) in zip(written, done):
                if code:   # refused as a slot: put_start says whether and why as an object
                    retry.append(i)
                elif self._offload_dir:
                    self._offload(keys[i], parts[i])
        if retry:
            again = self._put_started([keys[i] for i in retry], [parts[i] for i in retry],
                                      [sizes[i] for i in retry], config, upsert)
            for i, err in zip(retry, again):
                errors[i] = err
        return errors

    def _forget_slots(self) -> None:
        """Drop every slot, and any granted by a call made before now."""
        with self._slots_lock:
            self._epoch += 1
            self._slots.clear()

    def _take_slots(self, cls: tuple[int, int], n: int) -> list[tuple[int, list, float]] | None:
        """``n`` usable slots of ``cls``, or None (then none is taken)."""
        now = time.monotonic()
        if now - self._answered > SLOT_FRESH_S:
            return None
        with self._slots_lock:
            pool = self._slots.get(cls)
            if pool is None:
                return None
            self._slots.move_to_end(cls)
            while pool and pool[0][2] <= now:   # the master frees them soon
                pool.pop(0)
            if len(pool) < n:
                return None
            taken, pool[:] = pool[:n], pool[n:]
            return taken

    def _add_slots(self, cls: tuple[int, int], granted: dict, epoch: int) -> None:
        """Keep slots the master granted in a call made in ``epoch`` (none if this client
        re-registered meanwhile: they may be another master's)."""
        if not granted["slots"]:
            return
        until = time.monotonic() + granted["use_within_s"]
        with self._slots_lock:
            if epoch != self._epoch:
                return
            pool = self._slots.setdefault(cls, [])
            self._slots.move_to_end(cls)
            pool.extend((rid, replicas, until) for rid, replicas in granted["slots"])
            while len(self._slots) > SLOT_CLASSES:   # left to expire on the master
                self._slots.popitem(last=False)

    def _run(self, op: OpCode, plan: dict[str, list[tuple[int, int, int, int]]]) -> dict[int, MooncakeError]:
        """Move ``(local, remote, nbytes, key index)`` items, all segments at once; returns
        key index -> first error."""
        total = sum(it[2] for items in plan.values() for it in items)
        results = self.engine.transfer_many(
            op, {seg: [it[:3] for it in items] for seg, items in plan.items()},
            timeout_s=self._transfer_timeout_s + total / 1e8)
        failed: dict[int, MooncakeError] = {}
        for seg, items in plan.items():
            for item, err in zip(items, results[seg]):
                if err is not None:
                    failed.setdefault(item[3], err)
        return failed

    def _offload(self, key: str, parts: Sequence[tuple[int, int]]) -> None:
        """Copy the object to the SSD tier now (the caller's buffer may change later)."""
        data = b"".join(self.engine.local_view(a, n) for a, n in parts)
        path = offload.path_for(self._offload_dir, key)

        def write() -> None:
            try:
                offload.write_file(path, memoryview(data))
                code, msg = self._call("add_disk_replica", keys=[key])[0]
                if code:
                    log.warning("offload of %r not recorded: %s", key, msg)
                if code == ObjectNotFound.code:  # removed or evicted meanwhile: nothing needs it
                    offload.delete_under(self._offload_dir, offload.relative_name(key))
            except (OSError, ValueError, MooncakeError) as exc:
                log.warning("offload of %r to %s failed: %s", key, path, exc)

        self._offloader.submit(write)

    def flush_offload(self) -> None:
        """Wait until every background SSD-tier write issued so far finished."""
        self._check_open()
        if self._offloader is not None:
            self._offloader.submit(lambda: None).result()

    # -- gets ---------------------------------------------------------------------------
    def batch_get(self, keys: Sequence[str]) -> list[bytes | StoreError]:
        """Objects' bytes, or a per-key error."""
        bufs: dict[int, Any] = {}
        regions: dict[int, Any] = {}

        def dest(i: int, nbytes: int) -> list[tuple[int, int]]:
            # A fresh bytes object is filled in place (native build): no second copy. A
            # second attempt (a lease ran out) reuses it, or lets it go unregistered first:
            # a buffer freed while registered would let the next one at its address clash
            if i in bufs and len(bufs[i]) != nbytes:
                self.engine.unregister(regions.pop(i))
                del bufs[i]
            if i not in bufs:
                bufs[i] = memory.empty_bytes(nbytes)
                address, _ = memory.address_of(bufs[i])
                regions[i] = self.engine.register_address(address, nbytes, private=True)
            return [(memory.address_of(bufs[i])[0], nbytes)]

        try:
            res = self._get(list(keys), dest)
        finally:
            for r in regions.values():
                self.engine.unregister(r)
        return [r if isinstance(r, Exception) else bytes(bufs[i]) for i, r in enumerate(res)]

    def batch_get_into(self, keys: Sequence[str], addresses: Sequence[int],
                       sizes: Sequence[int]) -> list[int | StoreError]:
        """Read objects into registered memory; per key its size or an error."""
        if not len(keys) == len(addresses) == len(sizes):
            raise InvalidParams("keys, addresses and sizes differ in length")
        return self.batch_get_into_parts(keys, [[(a, n)] for a, n in zip(addresses, sizes)])

    def batch_get_into_parts(self, keys: Sequence[str],
                             parts: Sequence[Sequence[tuple[int, int]]]) -> list[int | StoreError]:
        """Read objects scattered into several registered ``(address, nbytes)`` pieces each."""
        if len(keys) != len(parts):
            raise InvalidParams("keys and parts differ in length")

        def dest(i: int, nbytes: int) -> list[tuple[int, int]]:
            room = parts[i][0][1] if len(parts[i]) == 1 else sum(n for _, n in parts[i])
            if nbytes > room:
                raise BufferTooSmall(f"{keys[i]!r} has {nbytes} bytes; the buffers hold {room}")
            return list(parts[i])

        return self._get(list(keys), dest)

    def _is_local(self, segment: str) -> bool:
        local = self._local_segments.get(segment)
        if local is None:
            try:
                local = self.engine.open_segment(segment).descriptor.host_id == self._host_id
            except MooncakeError:
                local = False
            self._local_segments[segment] = local
        return local

    def locate(self, keys: Sequence[str]) -> Located:
        """Where each object's bytes are (one master round trip), for
        :meth:`batch_get_ranges_into`; this takes a read lease on each object found."""
        self._check_open()
        since = time.monotonic()
        replies = self._call("get_replicas", keys=list(keys)) if keys else []
        found: list[Any] = []
        for code, info in replies:
            if code:
                found.append(store_error(code, info))
                continue
            nbytes, replicas, disk, _ = info
            if len(replicas) > 1:  # spread readers, same-host replicas first
                random.shuffle(replicas)
                replicas.sort(key=lambda r: not all(self._is_local(s[0]) for s in r))
            found.append((nbytes, replicas, disk))
        return Located(list(keys), found, since)

    def batch_get_ranges_into(self, located: Located,
                              reads: Sequence[tuple[int, int, Sequence[tuple[int, int]]]]
                              ) -> list[int | StoreError]:
        """Read byte ranges of located objects into registered memory, with no further
        master round trip: each read ``(object index in located, offset, pieces)`` fills
        its ``(address, nbytes)`` pieces, in order, with the object's bytes from ``offset``.

        Per read, the bytes read or an error: the object's lookup error,
        InvalidParams for a range beyond the object, StoreTransferFailed when no replica
        could be read, LeaseExpired when the read ended after the lookup's lease ran out
        (the space may have been reused: the bytes must not be used).

        Raises:
            InvalidParams: an object index outside ``located``.
        """
        self._check_open()
        out: list[Any] = [None] * len(reads)
        todo = []
        for r, (i, offset, pieces) in enumerate(reads):
            if not 0 <= i < len(located.keys):
                raise InvalidParams(f"object index {i} outside the {len(located.keys)} located")
            obj = located.found[i]
            nbytes = sum(n for _, n in pieces)
            if isinstance(obj, Exception):
                out[r] = obj
            elif offset < 0 or offset + nbytes > obj[0]:
                out[r] = InvalidParams(f"bytes {offset}..{offset + nbytes} of {located.keys[i]!r}: "
                                       f"it has {obj[0]}")
            else:
                todo.append((r, i, offset, nbytes, list(pieces)))
        self._read(located, todo, out)
        return out

    def batch_get_ranges(self, located: Located, ranges: Sequence[tuple[int, int, int]]
                         ) -> list[bytes | StoreError]:
        """Byte ranges ``(object index in located, offset, nbytes)`` of located objects,
        as bytes (read into memory of the client's own); per range the bytes or an error,
        as :meth:`batch_get_ranges_into`."""
        self._check_open()
        buf = bytearray(max(1, sum(n for _, _, n in ranges)))
        region = self.engine.register(buf, private=True)
        try:
            reads, at = [], region.address
            for i, offset, nbytes in ranges:
                reads.append((i, offset, [(at, nbytes)]))
                at += nbytes
            got = self.batch_get_ranges_into(located, reads)
        finally:
            self.engine.unregister(region)
        out: list[bytes | StoreError] = []
        at = 0
        for (_, _, nbytes), r in zip(ranges, got):
            out.append(r if isinstance(r, Exception) else bytes(buf[at:at + nbytes]))
            at += nbytes
        return out

    def _read(self, located: Located, todo: list[tuple[int, int, int, int, list[tuple[int, int]]]],
              out: list[Any]) -> None:
        """Run ``(out index, object index, offset, nbytes, local pieces)`` reads: each
        replica in turn, then the disk replica; ``out`` gets the bytes read or an error."""
        pending = {r: (i, offset, nbytes, local) for r, i, offset, nbytes, local in todo}
        attempt = 0
        while pending:
            plan: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)
            for r, (i, offset, nbytes, local) in list(pending.items()):
                size, replicas, disk = located.found[i]
                if attempt < len(replicas):
                    for laddr, seg, raddr, n in _pair(local, _window(replicas[attempt], offset,
                                                                     nbytes)):
                        plan[seg].append((laddr, raddr, n, r))
                elif disk is not None:
                    out[r] = self._read_disk(located.keys[i], disk, size, local, offset, nbytes)
                    del pending[r]
                else:
                    out[r] = StoreTransferFailed(f"no replica of {located.keys[i]!r} could be read")
                    del pending[r]
            failed = self._run(OpCode.READ, plan)
            for r in list(pending):
                if r in failed:
                    log.info("reading %r from replica %d failed: %s",
                             located.keys[pending[r][0]], attempt, failed[r])
                elif attempt < len(located.found[pending[r][0]][1]):
                    out[r] = pending.pop(r)[2]
            attempt += 1
        if time.monotonic() - located.since >= self._lease_ttl_s:
            # the lease ran out while reading: the space may have been reused under us
            for r, i, _, _, _ in todo:
                if isinstance(out[r], int):
                    out[r] = LeaseExpired(f"reading {located.keys[i]!r} outlived its lease")

    def _get(self, keys: list[str], dest: Callable[[int, int], list[tuple[int, int]]],
             retry_expired: bool = True) -> list:
        self._check_open()
        if not keys:
            return []
        located = self.locate(keys)
        out: list[Any] = list(located.found)
        todo = []
        for i, obj in enumerate(located.found):
            if isinstance(obj, Exception):
                continue
            try:
                todo.append((i, i, 0, obj[0], dest(i, obj[0])))
            except StoreError as exc:
                out[i] = exc
        self._read(located, todo, out)
        if retry_expired and any(isinstance(o, LeaseExpired) for o in out):
            return self._get(keys, dest, retry_expired=False)
        return out

    def _disk_path(self, name: str) -> str:
        """Where this client reads the disk replica ``name`` the master reported
        (ValueError for a malformed name or when no directory is known)."""
        root = self._ssd_path or self._master_root
        if not root:
            raise ValueError("no ssd_offload_path here and the master reports no root_fs_dir")
        return offload.resolve(root, name)

    def _read_disk(self, key: str, name: str, size: int, local: list[tuple[int, int]],
                   offset: int, nbytes: int) -> int | StoreError:
        """Read bytes ``offset..offset+nbytes`` of the ``size``-byte object from its SSD-tier
        file straight into the ``local`` pieces."""
        path = name
        try:
            path = self._disk_path(name)
            views, left = [], nbytes
            for address, room in local:
                if left <= 0:
                    break
                views.append(self.engine.local_view(address, min(room, left)))
                left -= len(views[-1])
            offload.read_range_into(path, size, offset, views)
            return nbytes
        except (OSError, ValueError, MooncakeError) as exc:
            return StoreTransferFailed(f"reading {key!r} from the SSD tier ({path}) failed: {exc}")

    # -- queries and removal -------------------------------------------------------------
    def replicas(self, keys: Sequence[str]) -> list[tuple[int, list, str | None] | StoreError]:
        """Where each object lives: ``(nbytes, memory replicas, disk path)`` or an error.

        A memory replica is a list of ``(segment, address, nbytes)`` shards; the disk path
        is where this client reads the SSD-tier file (None: none, or no directory known).
        Like a read, this takes a read lease on each object.
        """
        self._check_open()
        replies = self._call("get_replicas", keys=list(keys)) if keys else []
        return [store_error(code, info) if code
                else (info[0], info[1], self._disk_path_or_none(info[2])) for code, info in replies]

    def _disk_path_or_none(self, name: str | None) -> str | None:
        if name is None:
            return None
        try:
            return self._disk_path(name)
        except ValueError as exc:
            log.warning("ignoring the disk replica %r: %s", name, exc)
            return None


    def exists(self, key: str) -> bool:
        return bool(self._call("exist", keys=[key])[0])

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        return [bool(x) for x in self._call("exist", keys=list(keys))] if keys else []

    def size(self, key: str) -> int:
        """Size in bytes of a complete object (ObjectNotFound otherwise)."""
        code, info = self._call("get_replicas", keys=[key])[0]
        if code:
            raise store_error(code, info)
        return info[0]

    def remove(self, key: str, force: bool = False) -> None:
        """Remove an object; ObjectHasLease while someone reads it, unless ``force``."""
        code, msg = self._call("remove", keys=[key], force=force)[0]
        if code:
            raise store_error(code, msg)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[StoreError | None]:
        self._check_open()
        res = self._call("remove", keys=list(keys), force=force) if keys else []
        return [store_error(c, m) if c else None for c, m in res]

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        return self._call("remove_by_regex", pattern=pattern, force=force)

    def remove_all(self, force: bool = False) -> int:
        return self._call("remove_all", force=force)

    def stats(self) -> dict:
        return self._call("stats")

    # -- replica copy/move (tasks.py) -------------------------------------------------
    def create_copy_task(self, key: str, targets: Sequence[str]) -> tuple[int, int]:
        """Have the master copy ``key`` to each segment of ``targets``; returns the task id."""
        return tuple(self._call("create_copy_task", key=key, targets=list(targets)))  # type: ignore[return-value]

    def create_move_task(self, key: str, source: str, target: str) -> tuple[int, int]:
        """Have the master move ``key``'s replica on ``source`` to ``target``; the task id."""
        return tuple(self._call("create_move_task", key=key, source=source, target=target))  # type: ignore[return-value]

    def query_task(self, task_id: Sequence[int]) -> dict:
        """A task's state: id, type, key, source, targets, client_id, status, message,
        created_ms, updated_ms (tasks.py names the type and status numbers)."""
        return self._call("query_task", task_id=[int(x) for x in task_id])

    def copy_replicas(self, key: str, source: str, targets: Sequence[str], move: bool = False) -> None:
        """Copy ``key`` from its replica on ``source`` to ``targets`` (a move also drops the
        source replica): what this client does for a task the master handed it."""
        nbytes, src, new = self._call("replica_start", client_id=self.client_id, key=key,
                                      source=source, targets=list(targets), move=move)
        ok = False
        try:
            if new:
                region = self.engine.register(bytearray(nbytes), private=True)
                try:
                    local = [(region.address, nbytes)]
                    for op, replicas in ((OpCode.READ, [src]), (OpCode.WRITE, new)):
                        plan: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)
                        for r in replicas:
                            for laddr, seg, raddr, n in _pair(local, r):
                                plan[seg].append((laddr, raddr, n, 0))
                        failed = self._run(op, plan)
                        if failed:
                            raise StoreTransferFailed(f"copying {key!r}: {failed[0]}")
                finally:
                    self.engine.unregister(region)
            ok = True
        finally:
            self._end_copy(key, ok)

    def _end_copy(self, key: str, ok: bool, attempts: int = 3) -> None:
        """``replica_end``, retried while the master is unreachable (else the copy stays
        reserved until its deadline there). Ending a failed copy only logs its own failure,
        so that the copy's error is the one raised."""
        for attempt in range(1, attempts + 1):
            try:
                self._call("replica_end", client_id=self.client_id, key=key, ok=ok)
                return
            except StoreError as exc:
                retry = isinstance(exc, RpcFailed) and attempt < attempts
                if retry and not self._stop.wait(0.2 * attempt):
                    continue
                if ok:
                    raise
                log.warning("could not end the failed copy of %r: %s", key, exc)
                return

    def batch_replica_clear(self, keys: Sequence[str], segment: str = "") -> list[str]:
        """Drop this client's objects among ``keys`` (only their replicas on ``segment``
        when given); leased or in-flight ones are kept. Returns the keys cleared."""
        return self._call("batch_replica_clear", client_id=self.client_id, keys=list(keys),
                          segment=segment)

    # -- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Unregister from the master (the segment is unmounted: its objects' replicas go),
        stop heartbeats, release memory. Every call after it raises UnavailableInCurrentStatus."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._heartbeat.join(5)
        with self._task_lock:  # no runner is created after this
            runner, self._task_runner = self._task_runner, None
        if runner is not None:
            runner.shutdown(wait=True, cancel_futures=True)
        if self._offloader is not None:
            self._offloader.shutdown(wait=True)  # its last writes still report to the master
        self._refusing = True
        try:   # the master unmounts our segment and forgets us now, not a TTL later
            self._rpc.call("unregister_client", client_id=self.client_id)
        except MooncakeError as exc:
            if self._segment is not None:
                log.warning("unmount of %s failed: %s", self.segment_name, exc)
            else:
                log.info("the master was not told that client %s closed: %s",
                         self.client_id, exc)
        self._release(self.engine)

    def _release(self, engine: TransferEngine | None) -> None:
        """Close the master connection and the offloader; close ``engine`` if it is ours,
        else give back our segment."""
        if self._offloader is not None:
            self._offloader.shutdown(wait=True)
        self._rpc.close()
        if engine is None:
            return
        if hasattr(self, "_scratch") and not self._owns_engine:
            self._scratch.close()   # an engine of ours takes its registrations with it
        if self._owns_engine:
            engine.close()
        elif isinstance(self._segment, cuda.DeviceBuffer):
            engine.unregister(self._segment.address)
        elif self._segment is not None:
            engine.free(self._segment)
        if isinstance(self._segment, cuda.DeviceBuffer):
            self._segment.close()   # after the engine let go of it

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
