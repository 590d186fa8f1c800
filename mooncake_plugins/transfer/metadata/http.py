"""HTTP metadata backend: a urllib client and the embedded metadata server.

Wire protocol (the original Mooncake http metadata server's): one route, ``/metadata``,
with the key in the ``key`` query parameter.

- ``GET /metadata?key=K``: 200 with the value as body, or 404.
- ``PUT /metadata?key=K`` with the value as body: 200. A key containing ``rpc_meta`` is
  written once: the same value again is 200 ("metadata unchanged"), another one 400.
- ``DELETE /metadata?key=K``: 200, or 404 when the key does not exist.
- ``GET /health``: 200 ``OK`` (a liveness probe, as the original's master serves).
- No ``key`` (or an invalid one): 400; any other method: 405; another path: 404.
- A body over 16 MiB: 413; a malformed ``Content-Length``: 400; none at all: 411.
- A PUT that would take the stored keys and values (and the bodies being received) over
  the server's ``max_nbytes``: 507. A connection over ``max_connections``: 503, closed.

Additions of ours, which the original server does not have:

- ``PUT /metadata?key=K&ttl=S`` (S whole seconds >= 1): the key is dropped S seconds after
  its last PUT (its writer renews it; a crashed writer's key goes). A PUT without ``ttl``
  makes the key permanent again. A bad ``ttl``: 400.

- ``GET /metadata?prefix=P``: 200 with ``Content-Type: application/msgpack`` and a msgpack
  array of ``[key (str), value (bin)]`` pairs, sorted by key, for every key starting with
  ``P``; the listing is a snapshot. A missing, empty, repeated or invalid prefix: 400;
  ``key`` and ``prefix`` together (any method): 400; a reply that would exceed 64 MiB: 413.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import math
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import MappingProxyType, TracebackType
from urllib.parse import parse_qs, quote, urlsplit

import msgpack

from mooncake_plugins.errors import InvalidArgument, MetadataError
from mooncake_plugins.transfer.metadata.base import (
    DEFAULT_TIMEOUT_S,
    MAX_VALUE_NBYTES,
    MetadataStore,
    MetadataTarget,
    check_key,
    check_prefix,
)

_log = logging.getLogger(__name__)

ROUTE = "/metadata"
HEALTH_ROUTE = "/health"
LIST_CONTENT_TYPE = "application/msgpack"
# The largest listing reply, encoded; the server answers 413 beyond it.
MAX_LIST_NBYTES = 64 * 1024 * 1024
# A connection that sends nothing for this long is closed, so a stalled client
# cannot hold a server thread forever.
DEFAULT_IDLE_TIMEOUT_S = 30.0
DEFAULT_MAX_STORE_NBYTES = 1 << 30
DEFAULT_MAX_CONNECTIONS = 512
# What one key costs besides its key and value bytes (dict slot, str and bytes objects).
ENTRY_OVERHEAD_NBYTES = 256
_BUSY_BODY = b"too many connections; retry later"
_BUSY_REPLY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
               b"Content-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n"
               b"Connection: close\r\n\r\n" + _BUSY_BODY)
# How often serve_forever() looks at its shutdown flag.
_POLL_INTERVAL_S = 0.05


class HttpMetadataStore(MetadataStore):
    """Client of an HTTP metadata server (ours or the original's).

    Each call is one HTTP request with a ``timeout_s`` bound; there is no connection
    state, so the store is safe to share between threads. Proxy settings from the
    environment are ignored: the metadata server is always reached directly.
    """

    def __init__(self, url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Args: url: the server's base URL, e.g. ``http://10.0.0.1:8080/metadata``."""
        super().__init__(url)
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @classmethod
    def from_target(cls, target: MetadataTarget, timeout_s: float) -> HttpMetadataStore:
        """Build a client for a parsed ``http://`` or ``https://`` URL."""
        return cls(target.url, timeout_s)

    def _request(self, method: str, key: str, body: bytes | None = None, *,
                 param: str = "key", limit_nbytes: int = MAX_VALUE_NBYTES, extra: str = ""
                 ) -> tuple[int, str, bytes]:
        """Send one request with ``?<param>=<key><extra>``; return (status, content type,
        body). Blocks up to ``timeout_s`` per socket operation.
        """
        request = urllib.request.Request(
            f"{self.url}?{param}={quote(key, safe='')}{extra}", data=body, method=method,
            headers={"Content-Type": "application/octet-stream"} if body is not None else {})
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                return (response.status, response.headers.get_content_type(),
                        _read_bounded(response, self.url, limit_nbytes))
        except urllib.error.HTTPError as exc:
            with exc:
                return (exc.code, exc.headers.get_content_type(),
                        _read_bounded(exc, self.url, limit_nbytes))
        except MetadataError:
            raise
        except urllib.error.URLError as exc:
            raise MetadataError(
                f"metadata server {self.url} unreachable during {method} {key!r} "
                f"({exc.reason}); check that it runs and the URL is right") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise MetadataError(
                f"metadata server {self.url}: {method} {key!r} failed ({exc!r})") from exc

    def _fail(self, method: str, key: str, status: int, body: bytes) -> MetadataError:
        text = body[:200].decode("utf-8", "replace").strip()
        return MetadataError(
            f"metadata server {self.url}: {method} {key!r} answered HTTP {status}: {text}")

    def _put(self, key: str, value: bytes, ttl_s: float | None) -> None:
        extra = "" if ttl_s is None else f"&ttl={math.ceil(ttl_s)}"
        status, _, body = self._request("PUT", key, value, extra=extra)
        if not 200 <= status < 300:
            raise self._fail("PUT", key, status, body)

    def _get(self, key: str) -> bytes | None:
        status, _, body = self._request("GET", key)
        if status == 404:
            return None
        if status != 200:
            raise self._fail("GET", key, status, body)
        return body

    def _delete(self, key: str) -> None:
        status, _, body = self._request("DELETE", key)
        if status != 404 and not 200 <= status < 300:
            raise self._fail("DELETE", key, status, body)

    def _list_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        status, content_type, body = self._request("GET", prefix, param="prefix",
                                                   limit_nbytes=MAX_LIST_NBYTES)
        if status == 413:
            raise MetadataError(
                f"metadata server {self.url}: the listing of {prefix!r} is over "
                f"{MAX_LIST_NBYTES} bytes; list a longer prefix")
        if status != 200 or content_type != LIST_CONTENT_TYPE:
            # The original Mooncake server answers 400 "metadata key is required".
            text = body[:200].decode("utf-8", "replace").strip()
            raise MetadataError(
                f"metadata server {self.url} cannot list keys (GET ?prefix= answered HTTP "
                f"{status} {content_type}: {text}); listing needs this package's metadata "
                "server (mooncake-metadata-server), etcd or Redis")
        return _decode_listing(body, prefix, self.url)

    def _close(self) -> None:
        """Nothing to release: urllib opens one connection per request."""


def _decode_listing(body: bytes, prefix: str, url: str) -> list[tuple[str, bytes]]:
    """Check and decode a listing reply: a msgpack array of [str, bin] pairs under prefix."""
    try:
        items = msgpack.unpackb(body, raw=False, use_list=True)
    except (ValueError, TypeError) as exc:  # msgpack's errors subclass ValueError
        raise MetadataError(f"metadata server {url} sent a malformed listing of "
                            f"{prefix!r}: {exc}") from exc
    if not isinstance(items, list):
        raise MetadataError(f"metadata server {url} sent a listing of {prefix!r} that is "
                            f"a {type(items).__name__}, not an array")
    out = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                and item[0].startswith(prefix) and isinstance(item[1], bytes)):
            raise MetadataError(f"metadata server {url} sent a listing of {prefix!r} with "
                                f"a bad entry: {str(item)[:100]}")
        out.append((item[0], item[1]))
    return out


def _read_bounded(response: http.client.HTTPResponse | urllib.error.HTTPError,
                  url: str, limit_nbytes: int) -> bytes:
    """Read a response body of at most ``limit_nbytes``."""
    body = response.read(limit_nbytes + 1)
    if len(body) > limit_nbytes:
        raise MetadataError(
            f"metadata server {url} sent a body over {limit_nbytes} bytes")
    return body


def _cost(key: str, nbytes: int) -> int:
    """What storing ``nbytes`` under ``key`` counts against ``max_nbytes``."""
    return len(key.encode("utf-8")) + nbytes + ENTRY_OVERHEAD_NBYTES


class Refused(MetadataError):
    """A write the server refuses; ``status`` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Entries:
    """The key-value map, its byte accounting and its rules; shared by HTTP and in-process use.

    ``lock`` is taken only around dict operations and the byte counts. A PUT is admitted
    only while ``stored_nbytes + reserved_nbytes`` (entries kept, bodies announced and
    being read) stays within ``max_nbytes``. A key containing ``rpc_meta`` (a Transfer
    Engine's RPC endpoint) is written once: putting the same value again is accepted,
    another value is refused, as the original's servers do.
    """

    def __init__(self, max_nbytes: int, strip_keys: bool) -> None:
        self.kv: dict[str, bytes] = {}
        self.expiry: dict[str, float] = {}     # leased keys: monotonic deadline
        self.lock = threading.Lock()
        self.max_nbytes = max_nbytes
        self.strip_keys = strip_keys
        self.stored_nbytes = 0
        self.reserved_nbytes = 0

    def key(self, raw: str) -> str:
        """The key a request names: checked, and stripped when ``strip_keys``.

        Raises:
            InvalidArgument: empty (after stripping) or otherwise invalid.
        """
        key = raw.strip() if self.strip_keys else raw
        check_key(key)
        return key

    def get(self, key: str) -> bytes | None:
        with self.lock:
            self.expire_locked()
            return self.kv.get(key)

    def expire_locked(self) -> None:
        """Drop the leased keys whose time is up (call with ``lock`` held)."""
        if not self.expiry:
            return
        now = time.monotonic()
        for key in [k for k, t in self.expiry.items() if t <= now]:
            del self.expiry[key]
            old = self.kv.pop(key, None)
            if old is not None:
                self.stored_nbytes -= _cost(key, len(old))

    def reserve(self, key: str, nbytes: int) -> int:
        """Reserve room to store ``nbytes`` under ``key`` (replacing its value frees room).

        Returns the bytes reserved: give them to :meth:`commit` or :meth:`unreserve`.

        Raises:
            Refused: 413, a value over ``MAX_VALUE_NBYTES``; 507, no room left.
        """
        if nbytes > MAX_VALUE_NBYTES:
            raise Refused(413, f"value over {MAX_VALUE_NBYTES} bytes")
        with self.lock:
            self.expire_locked()
            old = self.kv.get(key)
            need = max(0, _cost(key, nbytes) - (0 if old is None else _cost(key, len(old))))
            if self.stored_nbytes + self.reserved_nbytes + need > self.max_nbytes:
                raise Refused(507, f"the metadata server is full ({self.max_nbytes} bytes "
                                   "of keys and values); delete stale keys")
            self.reserved_nbytes += need
            return need

    def commit(self, key: str, value: bytes, reserved: int, ttl_s: int | None = None) -> bool:
        """Store ``value``, turning the reservation into stored bytes; False if unchanged.
        ``ttl_s``: drop it that many seconds from now unless written again.

        Raises:
            Refused: 400, another value for a write-once (``rpc_meta``) key.
        """
        with self.lock:
            self.reserved_nbytes -= reserved
            self.expire_locked()
            old = self.kv.get(key)
            if ttl_s is None:
                self.expiry.pop(key, None)
            else:
                self.expiry[key] = time.monotonic() + ttl_s
            if old is not None and "rpc_meta" in key:
                if old == value:
                    return False
                raise Refused(400, "Duplicate rpc_meta key not allowed")
            self.kv[key] = value
            freed = 0 if old is None else _cost(key, len(old))
            self.stored_nbytes += _cost(key, len(value)) - freed
            return True

    def unreserve(self, reserved: int) -> None:
        with self.lock:
            self.reserved_nbytes -= reserved

    def put(self, key: str, value: bytes) -> bool:
        """Reserve and store in one step (in-process writes); False if unchanged."""
        return self.commit(key, value, self.reserve(key, len(value)))

    def remove(self, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        with self.lock:
            self.expire_locked()
            self.expiry.pop(key, None)
            old = self.kv.pop(key, None)
            if old is not None:
                self.stored_nbytes -= _cost(key, len(old))
        return old is not None


class _KVServer(ThreadingHTTPServer):
    """ThreadingHTTPServer serving one :class:`_Entries` and tracking its open connections.

    Handler threads take ``entries.lock`` and ``_conns_lock`` only briefly, and never
    together.
    """

    daemon_threads = True  # ...and still joined by server_close() (block_on_close)

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily,
                 entries: _Entries, max_connections: int, idle_timeout_s: float) -> None:
        self.address_family = family
        self.entries = entries
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: socket.socket,  # type: ignore[override]
                        client_address: tuple[str, int]) -> None:
        with self._conns_lock:
            full = len(self._conns) >= self.max_connections
            if not full:
                self._conns.add(request)
        if full:
            _log.warning("metadata server refused a connection from %s: %d connections are "
                         "open (the limit)", client_address, self.max_connections)
            with contextlib.suppress(OSError):  # best effort: never wait for a slow client here
                request.send(_BUSY_REPLY, socket.MSG_DONTWAIT)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request: socket.socket) -> None:  # type: ignore[override]
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """Shut down every open client connection so its handler thread ends now."""
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):  # already closed by the peer
                conn.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: object, client_address: object) -> None:
        # OSError: the client went away; anything else (no thread to serve it) is ours
        level = logging.DEBUG if isinstance(sys.exc_info()[1], OSError) else logging.WARNING
        _log.log(level, "metadata server: error serving %s", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    """One client connection; runs on its own server thread."""

    protocol_version = "HTTP/1.1"
    # Malformed request lines get a real status line, not a bare HTTP/0.9 body.
    default_request_version = "HTTP/1.0"
    server_version = "mooncake-metadata"
    server: _KVServer

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout_s  # applied to the socket by super().setup()
        super().setup()

    def do_GET(self) -> None:
        if urlsplit(self.path).path == HEALTH_ROUTE:  # liveness probe, as the original's
            self._reply(200, b"OK")
            return
        query = self._query()
        if query is None:
            return
        if "prefix" in query:
            self._list(query["prefix"])
            return
        key = self._key(query)
        if key is None:
            return
        value = self.server.entries.get(key)
        if value is None:
            self._reply(404, b"metadata not found")
        else:
            self._reply(200, value, content_type="application/octet-stream")

    def do_PUT(self) -> None:
        query = self._query()
        key = None if query is None else self._key(query)
        if key is None:
            return
        ttl = query.get("ttl", [None])[-1]
        if ttl is not None and (not ttl.isdigit() or int(ttl) < 1):
            self._refuse(400, b"ttl must be a whole number of seconds >= 1")
            return
        nbytes = self._content_length()
        if nbytes is None:
            return
        entries = self.server.entries
        try:
            reserved = entries.reserve(key, nbytes)
        except Refused as exc:
            self._refuse(exc.status, str(exc).encode())
            return
        try:
            value = self._read_body(nbytes)
            if value is None:
                entries.unreserve(reserved)
                return
        except BaseException:
            entries.unreserve(reserved)
            raise
        try:
            changed = entries.commit(key, value, reserved, None if ttl is None else int(ttl))
        except Refused as exc:
            self._refuse(exc.status, str(exc).encode())
            return
        self._reply(200, b"metadata updated" if changed else b"metadata unchanged")

    def do_DELETE(self) -> None:
        query = self._query()
        key = None if query is None else self._key(query)
        if key is None:
            return
        if self.server.entries.remove(key):
            self._reply(200, b"metadata deleted")
        else:
            self._reply(404, b"metadata not found")

    def _list(self, prefixes: list[str]) -> None:
        """Answer ``GET ?prefix=P``: a msgpack array of [key, value] pairs, sorted."""
        if len(prefixes) != 1:
            self._refuse(400, b"give one prefix")
            return
        prefix = prefixes[0]
        try:
            check_prefix(prefix)
        except InvalidArgument as exc:
            self._refuse(400, str(exc).encode())
            return
        entries = self.server.entries
        with entries.lock:  # values are immutable bytes: a snapshot of references
            entries.expire_locked()
            items = [(k, v) for k, v in entries.kv.items() if k.startswith(prefix)]
        items.sort()
        packer = msgpack.Packer(use_bin_type=True)
        chunks = [packer.pack_array_header(len(items))]
        nbytes = len(chunks[0])
        for item in items:
            chunks.append(packer.pack(item))
            nbytes += len(chunks[-1])
            if nbytes > MAX_LIST_NBYTES:
                self._refuse(413, f"the listing of {prefix!r} is over {MAX_LIST_NBYTES} "
                                 "bytes; list a longer prefix".encode())
                return
        self._reply(200, b"".join(chunks), content_type=LIST_CONTENT_TYPE)

    def __getattr__(self, name: str) -> Callable[[], None]:
        # BaseHTTPRequestHandler dispatches to do_<METHOD> and answers 501 when it is
        # missing; every method other than GET/PUT/DELETE gets 405 instead.
        if name.startswith("do_"):
            return self._method_not_allowed
        raise AttributeError(name)

    def _method_not_allowed(self) -> None:
        self._refuse(405, b"method not allowed", extra_headers={"Allow": "GET, PUT, DELETE"})

    def _query(self) -> dict[str, list[str]] | None:
        """Check the route and parse the query string, or answer 4xx and return None."""
        parts = urlsplit(self.path)
        if parts.path != ROUTE:
            self._refuse(404, b"no such route; use " + ROUTE.encode())
            return None
        try:
            query = parse_qs(parts.query, keep_blank_values=True, errors="strict")
        except UnicodeDecodeError:
            self._refuse(400, b"key is not valid UTF-8")
            return None
        if "key" in query and "prefix" in query:
            self._refuse(400, b"give either key or prefix, not both")
            return None
        return query

    def _key(self, query: dict[str, list[str]]) -> str | None:
        """Return the request's key, or answer 400 and return None."""
        keys = query.get("key")
        if not keys or not keys[0]:
            self._refuse(400, b"missing key")
            return None
        try:
            return self.server.entries.key(keys[0])
        except InvalidArgument as exc:
            self._refuse(400, str(exc).encode())
            return None

    def _content_length(self) -> int | None:
        """The PUT body's declared length, or answer 4xx and return None."""
        headers = self.headers.get_all("Content-Length") or []
        if not headers or "Transfer-Encoding" in self.headers:
            self._refuse(411, b"Content-Length required (no Transfer-Encoding)")
            return None
        text = headers[0].strip()
        if len(headers) > 1 or not (text.isascii() and text.isdigit()):
            self._refuse(400, b"bad Content-Length")
            return None
        return int(text)  # over MAX_VALUE_NBYTES: refused by _Entries.reserve

    def _read_body(self, nbytes: int) -> bytes | None:
        """Read the PUT body, or drop a connection that ends before it and return None."""
        body = self.rfile.read(nbytes)
        if len(body) != nbytes:
            _log.debug("metadata server: %s closed after %d of %d body bytes",
                       self.address_string(), len(body), nbytes)
            self.close_connection = True
            return None
        return body

    def _refuse(self, status: int, body: bytes,
                extra_headers: dict[str, str] | None = None) -> None:
        """Answer a request we reject with ``status``, and log it."""
        _log.warning("metadata server refused %s %r from %s: %d %s", self.command,
                     self.path[:200], self.address_string(), status,
                     body[:200].decode("utf-8", "replace"))
        self._reply(status, body, extra_headers=extra_headers)

    def _reply(self, status: int, body: bytes, *, content_type: str = "text/plain",
               extra_headers: dict[str, str] | None = None) -> None:
        """Send a complete response.

        The connection is closed after an error or when a request other than PUT
        declared a body: an unread body would be parsed as the next request.
        """
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (extra_headers or {}).items():
            self.send_header(name, value)
        if status >= 400 or (self.command != "PUT" and self._declares_body()):
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _declares_body(self) -> bool:
        return ("Transfer-Encoding" in self.headers
                or self.headers.get("Content-Length", "0").strip() != "0")

    def log_message(self, format: str, *args: object) -> None:
        _log.debug("metadata server: %s %s", self.address_string(), format % args)

    def log_error(self, format: str, *args: object) -> None:
        # unparsable requests (send_error) and idle connections timing out
        _log.warning("metadata server: %s %s", self.address_string(), format % args)


class MetadataServer:
    """The embedded HTTP metadata server, serving from a daemon thread.

    Example::

        with MetadataServer() as server:
            store = from_url(server.url)

    ``start``/``stop`` may be called from any thread; ``stop`` blocks until the serving
    thread and every connection thread have ended. The entries live in this object, not
    in the listener: :meth:`get`, :meth:`put`, :meth:`delete` and :attr:`entries` work
    in-process (same rules and limits) whether or not it is serving, and survive a
    ``stop``/``start``.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 max_nbytes: int = DEFAULT_MAX_STORE_NBYTES,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 strip_keys: bool = False) -> None:
        """Args:
            host: address to listen on; port: TCP port, 0 picks a free one.
            max_nbytes: room for keys and values (each key also costs
                ``ENTRY_OVERHEAD_NBYTES``); a PUT beyond it gets 507.
            max_connections: connections served at once; more get 503 and are closed.
            idle_timeout_s: a connection that sends nothing for this long is closed.
            strip_keys: strip whitespace around every key before use (the original's
                Python server does; a key that is all blanks is then refused).
        """
        if not 0 <= port <= 65535:
            raise InvalidArgument(f"metadata server port must be in 0..65535, got {port}")
        if max_nbytes < 0 or max_connections < 1 or not idle_timeout_s > 0:
            raise InvalidArgument(f"bad metadata server limits: max_nbytes={max_nbytes}, "
                                  f"max_connections={max_connections}, "
                                  f"idle_timeout_s={idle_timeout_s}")
        self.host = host
        self._port = port
        self._entries = _Entries(max_nbytes, strip_keys)
        self._limits = (max_connections, idle_timeout_s)
        self._server: _KVServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> MetadataServer:
        """Bind and start serving; returns self.

        Raises:
            MetadataError: already started, or the address cannot be bound.
        """
        if self._server is not None:
            raise MetadataError(f"metadata server {self.url} is already running")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            server = _KVServer((self.host, self._port), family, self._entries, *self._limits)
        except OSError as exc:
            raise MetadataError(
                f"metadata server cannot listen on {self.host}:{self._port} "
                f"({exc.strerror or exc}); pick another --host/--port") from exc
        self._server = server
        self._port = int(server.server_address[1])
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": _POLL_INTERVAL_S},
            name=f"metadata-server:{self.port}", daemon=True)
        self._thread.start()
        _log.info("metadata server listening on %s", self.url)
        return self

    @property
    def port(self) -> int:
        """The bound TCP port once started (before that, the requested one)."""
        return self._port

    @property
    def serving_thread(self) -> threading.Thread | None:
        """The thread accepting connections while started, else None."""
        return self._thread

    @property
    def used_nbytes(self) -> int:
        """What counts against ``max_nbytes`` now: stored entries and bodies being received."""
        entries = self._entries
        with entries.lock:
            return entries.stored_nbytes + entries.reserved_nbytes

    @property
    def entries(self) -> Mapping[str, bytes]:
        """A snapshot of the stored keys and values (handler threads change the map)."""
        with self._entries.lock:
            self._entries.expire_locked()
            return MappingProxyType(dict(self._entries.kv))

    def get(self, key: str) -> bytes | None:
        """The value under ``key`` (stripped if ``strip_keys``), or None.

        Raises:
            InvalidArgument: an invalid key.
        """
        return self._entries.get(self._entries.key(key))

    def put(self, key: str, value: bytes) -> bool:
        """Store ``value`` under ``key``, as an HTTP PUT would; False if it was unchanged.

        Raises:
            InvalidArgument: an invalid key.
            Refused: a value over 16 MiB (``status`` 413), no room (507), or another value
                for a write-once ``rpc_meta`` key (400).
        """
        return self._entries.put(self._entries.key(key), bytes(value))

    def delete(self, key: str) -> bool:
        """Delete ``key``; whether it existed.

        Raises:
            InvalidArgument: an invalid key.
        """
        return self._entries.remove(self._entries.key(key))

    @property
    def open_connections(self) -> int:
        """Client connections being served now (counted against ``max_connections``)."""
        server = self._server
        if server is None:
            return 0
        with server._conns_lock:
            return len(server._conns)

    @property
    def url(self) -> str:
        """The URL clients pass to :func:`from_url`: ``http://host:port/metadata``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{ROUTE}"

    def stop(self) -> None:
        """Stop serving, close every connection and join all threads. Idempotent."""
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.shutdown()
        thread.join()
        server.close_connections()
        server.server_close()
        self._server = self._thread = None
        _log.info("metadata server on port %d stopped", self._port)

    def __enter__(self) -> MetadataServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
