"""A listening socket served by one accept thread and one thread per connection.

Shared by the engine's rpc port (rpc_server.py) and the store master's RPC
(store/rpc.py); subclasses implement ``_serve``. Lock order: ``_lock`` is a leaf.

What a peer can hold: at most ``max_connections`` connections (more are closed as soon as
they are accepted, with a warning); a connection may idle between frames for as long as
it likes (initiators pool them), but once a frame has started, every socket read or write
must make progress within ``frame_timeout_s`` or the connection is closed.
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
        self._conns: set[socket.socket] = set()
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
            with self._lock:
                if self.closed:
                    conn.close()
                    return
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
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
                with self._lock:
                    self._conns.discard(conn)
                conn.close()

    def _run(self, conn: socket.socket, addr: Any) -> None:
        try:
            self._serve(conn, addr)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

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
