"""The tcp transport: pooled client connections to peers' rpc ports, and the byte loops.

The peer's side is its engine's rpc port (``transfer/rpc_server.py``), which every engine
serves whatever its transports. The byte loops (:data:`io`), shared by both ends and by the
store RPC, are ``_native.tcp`` (GIL released, gathered sendmsg, recv straight into
registered memory); ``MOONCAKE_PUREPYTHON=1`` or a missing build selects the socket-module
fallback below, which keeps the same function names.

Initiator: the slices of one ``execute_many`` are pipelined on one pooled connection
(several requests sent before the oldest reply is read, :data:`PIPELINE_DEPTH` and
:data:`PIPELINE_NBYTES`), so the round trip of one slice overlaps the next one's bytes.

Multi-path: a peer that publishes more addresses for its rpc port (``paths`` of its
descriptor, one per NIC or network) is reached over all of them. Each task goes to the
path that would finish it first, given the bytes already in flight there and the rate it
delivered so far, so one transfer's slices spread over every path in proportion to what
each delivers. A path whose connection fails is paused for ``path_pause_s``: the failed
slices go to the other paths (the engine retries them), and the path is tried again when
the pause ends.

A failed connection with WRITEs unanswered is not dead by itself: our kernel still holds
the unsent part of the payload and resends it when the link is back (seconds later), and
the peer, still inside that frame, copies it into the region, after the retry of those
slices and even after a newer WRITE of the same bytes. So such a connection is aborted
here (a reset; the queued bytes are discarded), and before anything more moves to that
peer, on any path, the peer confirms with ``drop_connection`` that it ended its side (its
thread let go of it; what arrives later is refused). Until one of its addresses confirms,
transfers to that peer fail (see :meth:`TcpTransport._drop_failed`).
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ...config import spin_us
from ...errors import MooncakeError, ProtocolError, TransferError, from_code
from .. import memory, protocol
from ..listener import set_deadline
from ..peer import Peer
from ..segment import CUDA, HOST
from .base import OP_WRITE, PRIORITY_TCP, Transport, use_default

if TYPE_CHECKING:
    from ...config import EngineConfig

log = logging.getLogger(__name__)

SPIN_MAX_NBYTES = 64 << 10
"""Busy-poll for replies (config.spin_us) only around frames up to this size."""

PIPELINE_DEPTH = 8
"""Data frames in flight on one connection at most: requests sent before the oldest
reply is read. Bounded so that what the peer sends back unread stays far below a socket
buffer while a WRITE payload is still going out: at most this many replies of
``RESPONSE.size`` + ``MAX_ERROR_NBYTES`` (33 KiB at 8); READ payloads are never
outstanding then (see :meth:`TcpTransport.pipeline`)."""

PIPELINE_NBYTES = 2 << 20
"""Payload bytes in flight on one connection, past the first two frames. Two frames
hide the round trip between them; more only lets the socket buffers grow past the
caches, so the receiver copies cold data (one connection of 1 MiB slices on loopback,
a shared and noisy 2-core VM: 2 in flight 4.2-4.7 GB/s, 8 in flight 2.3-3.9, 16 in
flight 2.8)."""

TASK_NBYTES = 16 << 20
"""Bytes of slices the engine hands to one ``execute_many`` (one pipelined connection);
the engine gives each task at most an equal share of the batch per worker."""


class _PyIO:
    """Fallback of ``_native.tcp`` on the socket module (same names and semantics)."""

    @staticmethod
    def _recv_into(fd: int, mv: memoryview) -> None:
        s = socket.socket(fileno=fd)
        try:
            done, nbytes = 0, len(mv)
            while done < nbytes:
                n = s.recv_into(mv[done:], nbytes - done)
                if n == 0:
                    raise ConnectionResetError("peer closed the connection")
                done += n
        except BlockingIOError as exc:  # SO_RCVTIMEO expired
            raise TimeoutError("socket deadline passed") from exc
        finally:
            s.detach()

    @staticmethod
    def spin_until_readable(fd: int, spin_us: int) -> bool:
        s = socket.socket(fileno=fd)
        try:
            deadline = time.perf_counter() + spin_us / 1e6
            while True:
                try:
                    s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                    return True
                except (BlockingIOError, InterruptedError):
                    if time.perf_counter() >= deadline:
                        return False
                    os.sched_yield()  # as _native.tcp: let a peer on this core answer
                except OSError:
                    return True  # let the blocking read report it
        finally:
            s.detach()

    @classmethod
    def recv_into_address(cls, fd: int, address: int, nbytes: int) -> None:
        cls._recv_into(fd, memory.view(address, nbytes))

    @classmethod
    def recv_exact(cls, fd: int, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        cls._recv_into(fd, memoryview(buf))
        return bytes(buf)

    @classmethod
    def discard(cls, fd: int, nbytes: int) -> None:
        scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
        while nbytes:
            n = min(nbytes, len(scratch))
            cls._recv_into(fd, scratch[:n])
            nbytes -= n

    @staticmethod
    def send_frame(fd: int, header: bytes, address: int, nbytes: int) -> None:
        s = socket.socket(fileno=fd)
        try:
            parts = [memoryview(header)]
            if nbytes:
                parts.append(memory.view(address, nbytes, readonly=True))
            while parts:  # sendmsg may be short: finish the frame byte-exactly
                sent = s.sendmsg(parts)
                while parts and sent >= len(parts[0]):
                    sent -= len(parts[0])
                    parts.pop(0)
                if parts and sent:
                    parts[0] = parts[0][sent:]
        except BlockingIOError as exc:  # SO_SNDTIMEO expired
            raise TimeoutError("socket deadline passed") from exc
        finally:
            s.detach()


class _IO:
    """The byte loops in use: ``_native.tcp``'s or ``_PyIO``'s, rebound by :func:`use`."""

    NAMES = ("recv_into_address", "recv_exact", "discard", "send_frame", "spin_until_readable")


io: Any = _IO()
IMPLEMENTATION = ""


def use(native: bool) -> None:
    """Bind ``io`` (shared by the engine and the store RPC) to native or Python loops."""
    global IMPLEMENTATION
    src: Any = _PyIO
    if native:
        from ..._native import tcp as src
    for name in _IO.NAMES:
        setattr(io, name, getattr(src, name))
    IMPLEMENTATION = "native" if native else "python"


use_default(use, "tcp")


def tune(sock: socket.socket) -> None:
    """TCP_NODELAY and keepalive probes, for either end of a connection to an rpc port."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, val in ((socket.TCP_KEEPIDLE, 5), (socket.TCP_KEEPINTVL, 2), (socket.TCP_KEEPCNT, 3)):
        sock.setsockopt(socket.IPPROTO_TCP, opt, val)


class PathDown(TransferError):
    """The connection to one address of a peer failed (connect, send, receive)."""


_ABORT = struct.pack("ii", 1, 0)
"""SO_LINGER on, 0 s: close() resets the connection and discards what is unsent."""


class _Path:
    """One address of a peer's rpc port, as this client has seen it perform."""

    __slots__ = ("host", "port", "rate", "inflight", "bytes", "paused_until", "failures")

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.rate = 0.0          # bytes/s it delivered, smoothed (0: not measured yet)
        self.inflight = 0        # bytes handed to it and not finished
        self.bytes = 0           # bytes it moved
        self.paused_until = 0.0  # monotonic time before which it is left alone
        self.failures = 0


class _Pool:
    """Up to ``limit`` connections to one peer; callers borrow one per slice."""

    def __init__(self, host: str, port: int, limit: int, connect_timeout_s: float,
                 io_timeout_s: float) -> None:
        self.host, self.port, self.limit = host, port, limit
        self._connect_timeout_s = connect_timeout_s
        self._io_timeout_s = io_timeout_s
        self._idle: list[socket.socket] = []
        self._ends: dict[socket.socket, tuple[str, str]] = {}  # (ours, theirs), as connected
        self._count = 0
        self._cond = threading.Condition()
        self._closed = False

    def get(self) -> socket.socket:
        with self._cond:
            while not self._idle and self._count >= self.limit and not self._closed:
                self._cond.wait()
            if self._closed:
                raise TransferError(f"connection pool to {self.host}:{self.port} is closed")
            if self._idle:
                return self._idle.pop()
            self._count += 1
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self._connect_timeout_s)
        except OSError as exc:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise PathDown(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        try:
            tune(sock)
            set_deadline(sock, self._io_timeout_s)
            ends = (protocol.format_endpoint(sock.getsockname()),
                    protocol.format_endpoint(sock.getpeername()))
        except OSError as exc:
            self.put(sock, False)
            raise PathDown(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        with self._cond:
            self._ends[sock] = ends
        return sock

    def ends(self, sock: socket.socket) -> tuple[str, str] | None:
        """``(our end, the peer's end)`` of a connection of this pool, ``host:port`` each."""
        with self._cond:
            return self._ends.get(sock)

    def put(self, sock: socket.socket, healthy: bool) -> None:
        """Give a connection back; one that is not ``healthy`` is reset and closed."""
        with self._cond:
            if healthy and not self._closed:
                self._idle.append(sock)
            else:
                self._count -= 1
                self._ends.pop(sock, None)
                if not healthy:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _ABORT)
                    except OSError:
                        pass
                sock.close()
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for s in self._idle:
                self._ends.pop(s, None)
                s.close()
            self._count -= len(self._idle)
            self._idle.clear()
            self._cond.notify_all()


class TcpTransport(Transport):
    """Initiator side of tcp: one connection pool per peer; the slices of one
    ``execute_many`` are pipelined on one borrowed connection."""

    name = "tcp"
    priority = PRIORITY_TCP
    memory_kinds = frozenset({HOST})
    task_nbytes = TASK_NBYTES

    @classmethod
    def from_config(cls, config: "EngineConfig") -> "TcpTransport":
        return cls(config.connections_per_peer, config.connect_timeout_s,
                   config.transfer_timeout_s, config.path_pause_s)

    def __init__(self, connections_per_peer: int = 4, connect_timeout_s: float = 5.0,
                 transfer_timeout_s: float = 30.0, path_pause_s: float = 5.0) -> None:
        self._limit = connections_per_peer
        self._connect_timeout_s = connect_timeout_s
        self._transfer_timeout_s = transfer_timeout_s
        self._path_pause_s = path_pause_s
        self._paths: dict[tuple[str, int], _Path] = {}
        self._pools: dict[tuple[str, int], _Pool] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._spin_us = spin_us()
        # per peer (its first route): failed connections with WRITEs unanswered, (ours,
        # theirs), that it has not yet confirmed ended, and when to ask again after a
        # round that no address answered (_drop_failed); one round at a time
        self._failed: dict[tuple[str, int], set[tuple[str, str]]] = {}
        self._drop_again: dict[tuple[str, int], float] = {}
        self._drop_lock = threading.Lock()

    def supports(self, peer: Peer) -> bool:
        return True

    def moves(self, local_kind: str, remote_kind: str) -> bool:
        """Host memory here, to or from host or GPU memory of the peer (its tcp server
        stages GPU memory through pinned memory; local GPU memory goes through the
        engine's staged form of this transport)."""
        return local_kind == HOST and remote_kind in (HOST, CUDA)

    def _pool(self, host: str, port: int) -> _Pool:
        with self._lock:
            pool = self._pools.get((host, port))
            if pool is None:
                pool = self._pools[(host, port)] = _Pool(host, port, self._limit,
                                                          self._connect_timeout_s,
                                                          self._transfer_timeout_s)
            return pool

    def execute(self, peer: Peer, op: int, local_address: int, remote_address: int,
                nbytes: int) -> None:
        self._over_paths(peer, [(op, local_address, remote_address, nbytes)])

    def execute_many(self, peer: Peer, slices: list[tuple[int, int, int, int, int]]) -> None:
        self._over_paths(peer, [s[1:] for s in slices])

    def _over_paths(self, peer: Peer, items: list[tuple[int, int, int, int]]) -> None:
        """Pipeline ``items`` to the peer: on its one address, or on the path of its
        several that would finish them first (see the module docstring); never while a
        failed connection to it may still deliver a WRITE (:meth:`_drop_failed`)."""
        desc = peer.descriptor
        routes = [(desc.host, desc.port)] + [(a, desc.port) for a in desc.paths]
        if self._failed.get(routes[0]):
            self._drop_failed(peer, routes)
        if not desc.paths:
            try:
                self.pipeline(desc.host, desc.port, items)
            except (PathDown, ProtocolError) as exc:
                self._after_failure(peer, routes, exc)
                raise
            return
        nbytes = sum(item[3] for item in items)
        path = self._choose(routes, nbytes)
        t0 = time.perf_counter()
        done = False
        try:
            self.pipeline(path.host, path.port, items)
            done = True
        except (PathDown, ProtocolError) as exc:
            self._pause(path, peer.name, exc)
            self._after_failure(peer, routes, exc)
            raise
        finally:
            self._finished(path, nbytes, time.perf_counter() - t0, done)

    def _after_failure(self, peer: Peer, routes: list[tuple[str, int]],
                       exc: MooncakeError) -> None:
        """A pipeline failed: if WRITEs were unanswered on its connection, have the peer
        drop it now, before the engine retries them (left to the next transfer if no
        address of the peer answers)."""
        ends = getattr(exc, "unanswered_writes", None)
        if not ends:
            return
        with self._lock:
            self._failed.setdefault(routes[0], set()).add(ends)
        try:
            self._drop_failed(peer, routes)
        except MooncakeError:
            pass  # logged; the retries try again first

    def _drop_failed(self, peer: Peer, routes: list[tuple[str, int]]) -> None:
        """Have the peer end each failed connection of ours that had WRITEs unanswered
        (``drop_connection``, over any of its addresses, those not paused first) and
        forget those it confirmed. After a round that no address answered, the next is
        not tried before ``path_pause_s`` (the retries of a slice fail at once, as they
        would on a paused path).

        Raises:
            PathDown: no address confirmed one of them; nothing may move to this peer
            until one does, or what that connection still carries could land after it.
        """
        key = routes[0]
        with self._drop_lock:
            now = time.monotonic()
            with self._lock:
                failed = sorted(self._failed.get(key, ()))
                order = sorted(routes, key=lambda r: r in self._paths
                               and self._paths[r].paused_until > now)
            again = self._drop_again.get(key, 0.0)
            if failed and now < again:
                raise PathDown(f"segment {peer.name!r} has not confirmed that it ended "
                               f"{len(failed)} failed connection(s) whose WRITEs could still "
                               f"land; asking again in {again - now:.1f} s")
            for ours, theirs in failed:
                errors = []
                for host, port in order:
                    try:
                        self.control(host, port, "drop_connection", src=ours, dst=theirs)
                        break
                    except MooncakeError as exc:
                        errors.append(f"{host}:{port}: {exc}")
                else:
                    self._drop_again[key] = time.monotonic() + self._path_pause_s
                    log.warning("segment %s has not confirmed that it ended our failed "
                                "connection %s -> %s: nothing moves to it until it does (%s)",
                                peer.name, ours, theirs, "; ".join(errors))
                    raise PathDown(f"segment {peer.name!r} has not confirmed that it ended "
                                   f"the failed connection {ours} -> {theirs}, whose WRITEs "
                                   f"could still land: {'; '.join(errors)}")
                with self._lock:
                    left = self._failed.get(key, set())
                    left.discard((ours, theirs))
                    if not left:
                        self._failed.pop(key, None)
                self._drop_again.pop(key, None)
                log.info("segment %s ended our failed connection %s -> %s", peer.name, ours,
                         theirs)

    def _choose(self, routes: list[tuple[str, int]], nbytes: int) -> _Path:
        now = time.monotonic()
        with self._lock:
            paths = [self._paths.get(r) or self._paths.setdefault(r, _Path(*r)) for r in routes]
            live = [p for p in paths if p.paused_until <= now] or \
                [min(paths, key=lambda p: p.paused_until)]   # all paused: the first back
            rates = [p.rate for p in live if p.rate > 0]
            unmeasured = max(rates) if rates else 1.0   # as fast as the best: it gets a turn
            path = min(live, key=lambda p: (p.inflight + nbytes) / (p.rate or unmeasured))
            path.inflight += nbytes
            return path

    def _finished(self, path: _Path, nbytes: int, seconds: float, done: bool) -> None:
        with self._lock:
            path.inflight -= nbytes
            if done:
                path.bytes += nbytes
                if seconds > 0:
                    sample = nbytes / seconds
                    path.rate = sample if not path.rate else 0.7 * path.rate + 0.3 * sample

    def _pause(self, path: _Path, peer: str, exc: BaseException) -> None:
        with self._lock:
            path.paused_until = time.monotonic() + self._path_pause_s
            path.failures += 1
        log.warning("tcp path %s:%d to segment %s failed (%s): its slices go to the other "
                    "paths, and it is tried again in %.1f s", path.host, path.port, peer, exc,
                    self._path_pause_s)

    def path_stats(self) -> dict[str, dict[str, Any]]:
        """Per path of a multi-path peer: bytes moved, smoothed rate (GB/s), paused,
        failures."""
        now = time.monotonic()
        with self._lock:
            return {f"{p.host}:{p.port}": {"bytes": p.bytes, "gbps": p.rate / 1e9,
                                           "paused": p.paused_until > now,
                                           "failures": p.failures}
                    for p in self._paths.values()}

    def _exchange(self, host: str, port: int, what: str,
                  body: Callable[[int, int], tuple[int, bytes]]) -> tuple[int, bytes]:
        """Run ``body(fd, req_id)`` on a pooled connection to ``host:port``.

        The connection goes back to the pool only when ``body`` completed its exchange
        (even if the peer answered with an error status); socket errors become
        TransferError and malformed replies ProtocolError, and close the connection.
        """
        pool = self._pool(host, port)
        sock = pool.get()
        healthy = False
        try:
            result = body(sock.fileno(), next(self._ids))
            healthy = True
            return result
        except OSError as exc:
            err = PathDown(f"{what} with {host}:{port} failed: {exc!r}")
            err.ends = pool.ends(sock)  # type: ignore[attr-defined]
            raise err from exc
        except ProtocolError as exc:
            exc.ends = pool.ends(sock)  # type: ignore[attr-defined]
            raise
        finally:
            pool.put(sock, healthy)

    def pipeline(self, host: str, port: int, items: Sequence[tuple[int, int, int, int]]) -> None:
        """Move ``(op, local_address, remote_address, nbytes)`` items over one pooled
        connection to ``host:port``, several requests in flight (:data:`PIPELINE_DEPTH`,
        :data:`PIPELINE_NBYTES`).

        The peer answers in order; every reply is validated against the request it
        answers (id, status, length). A refused item (the peer's error reply) leaves the
        connection in step, and the others still run; a WRITE is not sent while a READ is
        outstanding (both sides could then block sending a payload to each other).

        Raises:
            The first refused item's error after every item ran (AddressError, ...), or
            TransferError/ProtocolError at once when the connection failed (it is reset,
            never pooled half-read). Either way the exception's ``completed`` is the set
            of positions in ``items`` that moved, so a caller retries only the others;
            ``unanswered_writes`` is the connection's ``(our end, the peer's end)`` when
            a WRITE on it was (partly) sent and not answered, else None: the peer may
            still write those bytes until it drops the connection.
        """
        completed: list[int] = []
        writes_out = 0
        refused: list[tuple[int, bytes]] = []
        spin = self._spin_us
        ids = self._ids

        def body(fd: int, rid: int) -> tuple[int, bytes]:
            nonlocal writes_out
            pending: collections.deque[tuple[int, int, int, int, int]] = collections.deque()
            reads_out = 0
            sent = 0
            inflight = 0
            while sent < len(items) or pending:
                while sent < len(items) and len(pending) < PIPELINE_DEPTH:
                    op, local, remote, n = items[sent]
                    if len(pending) >= 2 and inflight + n > PIPELINE_NBYTES:
                        break
                    if op == OP_WRITE:
                        if reads_out:
                            break  # a READ's payload may be on its way to us: drain first
                        writes_out += 1
                        io.send_frame(fd, protocol.encode_request(protocol.OP_WRITE, rid,
                                                                  remote, n), local, n)
                    else:
                        io.send_frame(fd, protocol.encode_request(protocol.OP_READ, rid,
                                                                  remote, n), 0, 0)
                        reads_out += 1
                    pending.append((sent, rid, op, local, n))
                    inflight += n
                    sent += 1
                    rid = next(ids)
                pos, want, op, local, n = pending.popleft()
                inflight -= n
                if spin and n <= SPIN_MAX_NBYTES:
                    io.spin_until_readable(fd, spin)
                writing = op == OP_WRITE
                status, length = protocol.decode_response(
                    io.recv_exact(fd, protocol.RESPONSE.size), want, 0 if writing else n)
                if status:
                    refused.append((status, io.recv_exact(fd, length)))
                else:
                    if not writing:
                        io.recv_into_address(fd, local, n)
                    completed.append(pos)
                if writing:
                    writes_out -= 1
                else:
                    reads_out -= 1
            return 0, b""

        try:
            self._exchange(host, port, "transfer", body)
            if refused:
                status, text = refused[0]
                raise from_code(status, f"peer {host}:{port} refused the request: "
                                        f"{text.decode('utf-8', 'replace')}")
        except MooncakeError as exc:
            exc.completed = frozenset(completed)  # type: ignore[attr-defined]
            exc.unanswered_writes = (getattr(exc, "ends", None)  # type: ignore[attr-defined]
                                     if writes_out else None)
            raise

    def control(self, host: str, port: int, cmd: str, **fields: Any) -> bytes:
        """Send a control command to ``host:port`` and return the reply payload."""
        payload = protocol.encode_control(cmd, **fields)

        def body(fd: int, rid: int) -> tuple[int, bytes]:
            header = protocol.encode_request(protocol.OP_CONTROL, rid, 0, 0, len(payload))
            io.send_frame(fd, header + payload, 0, 0)
            magic, status, got, n = protocol.RESPONSE.unpack(io.recv_exact(fd, protocol.RESPONSE.size))
            if magic != protocol.MAGIC or got != rid or n > protocol.MAX_CONTROL_NBYTES * 16:
                raise ProtocolError(f"bad control response from {host}:{port}")
            return status, io.recv_exact(fd, n)

        status, reply = self._exchange(host, port, f"control {cmd!r}", body)
        if status:
            raise from_code(status, f"{host}:{port}: {reply.decode('utf-8', 'replace')}")
        return reply

    def forget(self, peer: Peer) -> None:
        desc = peer.descriptor
        routes = [(desc.host, desc.port)] + [(a, desc.port) for a in desc.paths]
        with self._lock:
            pools = [self._pools.pop(r, None) for r in routes]
            for r in routes:
                self._paths.pop(r, None)
        for pool in pools:
            if pool:
                pool.close()

    def close(self) -> None:
        with self._lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for p in pools:
            p.close()
