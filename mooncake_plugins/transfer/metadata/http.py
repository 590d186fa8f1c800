"""HTTP metadata backend: a urllib client and the embedded metadata server.

Wire protocol (the original Mooncake http metadata server's): one route, ``/metadata``,
with the key in the ``key`` query parameter.

- ``GET /metadata?key=K``: 200 with the value as body, or 404.
- ``PUT /metadata?key=K`` with the value as body: 200.
- ``DELETE /metadata?key=K``: 200, or 404 when the key does not exist.
- No ``key`` (or an invalid one): 400; any other method: 405; another path: 404.
- A body over 16 MiB: 413; a malformed ``Content-Length``: 400; none at all: 411.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import parse_qs, quote, urlsplit

from mooncake_plugins.errors import InvalidArgument, MetadataError
from mooncake_plugins.transfer.metadata.base import (
    DEFAULT_TIMEOUT_S,
    MAX_VALUE_NBYTES,
    MetadataStore,
    MetadataTarget,
    check_key,
)

_log = logging.getLogger(__name__)

ROUTE = "/metadata"
# A connection that sends nothing for this long is closed, so a stalled client
# cannot hold a server thread forever.
_CONNECTION_IDLE_TIMEOUT_S = 30.0
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

    def _request(self, method: str, key: str, body: bytes | None = None) -> tuple[int, bytes]:
        """Send one request; return (status, body). Blocks up to ``timeout_s`` per socket op."""
        request = urllib.request.Request(
            f"{self.url}?key={quote(key, safe='')}", data=body, method=method,
            headers={"Content-Type": "application/octet-stream"} if body is not None else {})
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                return response.status, _read_bounded(response, self.url)
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, _read_bounded(exc, self.url)
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

    def _put(self, key: str, value: bytes) -> None:
        status, body = self._request("PUT", key, value)
        if not 200 <= status < 300:
            raise self._fail("PUT", key, status, body)

    def _get(self, key: str) -> bytes | None:
        status, body = self._request("GET", key)
        if status == 404:
            return None
        if status != 200:
            raise self._fail("GET", key, status, body)
        return body

    def _delete(self, key: str) -> None:
        status, body = self._request("DELETE", key)
        if status != 404 and not 200 <= status < 300:
            raise self._fail("DELETE", key, status, body)

    def _close(self) -> None:
        """Nothing to release: urllib opens one connection per request."""


def _read_bounded(response: http.client.HTTPResponse | urllib.error.HTTPError,
                  url: str) -> bytes:
    """Read a response body of at most 16 MiB."""
    body = response.read(MAX_VALUE_NBYTES + 1)
    if len(body) > MAX_VALUE_NBYTES:
        raise MetadataError(
            f"metadata server {url} sent a body over {MAX_VALUE_NBYTES} bytes")
    return body


class _KVServer(ThreadingHTTPServer):
    """ThreadingHTTPServer holding the key-value map and its open connections.

    Handler threads take ``kv_lock`` only around dict operations, and ``_conns_lock``
    only around the connection set; the two are never held together.
    """

    daemon_threads = True  # ...and still joined by server_close() (block_on_close)

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily) -> None:
        self.address_family = family
        self.kv: dict[str, bytes] = {}
        self.kv_lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: socket.socket,  # type: ignore[override]
                        client_address: tuple[str, int]) -> None:
        with self._conns_lock:
            self._conns.add(request)
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
        _log.debug("metadata server: error serving %s", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    """One client connection; runs on its own server thread."""

    protocol_version = "HTTP/1.1"
    # Malformed request lines get a real status line, not a bare HTTP/0.9 body.
    default_request_version = "HTTP/1.0"
    server_version = "mooncake-metadata"
    timeout = _CONNECTION_IDLE_TIMEOUT_S
    server: _KVServer

    def do_GET(self) -> None:
        key = self._key()
        if key is None:
            return
        with self.server.kv_lock:
            value = self.server.kv.get(key)
        if value is None:
            self._reply(404, b"metadata not found")
        else:
            self._reply(200, value, content_type="application/octet-stream")

    def do_PUT(self) -> None:
        key = self._key()
        if key is None:
            return
        value = self._read_body()
        if value is None:
            return
        with self.server.kv_lock:
            self.server.kv[key] = value
        self._reply(200, b"metadata updated")

    def do_DELETE(self) -> None:
        key = self._key()
        if key is None:
            return
        with self.server.kv_lock:
            found = self.server.kv.pop(key, None) is not None
        if found:
            self._reply(200, b"metadata deleted")
        else:
            self._reply(404, b"metadata not found")

    def __getattr__(self, name: str) -> Callable[[], None]:
        # BaseHTTPRequestHandler dispatches to do_<METHOD> and answers 501 when it is
        # missing; every method other than GET/PUT/DELETE gets 405 instead.
        if name.startswith("do_"):
            return self._method_not_allowed
        raise AttributeError(name)

    def _method_not_allowed(self) -> None:
        self._reply(405, b"method not allowed", extra_headers={"Allow": "GET, PUT, DELETE"})

    def _key(self) -> str | None:
        """Return the request's key, or answer 4xx and return None."""
        parts = urlsplit(self.path)
        if parts.path != ROUTE:
            self._reply(404, b"no such route; use " + ROUTE.encode())
            return None
        try:
            keys = parse_qs(parts.query, keep_blank_values=True, errors="strict").get("key")
        except UnicodeDecodeError:
            self._reply(400, b"key is not valid UTF-8")
            return None
        if not keys or not keys[0]:
            self._reply(400, b"missing key")
            return None
        try:
            check_key(keys[0])
        except InvalidArgument as exc:
            self._reply(400, str(exc).encode())
            return None
        return keys[0]

    def _read_body(self) -> bytes | None:
        """Read the PUT body, or answer 4xx (or drop a dead connection) and return None."""
        headers = self.headers.get_all("Content-Length") or []
        if not headers or "Transfer-Encoding" in self.headers:
            self._reply(411, b"Content-Length required (no Transfer-Encoding)")
            return None
        text = headers[0].strip()
        if len(headers) > 1 or not (text.isascii() and text.isdigit()):
            self._reply(400, b"bad Content-Length")
            return None
        nbytes = int(text)
        if nbytes > MAX_VALUE_NBYTES:
            self._reply(413, f"value over {MAX_VALUE_NBYTES} bytes".encode())
            return None
        body = self.rfile.read(nbytes)
        if len(body) != nbytes:
            _log.debug("metadata server: %s closed after %d of %d body bytes",
                       self.address_string(), len(body), nbytes)
            self.close_connection = True
            return None
        return body

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


class MetadataServer:
    """The embedded HTTP metadata server, serving from a daemon thread.

    Example::

        with MetadataServer() as server:
            store = from_url(server.url)

    ``start``/``stop`` may be called from any thread; ``stop`` blocks until the serving
    thread and every connection thread have ended.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Args: host: address to listen on; port: TCP port, 0 picks a free one."""
        if not 0 <= port <= 65535:
            raise InvalidArgument(f"metadata server port must be in 0..65535, got {port}")
        self.host = host
        self._port = port
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
            server = _KVServer((self.host, self._port), family)
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
