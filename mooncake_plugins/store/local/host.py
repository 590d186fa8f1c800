"""The host side: a :class:`StoreClient` serving the dummy clients of this machine."""

from __future__ import annotations

import bisect
import fcntl
import logging
import mmap
import os
import secrets
import socket
import stat
import struct
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import msgpack

from ...errors import InvalidParams, MooncakeError, ProtocolError
from ...transfer.protocol import unpack_bounded
from ..client import ReplicateConfig, StoreClient
from ..rpc import ListOf, RpcServer
from .common import (CONFIG_SCHEMA, CONTROL_MSG_NBYTES, DEFAULT_PORT, MAX_MAPPING_NBYTES,
                     MAX_MAPPINGS, MAX_SESSIONS, PARTS_SCHEMA, REQUIRED_SEALS, map_fd, unflatten,
                     unmap, wire_error)

log = logging.getLogger(__name__)

CONTROL_SEND_TIMEOUT_S = 30
"""A control reply that cannot be sent for this long ends the session."""


def peer_allowed(uid: int) -> bool:
    """Whether a control-socket peer of ``uid`` may be served: this process's user, or root.

    (The socket's abstract name has no file permissions to keep other users out.)
    """
    return uid in (os.getuid(), 0)


@dataclass(eq=False)
class _Mapping:
    """One memfd of a dummy, mapped here at ``host_base`` and registered with the host's engine."""

    dummy_base: int
    nbytes: int
    host_base: int
    users: int = 0


class _Session:
    """The mappings of one dummy; calls pin the mappings they use while they run."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._cond = threading.Condition()
        self._bases: list[int] = []            # sorted dummy bases
        self._maps: list[_Mapping] = []        # same order
        self.closed = False

    def add(self, fd: int, base: int, nbytes: int) -> None:
        """Map the dummy's memfd ``fd`` (its copy stays the caller's to close).

        Mapping and registering happen outside the session's lock, so calls of this
        session (``pinned``) go on meanwhile.
        """
        if not 0 < base < 1 << 64 or not 0 < nbytes <= MAX_MAPPING_NBYTES:
            raise InvalidParams(f"bad mapping base 0x{base:x} / size {nbytes}")
        try:
            st = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise InvalidParams(f"the descriptor is not a sealed memfd: {exc}") from None
        if not stat.S_ISREG(st.st_mode) or st.st_size < nbytes or \
                seals & REQUIRED_SEALS != REQUIRED_SEALS:
            raise InvalidParams("the descriptor must be a memfd of at least the mapped size, "
                                "sealed against shrinking")
        if st.st_blksize != mmap.PAGESIZE:  # hugetlb: lengths would have to be huge-page multiples
            raise InvalidParams(f"the memfd has {st.st_blksize}-byte pages; only "
                                f"{mmap.PAGESIZE}-byte (not hugetlb) memory can be shared")
        with self._cond:
            self._slot(base, nbytes)  # fail early; checked again once mapped
        address = map_fd(fd, nbytes)
        try:
            self._engine.register_address(address, nbytes, private=True)
        except BaseException:
            unmap(address, nbytes)
            raise
        try:
            with self._cond:
                i = self._slot(base, nbytes)
                self._bases.insert(i, base)
                self._maps.insert(i, _Mapping(base, nbytes, address))
        except BaseException:
            self._release(_Mapping(base, nbytes, address))
            raise

    def _slot(self, base: int, nbytes: int) -> int:
        """Where a mapping of ``[base, base+nbytes)`` goes (under ``_cond``)."""
        if self.closed:
            raise InvalidParams("session is closed")
        if len(self._maps) >= MAX_MAPPINGS:
            raise InvalidParams(f"a session holds at most {MAX_MAPPINGS} mappings")
        i = bisect.bisect_right(self._bases, base)
        if (i and self._bases[i - 1] + self._maps[i - 1].nbytes > base) or \
                (i < len(self._bases) and base + nbytes > self._bases[i]):
            raise InvalidParams(f"0x{base:x}+{nbytes} overlaps a mapping of this session")
        return i

    def remove(self, base: int) -> None:
        with self._cond:
            i = bisect.bisect_left(self._bases, base)
            if i == len(self._bases) or self._bases[i] != base:
                raise InvalidParams(f"0x{base:x} is not the base of a mapping of this session")
            del self._bases[i]
            m = self._maps.pop(i)
            self._cond.wait_for(lambda: m.users == 0)
        self._release(m)

    def close(self) -> None:
        """Drop every mapping, once the calls using them returned."""
        with self._cond:
            self.closed = True
            maps, self._maps, self._bases = self._maps, [], []
            self._cond.wait_for(lambda: all(m.users == 0 for m in maps))
        for m in maps:
            self._release(m)

    def _release(self, m: _Mapping) -> None:
        try:
            self._engine.unregister(m.host_base, wait_s=30.0)
        except MooncakeError as exc:  # memory stays mapped rather than unmapped while in use
            log.error("could not release the mapping 0x%x of a dummy client: %s", m.dummy_base, exc)
            return
        unmap(m.host_base, m.nbytes)

    @contextmanager
    def pinned(self, parts: list[list[tuple[int, int]]]) -> Iterator[list[list[tuple[int, int]]]]:
        """``parts`` translated to host addresses; the mappings stay until the block ends."""
        used: list[_Mapping] = []
        try:
            with self._cond:
                if self.closed:
                    raise InvalidParams("session is closed")
                out = [[self._translate(a, n, used) for a, n in p] for p in parts]
            yield out
        finally:
            if used:
                with self._cond:
                    for m in used:
                        m.users -= 1
                    self._cond.notify_all()

    def _translate(self, address: int, nbytes: int, used: list[_Mapping]) -> tuple[int, int]:
        if nbytes == 0:
            return 0, 0
        i = bisect.bisect_right(self._bases, address) - 1
        m = self._maps[i] if i >= 0 else None
        if m is None or address + nbytes > m.dummy_base + m.nbytes:
            raise InvalidParams(f"0x{address:x}+{nbytes} is outside the registered buffers "
                                "(use alloc_from_mem_pool and register_buffer)")
        m.users += 1
        used.append(m)
        return m.host_base + (address - m.dummy_base), nbytes


class DummyHost:
    """Serves dummy clients on ``host:port`` (0: a free port, see ``.port``) from ``client``.

    ``client`` stays the caller's: :meth:`close` stops serving and releases the dummies'
    mappings, but does not close it.
    """

    def __init__(self, client: StoreClient, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 max_sessions: int = MAX_SESSIONS) -> None:
        self.client = client
        self.max_sessions = max_sessions
        self._sessions: dict[str, _Session] = {}
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.control_name = f"\0mooncake-plugins-dummy-host-{os.getpid()}-{secrets.token_hex(8)}"
        self._control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._control.bind(self.control_name)
            self._control.listen(64)
            self._rpc = RpcServer(host, port, self._handlers())
        except BaseException:
            self._control.close()
            raise
        self.port = self._rpc.port
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"mc-dummy-host-{self.port}")
        self._accept_thread.start()

    # -- control channel ------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._control.accept()
            except OSError as exc:
                if not self._closed:
                    log.error("dummy host stops accepting: %s", exc)
                return
            with self._lock:
                refused = self._closed or len(self._conns) >= self.max_sessions
                if not refused:
                    self._conns.add(conn)
            if refused:
                log.warning("refused a dummy client: %d are connected (the limit)", self.max_sessions)
                conn.close()
                continue
            t = threading.Thread(target=self._serve_session, args=(conn,), daemon=True,
                                 name="mc-dummy-session")
            with self._lock:
                self._threads.add(t)
            t.start()

    def _serve_session(self, conn: socket.socket) -> None:
        cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        pid, uid, _ = struct.unpack("3i", cred)
        if not peer_allowed(uid):
            log.error("refused a dummy client (pid %d) of uid %d: this host serves uid %d "
                      "(and root) only", pid, uid, os.getuid())
            conn.close()
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            return
        token = secrets.token_hex(16)
        session = _Session(self.client.engine)
        # replies are tiny, but a dummy that never reads them must not hold this thread
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", CONTROL_SEND_TIMEOUT_S, 0))
        with self._lock:
            self._sessions[token] = session
        try:
            conn.sendall(msgpack.packb({"session": token}))
            log.info("dummy client (pid %d) connected", pid)
            while self._control_step(conn, session):
                pass
            log.info("dummy client (pid %d) disconnected", pid)
        except ProtocolError as exc:
            log.error("closing the control connection of dummy client pid %d: malformed "
                      "message: %s", pid, exc)
        except OSError as exc:
            if not self._closed:
                log.warning("control connection of dummy client pid %d failed: %s", pid, exc)
        except Exception:  # never let one dummy take the host down
            log.exception("closing the control connection of dummy client pid %d", pid)
        finally:
            conn.close()
            with self._lock:
                self._sessions.pop(token, None)
            session.close()
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())

    def _control_step(self, conn: socket.socket, session: _Session) -> bool:
        """Serve one control message; False at end of connection."""
        data, fds, flags, _ = socket.recv_fds(conn, CONTROL_MSG_NBYTES, 1)
        try:
            if not data and not fds:
                return False
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise ProtocolError("control message too long or with too many descriptors")
            msg = unpack_bounded(data, 1, max_map_len=4, max_str_len=16)
            if not isinstance(msg, dict) or msg.get("op") not in ("map", "unmap"):
                raise ProtocolError("a control message is a map with op 'map' or 'unmap'")
            want = {"op", "base", "nbytes"} if msg["op"] == "map" else {"op", "base"}
            if set(msg) != want or any(type(msg[k]) is not int for k in want - {"op"}):
                raise ProtocolError(f"{msg['op']} takes exactly {sorted(want)} (ints)")
            if len(fds) != (1 if msg["op"] == "map" else 0):
                raise ProtocolError(f"{msg['op']} carries {len(fds)} descriptors")
            try:
                if msg["op"] == "map":
                    session.add(fds[0], msg["base"], msg["nbytes"])
                else:
                    session.remove(msg["base"])
                reply = {"code": 0}
            except (MooncakeError, OSError, ValueError) as exc:  # refused: the session goes on
                code = exc.code if isinstance(exc, MooncakeError) else InvalidParams.code
                reply = {"code": code, "error": str(exc)}
            conn.sendall(msgpack.packb(reply))
            return True
        finally:
            for fd in fds:
                os.close(fd)

    # -- rpc --------------------------------------------------------------------------------
    def _session(self, token: str) -> _Session:
        with self._lock:
            session = self._sessions.get(token)
        if session is None:
            raise InvalidParams("unknown or closed dummy session")
        return session

    def _handlers(self) -> dict:
        c = self.client

        def hello() -> dict:
            return {"control": self.control_name, "segment": c.segment_name}

        def put(session: str, keys: list, counts: list, addrs: list, sizes: list, config: dict,
                upsert: bool) -> list:
            parts = unflatten(keys, counts, addrs, sizes)
            cfg = ReplicateConfig(**config)
            with self._session(session).pinned(parts) as local:
                return [wire_error(e) for e in c.batch_put_from_parts(keys, local, cfg, upsert)]

        def get_into(session: str, keys: list, counts: list, addrs: list, sizes: list) -> list:
            parts = unflatten(keys, counts, addrs, sizes)
            with self._session(session).pinned(parts) as local:
                out = c.batch_get_into_parts(keys, local)
            return [[0, r] if isinstance(r, int) else wire_error(r) for r in out]

        def replicas(keys: list) -> list:
            return [wire_error(r) if isinstance(r, Exception) else [0, list(r)]
                    for r in c.replicas(keys)]

        def remove(keys: list, force: bool) -> list:
            return [wire_error(e) for e in c.batch_remove(keys, force)]

        return {
            "hello": ({}, hello),
            "put": ({"session": str, **PARTS_SCHEMA, "config": CONFIG_SCHEMA, "upsert": bool}, put),
            "get_into": ({"session": str, **PARTS_SCHEMA}, get_into),
            "replicas": ({"keys": ListOf(str)}, replicas),
            "exist": ({"keys": ListOf(str)}, c.batch_exists),
            "remove": ({"keys": ListOf(str), "force": bool}, remove),
            "remove_by_regex": ({"pattern": str, "force": bool}, c.remove_by_regex),
            "remove_all": ({"force": bool}, c.remove_all),
        }

    def close(self) -> None:
        """Stop serving; every dummy's mappings are released."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        self._rpc.close()
        for s in (self._control, *conns):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._control.close()
        self._accept_thread.join(5)
        with self._lock:
            threads = list(self._threads)
        for t in threads:  # each releases its session's mappings as its connection ends
            t.join(30)
