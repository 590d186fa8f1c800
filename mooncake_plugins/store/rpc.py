"""The master's RPC: length-prefixed msgpack frames over TCP, every field validated.

Request  ``u32 length | msgpack [req_id, method, {arg: value}]``
Response ``u32 length | msgpack [req_id, code, result-or-message]`` (code 0 = ok, else the
original ErrorCode). Batch methods take lists, so a batch costs one round trip. A frame
that fails validation closes its connection with a logged error; the server keeps going.

Server thread model: one accept thread, one thread per connection (blocking I/O with the
GIL released in ``_native.tcp``). Client: a pool of connections, one per calling thread.
"""

from __future__ import annotations

import itertools
import logging
import socket
import struct
import threading
from typing import Any, Callable

import msgpack

from ..config import spin_us
from ..errors import (InvalidParams, MooncakeError, ProtocolError, RpcFailed, RpcTimeout,
                      store_error)
from ..transfer.listener import (DEFAULT_FRAME_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, ConnectionServer,
                                 idle_waiter, set_deadline)
from ..transfer.protocol import unpack_bounded
from ..transfer.transports.tcp import io

log = logging.getLogger(__name__)

LENGTH = struct.Struct("<I")
MAX_FRAME_NBYTES = 64 << 20
MAX_BATCH = 1 << 16
MAX_REQUEST_CONTAINERS = 16
"""Maps and arrays in one request (the largest schema, put_reserved, has 7)."""
MAX_REQUEST_MAP_LEN = 64
RECV_CHUNK_NBYTES = 1 << 20
"""Frames are received in chunks of this size: memory follows the bytes that arrived,
not the length a peer announced."""


class ListOf:
    """Schema element: a list of ``item`` values, at most ``MAX_BATCH`` long."""

    def __init__(self, item: Any) -> None:
        self.item = item


Schema = dict[str, Any]


class _Invalid(Exception):
    """A value that does not match its schema: where under the argument (``path``), and why."""

    def __init__(self, what: str) -> None:
        self.path, self.what = "", what


def _int_ok(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < (1 << 64)


def _check(value: Any, spec: Any) -> None:
    """Raise _Invalid unless ``value`` matches ``spec`` (no string is built on success)."""
    if isinstance(spec, ListOf):
        if not isinstance(value, list) or len(value) > MAX_BATCH:
            raise _Invalid(f"must be a list of at most {MAX_BATCH} items")
        item = spec.item
        if item is int:
            ok = all(map(_int_ok, value))
        elif isinstance(item, type):
            ok = all(isinstance(v, item) for v in value)
        else:
            ok = False
        if ok:
            return
        for i, v in enumerate(value):
            try:
                _check(v, item)
            except _Invalid as exc:
                exc.path = f"[{i}]{exc.path}"
                raise
    elif isinstance(spec, dict):
        if not isinstance(value, dict) or not value.keys() <= spec.keys():
            raise _Invalid(f"must be a map with keys among {sorted(spec)}")
        for k, v in value.items():
            try:
                _check(v, spec[k])
            except _Invalid as exc:
                exc.path = f".{k}{exc.path}"
                raise
    elif spec is int:
        if not _int_ok(value):
            raise _Invalid("must be an int")
    elif isinstance(spec, tuple):  # any one of these specs (so int there refuses bool too)
        for option in spec:
            try:
                _check(value, option)
                return
            except _Invalid:
                continue
        raise _Invalid(f"must be one of {[getattr(o, '__name__', o) for o in spec]}")
    elif not isinstance(value, spec):
        raise _Invalid(f"must be {getattr(spec, '__name__', spec)}")


def validate_args(args: Any, schema: Schema, method: str) -> dict[str, Any]:
    """Every argument present, of the declared type, and nothing else."""
    if not isinstance(args, dict) or set(args) != set(schema):
        raise ProtocolError(f"{method} takes exactly {sorted(schema)}")
    for name, spec in schema.items():
        try:
            _check(args[name], spec)
        except _Invalid as exc:
            raise ProtocolError(f"{method}.{name}{exc.path} {exc.what}") from None
    return args


def _pack(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return LENGTH.pack(len(body)) + body


def _recv_frame(fd: int) -> bytes:
    """The body of one length-prefixed frame (ProtocolError for a bad length)."""
    (n,) = LENGTH.unpack(io.recv_exact(fd, LENGTH.size))
    if not 0 < n <= MAX_FRAME_NBYTES:
        raise ProtocolError(f"frame of {n} bytes is outside (0, {MAX_FRAME_NBYTES}]")
    if n <= RECV_CHUNK_NBYTES:
        return io.recv_exact(fd, n)
    chunks = []
    while n:
        chunks.append(io.recv_exact(fd, min(n, RECV_CHUNK_NBYTES)))
        n -= len(chunks[-1])
    return b"".join(chunks)


def _unpack(fd: int) -> Any:
    """One reply frame, decoded (client side: the master is trusted)."""
    try:
        return msgpack.unpackb(_recv_frame(fd), raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"frame is not valid msgpack: {exc}") from None


def _unpack_request(fd: int) -> Any:
    """One request frame, decoded within the limits a valid request never reaches."""
    return unpack_bounded(_recv_frame(fd), MAX_REQUEST_CONTAINERS, max_array_len=MAX_BATCH,
                          max_map_len=MAX_REQUEST_MAP_LEN)


Handler = tuple[Schema, Callable[..., Any]]


class RpcServer(ConnectionServer):
    """Serves ``handlers`` (method -> (schema, fn(**args))) on ``host:port``.

    ``fn`` raises StoreError for an error reply; anything else (a result that cannot be
    encoded included) is logged as an internal error (-1) and the connection stays open.
    ``max_connections`` and ``frame_timeout_s``: see :class:`ConnectionServer`.
    """

    def __init__(self, host: str, port: int, handlers: dict[str, Handler],
                 gate: Callable[[], None] | None = None, *,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S) -> None:
        super().__init__(host, port, "mc-rpc", backlog=256, max_connections=max_connections,
                         frame_timeout_s=frame_timeout_s)
        self._handlers = handlers
        self._gate = gate
        self._spin_us = spin_us()
        self._clients_lock = threading.Lock()
        self._client_of: dict[int, str] = {}   # open connection -> client_id it last named
        self.start()

    def connected_clients(self) -> set[str]:
        """Client ids named in requests on connections that are still open."""
        with self._clients_lock:
            return set(self._client_of.values())

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        fd = conn.fileno()
        wait_idle = idle_waiter(fd)
        try:
            while True:
                # a client in a loop sends its next call right away
                if not (self._spin_us and io.spin_until_readable(fd, self._spin_us)):
                    wait_idle()
                frame = _unpack_request(fd)
                if (not isinstance(frame, list) or len(frame) != 3 or not isinstance(frame[0], int)
                        or not isinstance(frame[1], str)):
                    raise ProtocolError("request must be [req_id, method, args]")
                req_id, method, args = frame
                handler = self._handlers.get(method)
                if handler is None:
                    raise ProtocolError(f"unknown method {method!r}")
                schema, fn = handler
                validate_args(args, schema, method)
                client_id = args.get("client_id")
                if isinstance(client_id, str):
                    with self._clients_lock:
                        self._client_of[id(conn)] = client_id
                try:
                    if self._gate is not None:
                        self._gate()
                    reply = _pack([req_id, 0, fn(**args)])
                except MooncakeError as exc:  # StoreErrors carry the original's codes
                    reply = _pack([req_id, exc.code if exc.code < 0 else -1, str(exc)])
                except Exception as exc:  # a bug in a handler must not kill the connection
                    log.exception("%s from %s failed", method, addr)
                    reply = _pack([req_id, -1, f"internal error: {exc!r}"])
                io.send_frame(fd, reply, 0, 0)
        except ProtocolError as exc:
            log.error("closing rpc connection from %s: malformed frame: %s", addr, exc)
        except TimeoutError:
            log.warning("closing rpc connection from %s: a frame made no progress for %.1f s",
                        addr, self.frame_timeout_s)
        except ConnectionError:
            pass
        except OSError as exc:
            if not self.closed:
                log.warning("rpc connection from %s failed: %s", addr, exc)
        except Exception:  # never let one connection take the process down
            log.exception("closing rpc connection from %s after an unexpected error", addr)
        finally:
            with self._clients_lock:
                self._client_of.pop(id(conn), None)


def split_address(address: str) -> tuple[str, int]:
    """``(host, port)`` of a master's ``host:port`` (an IPv6 host in brackets or not).

    Raises:
        InvalidParams: not ``host:port`` with a port in 1..65535.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidParams(f"master address must be host:port or etcd://..., got {address!r}")
    return host.strip("[]"), int(port)


class RpcClient:
    """Calls one server; thread-safe (each call borrows a pooled connection)."""

    def __init__(self, host: str, port: int, timeout_s: float = 10.0) -> None:
        self.host, self.port = host, port
        self._timeout_s = timeout_s
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self._spin_us = spin_us()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _connect(self) -> socket.socket:
        try:
            s = socket.create_connection((self.host, self.port), timeout=self._timeout_s)
        except OSError as exc:
            raise RpcFailed(f"cannot reach master {self.address}: {exc}") from exc
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_deadline(s, self._timeout_s)
        return s

    def call(self, method: str, **args: Any) -> Any:
        """Send one request and wait for its reply (blocking).

        Raises:
            StoreError subclass for an error reply, RpcTimeout, RpcFailed.
        """
        with self._lock:
            if self._closed:
                raise RpcFailed(f"rpc client to {self.address} is closed")
            s = self._idle.pop() if self._idle else None
        if s is None:
            s = self._connect()
        rid = next(self._ids)
        healthy = False
        try:
            fd = s.fileno()
            io.send_frame(fd, _pack([rid, method, args]), 0, 0)
            if self._spin_us:
                io.spin_until_readable(fd, self._spin_us)
            reply = _unpack(fd)
            if (not isinstance(reply, list) or len(reply) != 3 or reply[0] != rid
                    or not isinstance(reply[1], int)):
                raise ProtocolError(f"bad reply to {method}")
            healthy = True
        except TimeoutError as exc:
            raise RpcTimeout(f"{method} to master {self.address} timed out") from exc
        except (OSError, ProtocolError) as exc:
            raise RpcFailed(f"{method} to master {self.address} failed: {exc}") from exc
        finally:
            if healthy and not self._closed:
                with self._lock:
                    self._idle.append(s)
            else:
                s.close()
        if reply[1] != 0:
            raise store_error(reply[1], str(reply[2]))
        return reply[2]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()
