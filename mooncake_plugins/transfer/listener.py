"""A listening socket served by one accept thread and one thread per connection.

Shared by the engine's rpc port (rpc_server.py) and the store master's RPC
(store/rpc.py); subclasses implement ``_serve``. Lock order: ``_lock`` is a leaf.

What a peer can hold: at most ``max_connections`` connections (more are closed as soon as
they are accepted, with a warning); a connection may idle between frames for as long as
it likes (initiators pool them), but once a frame has started, every socket read or write
must make progress within ``frame_timeout_s`` or the connection is closed.

A connection its client gave up on is not dead by itself: the client's kernel may still
deliver what it had queued (resent when a link comes back), and this side, inside that
frame, would still act on it. :meth:`ConnectionServer.drop` ends one, named by its two
ends, and returns once its thread is done with it (see ``TcpTransport``'s use of it).
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import struct
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_FRAME_TIMEOUT_S = 30.0
_TRANSIENT_ACCEPT_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_ACCEPT_BACKOFF_S = 0.1
DROPPED_MEMORY_S = 120.0
"""How long a drop that found no such connection keeps closing one that turns up (it may
be in the accept queue still), the way TIME_WAIT outlives a connection."""
DROPPED_MAX = 4096
"""Dropped-before-accept connections remembered at most (the oldest are forgotten)."""

Route = tuple[str, int, str, int]  # client host, client port, server host, server port


def route_of(client: Any, server: Any) -> Route | None:
    """The two ends of an inet connection as a key, or None (not inet)."""
    if not (isinstance(client, tuple) and isinstance(server, tuple)):
        return None
    return (client[0], client[1], server[0], server[1])


def set_deadline(sock: socket.socket, timeout_s: float) -> None:
    """Blocking socket whose syscalls give up after ``timeout_s`` (SO_RCVTIMEO/SO_SNDTIMEO)."""
    sock.settimeout(None)
    sec = int(timeout_s)
    tv = struct.pack("ll", sec, int((timeout_s - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def idle_waiter(fd: int) -> Callable[[], None]:
    """A function that blocks until ``fd`` is readable (data, EOF or error), without deadline.

    Servers call it between frames, so the per-syscall deadline applies only to a frame
    that has started (poll, not select: fds above 1023 are fine).
    """
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return poller.poll


class ConnectionServer:
    """Accepts on ``host:port`` (0 picks a free port, see ``.port``) until ``close()``.

    Args:
        max_connections: connections served at once; more are closed on accept.
        frame_timeout_s: deadline of every socket read/write once a frame has started.
    """

    def __init__(self, host: str, port: int, name: str, backlog: int = 128,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S) -> None:
        if max_connections < 1 or not frame_timeout_s > 0:
            raise ValueError(f"max_connections must be >= 1 and frame_timeout_s > 0, got "
                             f"{max_connections}, {frame_timeout_s}")
        self._listener = socket.create_server((host, port), backlog=backlog)
        self.port: int = self._listener.getsockname()[1]
        self._name = name
        self.max_connections = max_connections
        self.frame_timeout_s = frame_timeout_s
        # each connection served: its route and an event set once its thread let go of it
        self._conns: dict[socket.socket, tuple[Route | None, threading.Event]] = {}
        self._routes: dict[Route, socket.socket] = {}
        self._dropped: dict[Route, float] = {}   # dropped before they were accepted: until
        self._lock = threading.Lock()
        self.closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept-{self.port}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _setup(self, conn: socket.socket) -> None:
        """Socket options of an accepted connection."""
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_deadline(conn, self.frame_timeout_s)

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        """Handle one connection until it ends (runs on its own thread; must not raise)."""
        raise NotImplementedError

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except OSError as exc:
                if self.closed:
                    return
                if exc.errno in _TRANSIENT_ACCEPT_ERRORS:  # e.g. out of fds: keep the port alive
                    log.error("%s port %d cannot accept now: %s", self._name, self.port, exc)
                    time.sleep(_ACCEPT_BACKOFF_S)
                    continue
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue
                log.error("%s port %d stops accepting: %s", self._name, self.port, exc)
                return
            try:
                route = route_of(addr, conn.getsockname())
            except OSError:  # already reset by the client
                conn.close()
                continue
            with self._lock:
                if self.closed:
                    conn.close()
                    return
                dropped = route in self._dropped and self._dropped[route] > time.monotonic()
                full = len(self._conns) >= self.max_connections
                if not (full or dropped):
                    self._conns[conn] = (route, threading.Event())
                    if route is not None:
                        self._routes[route] = conn
            if dropped:
                log.info("%s port %d closed a connection from %s unread: its client had "
                         "dropped it", self._name, self.port, addr)
                conn.close()
                continue
            if full:
                log.warning("%s port %d refused a connection from %s: %d connections are open "
                            "(the limit)", self._name, self.port, addr, self.max_connections)
                conn.close()
                continue
            try:
                self._setup(conn)
                threading.Thread(target=self._run, args=(conn, addr), daemon=True,
                                 name=f"{self._name}-{addr[1] if isinstance(addr, tuple) else addr}"
                                 ).start()
            except (OSError, RuntimeError) as exc:  # RuntimeError: no thread can be started
                log.error("%s port %d dropped the connection from %s: %s", self._name, self.port,
                          addr, exc)
                self._forget(conn).set()

    def _run(self, conn: socket.socket, addr: Any) -> None:
        try:
            self._serve(conn, addr)
        finally:
            self._forget(conn).set()

    def _forget(self, conn: socket.socket) -> threading.Event:
        """Close a connection whose thread is done (or never ran); its event, to set."""
        with self._lock:
            route, done = self._conns.pop(conn)
            if route is not None and self._routes.get(route) is conn:
                del self._routes[route]
        conn.close()
        return done

    def drop(self, client: tuple, server: tuple, timeout_s: float) -> bool:
        """End the connection from ``client`` to ``server`` (``(host, port)`` each, as the
        client saw them) and wait until its thread let go of it: from then on nothing it
        carries is acted on (what it sends later is refused by the kernel with a reset).

        Returns True when it was being served, False when there was none; then one that
        turns up within :data:`DROPPED_MEMORY_S` (still in the accept queue) is closed
        unread when accepted.

        Raises:
            TimeoutError: its thread did not let go within ``timeout_s``.
        """
        route = route_of(tuple(client), tuple(server))
        with self._lock:
            conn = self._routes.get(route)
            if conn is None:
                now = time.monotonic()
                for old in [r for r, until in self._dropped.items() if until <= now]:
                    del self._dropped[old]
                while len(self._dropped) >= DROPPED_MAX:
                    del self._dropped[next(iter(self._dropped))]
                self._dropped[route] = now + DROPPED_MEMORY_S
                return False
            done = self._conns[conn][1]
            try:  # wakes its thread in recv/send/poll; the socket stays open until it ends
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if not done.wait(timeout_s):
            raise TimeoutError(f"the connection from {client[0]}:{client[1]} was shut down but "
                               f"its thread did not end within {timeout_s:.1f} s")
        log.info("%s port %d dropped the connection from %s:%s at its client's request",
                 self._name, self.port, client[0], client[1])
        return True

    def close(self) -> None:
        """Stop accepting, shut every connection down and wait for the accept thread."""
        with self._lock:
            self.closed = True
            conns = list(self._conns)
        for s in (self._listener, *conns):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._listener.close()
        self._thread.join(timeout=5)
