"""The rdma transport: one-sided RDMA WRITE and READ over RC queue pairs (libibverbs).

Every local device with an ACTIVE port is opened (:class:`_Nic`: its protection domain,
one completion queue, the GID :func:`~..nic_topology.choose_gid` picks or
``MC_GID_INDEX`` forces). Each region the engine registers is registered on every NIC
(:meth:`RdmaTransport.register_region`): a published region with remote read access
(and remote write unless read-only), its rkeys published in the segment descriptor; a
private region with local access only, so no peer can reach it. Unregistering
deregisters it, which revokes the rkeys at the NIC before the memory is let go.

Connecting (initiator side): queue pairs are made for every (local NIC, peer NIC) pair
(``qps_per_path`` each), their numbers, PSNs and our GIDs sent in one ``rdma_connect``
control message on the peer's rpc port (validated there like every frame); the peer
makes its side, moves it to RTS and answers with its numbers; ours go to RTS. Only the
target's queue pairs allow remote access. A target keeps at most
:data:`MAX_QPS_PER_SEGMENT` queue pairs for one initiator and :data:`MAX_ACCEPTED_QPS`
in all, the oldest going first.

Data path: a batch's slices are spread over the connection's queue pairs (one work
request per slice, all signaled, posted as one chained list per queue pair); a poller
thread per NIC polls its completion queue in native code without the GIL and wakes the
waiting worker. A failed completion breaks the connection (its queue pairs are
destroyed once drained, the next batch connects again) and raises ``TransferError``
with the slices that did move, so the engine retries the rest, here or on another
transport. A remote access error after the peer re-registered its memory (new rkeys)
is retried with the fresh descriptor; otherwise it is the peer's refusal
(``AddressError``).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack

from ...config import gid_index
from ...errors import (AddressError, InvalidArgument, TransferError, TransferTimeout,
                       TransportUnavailable)
from .. import nic_topology, verbs
from ..peer import Peer
from ..segment import CUDA, HOST, kind_of_location
from .base import OP_WRITE, PRIORITY_RDMA, Transport

if TYPE_CHECKING:
    from ...config import EngineConfig

log = logging.getLogger(__name__)

MAX_ACCEPTED_QPS = 1024
"""Queue pairs a target keeps for all its initiators together."""
MAX_QPS_PER_SEGMENT = 64
"""Queue pairs a target keeps for one initiator segment."""
QP_DEPTH = 256
"""Work requests outstanding on one queue pair at most."""
CQ_DEPTH = 65536
"""Completion-queue entries asked for per NIC (the device may allow fewer)."""
SYSFS = "/sys"


@dataclass
class _Nic:
    """One opened local device and what peers need to reach it."""

    index: int
    dev: Any  # _native.verbs.Device
    gid: bytes
    gid_index: int
    gid_text: str
    credits: threading.Semaphore = field(default_factory=threading.Semaphore)
    """Completion-queue entries free: a work request takes one until it is polled, so the
    queue never overflows whatever the number of queue pairs."""

    def wire(self) -> list:
        return [self.dev.name, self.gid_text, self.dev.lid, verbs.mtu_bytes(self.dev.active_mtu)]


class _Path:
    """One (our NIC, the peer's NIC) pair, as this initiator has seen it perform."""

    __slots__ = ("name", "pair", "rate", "inflight", "bytes", "paused_until", "failures")

    def __init__(self, name: str, pair: tuple[int, int]) -> None:
        self.name, self.pair = name, pair
        self.rate = 0.0          # bytes/s it delivered, smoothed (0: not measured yet)
        self.inflight = 0        # bytes posted on it and not completed
        self.bytes = 0           # bytes it moved
        self.paused_until = 0.0  # monotonic time before which no connection uses it
        self.failures = 0


@dataclass
class _Qp:
    nic: _Nic
    qp: Any  # _native.verbs.QueuePair
    remote_nic: int
    path: _Path
    outstanding: int = 0  # bytes posted here and not completed
    slots: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(QP_DEPTH))


class _Connection:
    """Our queue pairs to one peer process over its live paths; ``broken`` ones are closed
    once drained."""

    def __init__(self, key: str, qps: list[_Qp]) -> None:
        self.key = key
        self.qps = qps
        self.pairs = frozenset(q.path.pair for q in qps)
        self.broken = False
        self.users = 0

    def close(self) -> None:
        for q in self.qps:
            try:
                q.qp.close()
            except OSError as exc:
                log.warning("closing rdma queue pair %d failed: %s", q.qp.qp_num, exc)


class _Waiter:
    """The completions one batch waits for: position -> work completion status."""

    def __init__(self, count: int) -> None:
        self.left = count
        self.status: dict[int, int] = {}
        self.done = threading.Event()
        self.lock = threading.Lock()
        if count == 0:
            self.done.set()

    def complete(self, pos: int, status: int) -> None:
        with self.lock:
            self.status[pos] = status
            self.left -= 1
            if self.left == 0:
                self.done.set()


class RdmaTransport(Transport):
    """Initiator and target side of rdma (the target only serves ``rdma_connect``)."""

    name = "rdma"
    priority = PRIORITY_RDMA
    memory_kinds = frozenset({HOST, CUDA})
    task_nbytes = 64 << 20
    control_commands = frozenset({"rdma_connect"})

    @classmethod
    def from_config(cls, config: "EngineConfig") -> "RdmaTransport":
        return cls(timeout_s=config.transfer_timeout_s, devices=config.rdma_devices or None,
                   path_pause_s=config.path_pause_s)

    def __init__(self, timeout_s: float = 30.0, devices: list[str] | None = None,
                 qps_per_path: int = 2, path_pause_s: float = 5.0, sysfs: str = SYSFS) -> None:
        found = verbs.devices()  # RdmaUnavailable with the reason when there is none
        native = verbs.native()
        forced = gid_index()
        self._timeout_s = timeout_s
        self._qps_per_path = qps_per_path
        self._path_pause_s = path_pause_s
        self._nics: list[_Nic] = []
        self._lock = threading.Lock()
        self._closed = False
        try:
            for info in found:
                if devices and info["name"] not in devices:
                    continue
                port = next((p for p in info.get("ports", []) if p.get("state") == "ACTIVE"), None)
                if port is None:
                    log.info("RDMA device %s has no ACTIVE port: not used", info["name"])
                    continue
                gid = _choose_gid(sysfs, info["name"], port, forced)
                dev = native.Device(info["name"], port["port"], CQ_DEPTH)
                self._nics.append(_Nic(len(self._nics), dev, dev.gid(gid.index), gid.index,
                                       gid.gid, threading.Semaphore(dev.cq_depth)))
        except BaseException:
            self._close_nics()
            raise
        if not self._nics:
            raise verbs.RdmaUnavailable("no RDMA device: none has an ACTIVE port"
                                        + (f" among {devices}" if devices else ""))
        self._mrs: dict[int, tuple[int, list[Any]]] = {}  # address -> (nbytes, MR per NIC)
        self._starts: list[int] = []
        self._gpu_ok = False
        self._control: Any = None
        self._segment = ""
        self._conns: dict[str, _Connection] = {}
        self._connecting: dict[str, threading.Lock] = {}
        self._accepted: dict[str, list[Any]] = {}  # initiator segment -> its QPs here
        self._accepted_count = 0
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[_Waiter, int, _Qp, int]] = {}
        self._paths: dict[tuple[str, int, int], _Path] = {}
        self._pollers = [threading.Thread(target=self._poll, args=(nic,), daemon=True,
                                          name=f"mc-rdma-{nic.dev.name}") for nic in self._nics]
        for t in self._pollers:
            t.start()
        log.info("rdma on %s", ", ".join(f"{n.dev.name} (GID {n.gid_index} {n.gid_text})"
                                         for n in self._nics))

    # -- what peers see ------------------------------------------------------------------
    def published(self) -> dict[str, Any]:
        """Descriptor fields: our NICs, in the order of every region's rkeys."""
        return {"rdma": tuple(tuple(n.wire()) for n in self._nics)}

    def register_region(self, address: int, nbytes: int, location: str, readonly: bool,
                        private: bool) -> tuple[int, ...]:
        """Register the region on every NIC; its rkeys (``()`` for a private region, which
        gets no remote access)."""
        native = verbs.native()
        access = native.ACCESS_LOCAL_WRITE
        if not private:
            access |= native.ACCESS_REMOTE_READ | (0 if readonly else native.ACCESS_REMOTE_WRITE)
        mrs: list[Any] = []
        try:
            for nic in self._nics:
                mrs.append(self._register(nic, address, nbytes, location, access))
        except OSError as exc:
            for mr in mrs:
                mr.close()
            log.info("rdma cannot register %s memory 0x%x+%d (%s): other transports move it",
                     location, address, nbytes, exc)
            return ()
        with self._lock:
            i = bisect.bisect_left(self._starts, address)
            self._starts.insert(i, address)
            self._mrs[address] = (nbytes, mrs)
        return () if private else tuple(mr.rkey for mr in mrs)

    def _register(self, nic: _Nic, address: int, nbytes: int, location: str, access: int) -> Any:
        if kind_of_location(location) != CUDA:
            return nic.dev.reg_mr(address, nbytes, access)
        from .. import cuda
        try:
            fd, offset = cuda.dmabuf_fd(address, nbytes)
        except (cuda.CudaError, TransportUnavailable, InvalidArgument) as exc:
            log.debug("no dma-buf for GPU memory 0x%x (%s): trying nvidia-peermem", address, exc)
        else:
            try:
                mr = nic.dev.reg_dmabuf_mr(offset, nbytes, address, fd, access)
                self._gpu_ok = True
                return mr
            finally:
                os.close(fd)
        mr = nic.dev.reg_mr(address, nbytes, access)  # works where nvidia-peermem is loaded
        self._gpu_ok = True
        return mr

    def unregister_region(self, address: int) -> None:
        """Deregister the region at ``address`` on every NIC: its rkeys stop working."""
        with self._lock:
            entry = self._mrs.pop(address, None)
            if entry is not None:
                del self._starts[bisect.bisect_left(self._starts, address)]
        for mr in entry[1] if entry else ():
            mr.close()

    def _lkey(self, address: int, nbytes: int, nic: int) -> int:
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            if i >= 0:
                start = self._starts[i]
                size, mrs = self._mrs[start]
                if address + nbytes <= start + size:
                    return mrs[nic].lkey
        raise TransferError(f"local memory 0x{address:x}+{nbytes} has no rdma registration")

    # -- target side ---------------------------------------------------------------------
    def serve_control(self, msg: dict) -> bytes:
        """Serve ``rdma_connect``: make our side of each queue pair, move it to RTS, and
        answer ``[[qpn, psn], ...]`` (the message was validated by the protocol)."""
        native = verbs.native()
        access = (native.ACCESS_LOCAL_WRITE | native.ACCESS_REMOTE_READ
                  | native.ACCESS_REMOTE_WRITE)
        segment = msg["segment"]
        made: list[Any] = []
        reply = []
        try:
            for nic_index, qpn, psn, gid_text, lid, mtu in msg["qps"]:
                if nic_index >= len(self._nics):
                    raise TransferError(f"rdma_connect names NIC {nic_index}; we have "
                                        f"{len(self._nics)}")
                nic = self._nics[nic_index]
                qp = nic.dev.create_qp(QP_DEPTH)
                made.append(qp)
                own_psn = random.getrandbits(24)
                qp.connect(qpn, psn, own_psn, min(mtu, verbs.mtu_bytes(nic.dev.active_mtu)),
                           verbs.gid_bytes(gid_text), nic.gid_index, lid, access)
                reply.append([qp.qp_num, own_psn])
        except BaseException as exc:
            for qp in made:
                qp.close()
            if isinstance(exc, (OSError, ValueError)) and not isinstance(exc, TransferError):
                raise TransferError(f"rdma_connect from {segment!r} failed here: {exc}") from exc
            raise
        self._keep(segment, made)
        return msgpack.packb(reply, use_bin_type=True)

    def _keep(self, segment: str, qps: list[Any]) -> None:
        """Keep ``qps`` for ``segment``, closing the oldest over the caps."""
        drop: list[Any] = []
        with self._lock:
            mine = self._accepted.setdefault(segment, [])
            mine.extend(qps)
            self._accepted_count += len(qps)
            while len(mine) > MAX_QPS_PER_SEGMENT:
                drop.append(mine.pop(0))
            while self._accepted_count - len(drop) > MAX_ACCEPTED_QPS:
                oldest = next(s for s, q in self._accepted.items() if q)
                drop.append(self._accepted[oldest].pop(0))
            self._accepted_count -= len(drop)
            self._accepted = {s: q for s, q in self._accepted.items() if q}
        for qp in drop:
            qp.close()

    # -- initiator side ------------------------------------------------------------------
    def supports(self, peer: Peer) -> bool:
        """The peer publishes RDMA NICs (and we have ours)."""
        return bool(peer.descriptor.rdma) and not self._closed

    def moves(self, local_kind: str, remote_kind: str) -> bool:
        """Host memory always; GPU memory once a GPU registration succeeded here (dma-buf
        or nvidia-peermem)."""
        if CUDA in (local_kind, remote_kind):
            return self._gpu_ok or local_kind == HOST
        return True

    def execute(self, peer: Peer, op: int, local_address: int, remote_address: int,
                nbytes: int) -> None:
        self.execute_many(peer, [(0, op, local_address, remote_address, nbytes)])

    def execute_many(self, peer: Peer, slices: list[tuple[int, int, int, int, int]]) -> None:
        """Post every slice on the path that will finish it soonest; wait for all."""
        if self._closed:
            raise TransferError("the rdma transport is closed")
        conn = self._connection(peer)
        try:
            t0 = time.monotonic()
            waiter, placement = self._post(peer, conn, slices)
            if not waiter.done.wait(self._timeout_s):
                self._break(conn, f"no completion within {self._timeout_s} s")
                waiter.done.wait(5.0)  # flushed by the error state
                if not waiter.done.is_set():
                    self._forget_waits(waiter)
                    exc = TransferTimeout(f"rdma to {peer.name!r}: no completion within "
                                          f"{self._timeout_s} s")
                    exc.completed = frozenset(p for p, s in waiter.status.items() if s == 0)  # type: ignore[attr-defined]
                    raise exc
            self._measure(waiter, placement, slices, time.monotonic() - t0)
            self._check(peer, conn, waiter, placement, slices)
        finally:
            self._release(conn)

    def _measure(self, waiter: _Waiter, placement: list[_Qp],
                 slices: list[tuple[int, int, int, int, int]], seconds: float) -> None:
        """Fold what each path moved for this batch into its smoothed rate."""
        moved: dict[_Path, int] = {}
        for pos, status in waiter.status.items():
            if status == 0:
                path = placement[pos].path
                moved[path] = moved.get(path, 0) + slices[pos][4]
        if seconds <= 0:
            return
        now = time.monotonic()
        with self._lock:
            for path, n in moved.items():
                if path.paused_until > now:   # this batch's time is its failure's, not its pace
                    continue
                sample = n / seconds
                path.rate = sample if not path.rate else 0.7 * path.rate + 0.3 * sample

    def path_stats(self) -> dict[str, dict[str, Any]]:
        """Per path (``rdma:<our NIC>-><peer>#<its NIC index>``): bytes moved, smoothed
        rate (GB/s), paused, failures."""
        now = time.monotonic()
        with self._lock:
            return {p.name: {"bytes": p.bytes, "gbps": p.rate / 1e9,
                             "paused": p.paused_until > now, "failures": p.failures}
                    for p in self._paths.values()}

    def _place(self, conn: _Connection, n: int) -> _Qp:
        """The queue pair for an ``n``-byte slice: on the path that finishes it soonest
        (bytes in flight over its rate; an unmeasured path counts as fast as the best),
        then its least loaded queue pair. Called under ``self._lock``."""
        rates = [q.path.rate for q in conn.qps if q.path.rate > 0]
        unmeasured = max(rates) if rates else 1.0
        qp = min(conn.qps, key=lambda q: ((q.path.inflight + n) / (q.path.rate or unmeasured),
                                          q.outstanding))
        qp.path.inflight += n
        qp.outstanding += n
        return qp

    def _post(self, peer: Peer, conn: _Connection, slices: list[tuple[int, int, int, int, int]]
              ) -> tuple[_Waiter, list[_Qp]]:
        """Place and post the slices (one chained list per queue pair); the waiter and
        each slice's queue pair."""
        desc = peer.descriptor
        work: list[tuple[int, bool, int, int, int, tuple[int, ...]]] = []
        for pos, (_, op, local, remote, n) in enumerate(slices):
            write = op == OP_WRITE
            region = desc.find(remote, n, write)
            if not region.rkeys:
                raise TransferError(f"segment {desc.name!r} registered 0x{region.address:x} "
                                    f"without rdma keys")
            work.append((pos, write, local, n, remote, region.rkeys))
        with self._lock:
            placement = [self._place(conn, w[3]) for w in work]
        by_qp: dict[int, tuple[_Qp, list[tuple]]] = {}
        try:
            for (pos, write, local, n, remote, rkeys), qp in zip(work, placement):
                by_qp.setdefault(id(qp), (qp, []))[1].append(
                    (pos, write, local, n, self._lkey(local, n, qp.nic.index), remote,
                     rkeys[qp.remote_nic]))
        except BaseException:
            with self._lock:
                for (_, _, _, n, _, _), qp in zip(work, placement):
                    qp.path.inflight -= n
                    qp.outstanding -= n
            raise
        waiter = _Waiter(len(slices))
        for qp, items in by_qp.values():
            wrs = []
            for item in items:
                if not qp.slots.acquire(timeout=self._timeout_s):  # QP_DEPTH per queue pair
                    break
                if not qp.nic.credits.acquire(timeout=self._timeout_s):
                    qp.slots.release()
                    break
                wr_id = next(self._ids)
                with self._lock:
                    self._pending[wr_id] = (waiter, item[0], qp, item[3])
                wrs.append((wr_id, *item[1:]))
            try:
                ok = qp.qp.post(wrs)
                why = "" if ok == len(items) else f"queue pair {qp.qp.qp_num} stayed full"
            except OSError as exc:
                ok, why = getattr(exc, "posted", 0), f"posting failed: {exc}"
            if why:
                with self._lock:
                    for wr in wrs[ok:]:
                        self._pending.pop(wr[0], None)
                    for item in items[ok:]:
                        qp.path.inflight -= item[3]
                        qp.outstanding -= item[3]
                for wr in wrs[ok:]:
                    qp.slots.release()
                    qp.nic.credits.release()
                for item in items[ok:]:
                    waiter.complete(item[0], -1)
                self._break(conn, why)
        return waiter, placement

    def _check(self, peer: Peer, conn: _Connection, waiter: _Waiter, placement: list[_Qp],
               slices: list[tuple[int, int, int, int, int]]) -> None:
        failed = {p: s for p, s in waiter.status.items() if s != 0}
        if not failed:
            return
        native = verbs.native()
        completed = frozenset(p for p, s in waiter.status.items() if s == 0)
        first = min(failed.items(), key=lambda kv: (kv[1] == native.WC_WR_FLUSH_ERR, kv[0]))
        pos, status = first
        what = native.WC_STATUS.get(status, f"status {status}") if status >= 0 else "not posted"
        if status not in (native.WC_WR_FLUSH_ERR, native.WC_REM_ACCESS_ERR, -1):
            self._pause(placement[pos].path, what)  # its own failure, not a refusal
        self._break(conn, what)
        _, op, _, remote, n = slices[pos]
        if status == native.WC_REM_ACCESS_ERR:
            # stale keys (the peer registered that memory again) or a real refusal?
            old = peer.descriptor.find(remote, n).rkeys
            try:
                fresh = peer.refresh().find(remote, n, op == OP_WRITE).rkeys
            except AddressError as exc:
                raise AddressError(f"segment {peer.name!r} refused rdma access to "
                                   f"0x{remote:x}+{n}: {exc}") from None
            if fresh == old:
                raise AddressError(f"segment {peer.name!r} refused rdma access to "
                                   f"0x{remote:x}+{n} ({what})")
        exc = TransferError(f"rdma to {peer.name!r} failed: {what} ({len(failed)} of "
                            f"{len(slices)} slices did not move)")
        exc.completed = completed  # type: ignore[attr-defined]
        raise exc

    def _poll(self, nic: _Nic) -> None:
        """Wake the batches whose completions arrive on ``nic``'s completion queue."""
        while not self._closed:
            try:
                done = nic.dev.poll(64, 0.2)
            except (OSError, RuntimeError) as exc:
                if not self._closed:
                    log.error("polling %s failed: %s", nic.dev.name, exc)
                return
            for wr_id, status, _, _ in done:
                with self._lock:
                    entry = self._pending.pop(wr_id, None)
                if entry is None:
                    continue
                waiter, pos, qp, n = entry
                with self._lock:
                    qp.path.inflight -= n
                    qp.outstanding -= n
                    if status == 0:
                        qp.path.bytes += n
                qp.slots.release()
                qp.nic.credits.release()
                waiter.complete(pos, status)

    def _forget_waits(self, waiter: _Waiter) -> None:
        """Give up on ``waiter``'s completions (their queue pairs are being destroyed)."""
        with self._lock:
            gone = [(w, e) for w, e in self._pending.items() if e[0] is waiter]
            for wr_id, _ in gone:
                del self._pending[wr_id]
        for _, (_, _, qp, n) in gone:
            with self._lock:
                qp.path.inflight -= n
                qp.outstanding -= n
            qp.slots.release()
            qp.nic.credits.release()

    # -- connections ---------------------------------------------------------------------
    def _live_pairs(self, key: str, remote: int) -> frozenset[tuple[int, int]]:
        """The (our NIC, its NIC) pairs to use for a peer with ``remote`` NICs: NIC k of
        ours with NIC k of its (modulo the smaller count), those not paused."""
        now = time.monotonic()
        pairs = {(k % len(self._nics), k % remote) for k in range(max(len(self._nics), remote))}
        with self._lock:
            return frozenset(p for p in pairs
                             if self._path(key, p).paused_until <= now)

    def _path(self, key: str, pair: tuple[int, int]) -> _Path:
        path = self._paths.get((key, *pair))
        if path is None:
            name = f"rdma:{self._nics[pair[0]].dev.name}->{key}#{pair[1]}"
            path = self._paths[(key, *pair)] = _Path(name, pair)
        return path

    def _pause(self, path: _Path, why: str) -> None:
        with self._lock:
            path.paused_until = time.monotonic() + self._path_pause_s
            path.failures += 1
            # measured before it failed: after its pause it is tried as an unmeasured path
            # (as fast as the best), else a low rate would keep every slice off it for good
            path.rate = 0.0
        log.warning("%s failed (%s): its slices go to the other paths, and it is tried "
                    "again in %.1f s", path.name, why, self._path_pause_s)

    def _connection(self, peer: Peer) -> _Connection:
        """Our connection to the peer over every live path; made again when a path was
        paused (a failure) or came back."""
        desc = peer.descriptor
        key = f"{desc.name}@{desc.pid}"
        wanted = self._live_pairs(key, len(desc.rdma))
        with self._lock:
            conn = self._conns.get(key)
            if conn is not None and not conn.broken and conn.pairs == wanted:
                conn.users += 1
                return conn
            gate = self._connecting.setdefault(key, threading.Lock())
        with gate:
            with self._lock:
                conn = self._conns.get(key)
                if conn is not None and not conn.broken and conn.pairs == wanted:
                    conn.users += 1
                    return conn
            if conn is not None and not conn.broken:
                self._retire(conn)  # a path came back (or went): a connection with all of them
            if not wanted:
                raise TransferError(f"every rdma path to {peer.name!r} is paused after "
                                    f"failures (tried again within {self._path_pause_s} s)")
            conn = self._connect(peer, key, wanted)
            with self._lock:
                self._conns[key] = conn
                conn.users += 1
            return conn

    def _connect(self, peer: Peer, key: str, pairs: frozenset[tuple[int, int]]) -> _Connection:
        if self._control is None:
            raise TransferError("the rdma transport has no control client (the engine "
                                "attaches one)")
        desc = peer.descriptor
        remote = desc.rdma
        qps: list[_Qp] = []
        entries, psns = [], []
        try:
            for local, far in sorted(pairs):
                nic = self._nics[local]
                with self._lock:
                    path = self._path(key, (local, far))
                for _ in range(self._qps_per_path):
                    qp = nic.dev.create_qp(QP_DEPTH)
                    qps.append(_Qp(nic, qp, far, path))
                    psn = random.getrandbits(24)
                    psns.append(psn)
                    entries.append([far, qp.qp_num, psn, nic.gid_text, nic.dev.lid,
                                    verbs.mtu_bytes(nic.dev.active_mtu)])
            raw = self._control.control(desc.host, desc.port, "rdma_connect",
                                        segment=self._segment or f"pid{os.getpid()}",
                                        qps=entries)
            answer = _parse_reply(raw, len(entries))
            for q, psn, (qpn, far_psn) in zip(qps, psns, answer):
                name, gid_text, lid, mtu = remote[q.remote_nic]
                q.qp.connect(qpn, far_psn, psn, min(mtu, verbs.mtu_bytes(q.nic.dev.active_mtu)),
                             verbs.gid_bytes(gid_text), q.nic.gid_index, lid, 0)
        except BaseException:
            for q in qps:
                q.qp.close()
            raise
        log.info("rdma connected to %s: %d queue pairs over %d NIC pairs", key, len(qps),
                 len(pairs))
        return _Connection(key, qps)

    def _retire(self, conn: _Connection) -> None:
        """Replace ``conn`` without an error: closed once its batches are done."""
        with self._lock:
            conn.broken = True
            if self._conns.get(conn.key) is conn:
                del self._conns[conn.key]
            close = conn.users == 0
        if close:
            conn.close()

    def attach(self, control: Any, segment: str) -> None:
        """The engine's control client (for ``rdma_connect``) and our segment name."""
        self._control = control
        self._segment = segment

    def _break(self, conn: _Connection, why: str) -> None:
        with self._lock:
            if conn.broken:
                return
            conn.broken = True
            if self._conns.get(conn.key) is conn:
                del self._conns[conn.key]
        log.warning("rdma connection to %s broken (%s): reconnecting on next use", conn.key, why)
        for q in conn.qps:
            try:
                q.qp.to_error()
            except (OSError, RuntimeError):
                pass

    def _release(self, conn: _Connection) -> None:
        with self._lock:
            conn.users -= 1
            close = conn.broken and conn.users == 0
        if close:
            conn.close()

    def forget(self, peer: Peer) -> None:
        name = peer.descriptor.name
        with self._lock:
            gone = [c for k, c in self._conns.items() if k.rpartition("@")[0] == name]
        for conn in gone:
            self._break(conn, "peer forgotten")
            self._release_if_idle(conn)

    def _release_if_idle(self, conn: _Connection) -> None:
        with self._lock:
            close = conn.users == 0
        if close:
            conn.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in self._pollers:
            t.join(timeout=2.0)
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
            accepted = [qp for qps in self._accepted.values() for qp in qps]
            self._accepted, self._accepted_count = {}, 0
            mrs = [mr for _, group in self._mrs.values() for mr in group]
            self._mrs, self._starts = {}, []
        for conn in conns:
            conn.close()
        for qp in accepted:
            qp.close()
        for mr in mrs:
            mr.close()
        self._close_nics()

    def _close_nics(self) -> None:
        for nic in self._nics:
            try:
                nic.dev.close()
            except OSError as exc:
                log.warning("closing RDMA device %s failed: %s", nic.dev.name, exc)


def _choose_gid(sysfs: str, device: str, port: dict, forced: int | None) -> nic_topology.Gid:
    """The GID for ``device``'s ``port``: sysfs's table (with RoCE types) where present,
    else the library's (no types)."""
    link, gids = nic_topology.port_gids(sysfs, device, port["port"])
    if not gids:
        link = port.get("link_layer", link)
        gids = [nic_topology.Gid(i, text, "", "") for i, text in port.get("gids", [])]
    try:
        return nic_topology.choose_gid(link, gids, forced)
    except ValueError as exc:
        raise verbs.RdmaUnavailable(f"RDMA device {device} port {port['port']}: {exc}") from None


def _parse_reply(raw: bytes, count: int) -> list[tuple[int, int]]:
    """The target's ``[[qpn, psn], ...]``, checked."""
    from ..protocol import unpack_bounded
    from ...errors import ProtocolError
    reply = unpack_bounded(raw, count + 1, max_array_len=max(count, 2), max_bin_len=0,
                           max_map_len=0)
    if (not isinstance(reply, list) or len(reply) != count
            or not all(isinstance(e, list) and len(e) == 2
                       and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 24
                               for x in e) for e in reply)):
        raise ProtocolError(f"malformed rdma_connect reply {reply!r:.200}")
    return [(e[0], e[1]) for e in reply]


