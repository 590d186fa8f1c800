"""A listening socket served by one accept thread and one thread per connection.

Shared by the engine's rpc port (transports/tcp.py) and the store master's RPC
(store/rpc.py); subclasses implement ``_serve``. Lock order: ``_lock`` is a leaf.
"""

from __future__ import annotations

import socket
import threading
from typing import Any


class ConnectionServer:
    """Accepts on ``host:port`` (0 picks a free port, see ``.port``) until ``close()``."""

    def __init__(self, host: str, port: int, name: str, backlog: int = 128) -> None:
        self._listener = socket.create_server((host, port), backlog=backlog)
        self.port: int = self._listener.getsockname()[1]
        self._name = name
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

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        """Handle one connection until it ends (runs on its own thread; must not raise)."""
        raise NotImplementedError

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return  # listener closed
            with self._lock:
                if self.closed:
                    conn.close()
                    return
                self._conns.add(conn)
            self._setup(conn)
            threading.Thread(target=self._run, args=(conn, addr), daemon=True,
                             name=f"{self._name}-{addr[1] if isinstance(addr, tuple) else addr}").start()

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
