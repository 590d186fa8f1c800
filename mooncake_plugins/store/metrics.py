"""Prometheus metrics of the master (``/metrics`` over HTTP, prometheus-client).

prometheus-client is the well-kept standard exposition library; a custom collector reads
the master's counters at scrape time, so the hot paths update nothing extra. The HTTP
server is prometheus-client's WSGI app on a bounded server of ours: at most
``max_connections`` at once (more get 503), and a connection that sends nothing for
``idle_timeout_s`` is closed. It reads no file and changes nothing: any path answers the
metrics (prometheus-client's behaviour), methods other than GET/OPTIONS get 405.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from .master import MasterService

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_IDLE_TIMEOUT_S = 10.0
_BUSY_BODY = b"too many connections; retry later"
_BUSY_REPLY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
               b"Content-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


class _Collector:
    def __init__(self, service: MasterService) -> None:
        self._service = service

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self._service.stats()
        for name in ("objects", "segments", "clients", "used_bytes", "capacity_bytes",
                     "repairs_waiting", "repairs_running", "repairs_blocked"):
            yield GaugeMetricFamily(f"mooncake_master_{name}", f"current {name.replace('_', ' ')}",
                                    value=st[name])
        for name in ("puts", "gets", "removes", "evicted", "offloaded_evictions",
                     "expired_clients", "discarded_puts", "replicas_recreated", "repairs_failed",
                     "repairs_abandoned"):
            yield CounterMetricFamily(f"mooncake_master_{name}", f"{name.replace('_', ' ')} so far",
                                      value=st[name])


class _Handler(WSGIRequestHandler):
    """One scrape per connection; socket reads and writes time out after ``idle_timeout_s``."""

    server: "_Server"

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout_s  # applied to the socket by super().setup()
        super().setup()

    def log_message(self, format: str, *args: object) -> None:
        log.debug("metrics: %s %s", self.address_string(), format % args)

    def log_error(self, format: str, *args: object) -> None:
        log.warning("metrics: %s %s", self.address_string(), format % args)


class _Server(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most ``max_connections`` of them."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily,
                 max_connections: int, idle_timeout_s: float) -> None:
        self.address_family = family
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self._active = 0
        self._active_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._active_lock:
            full = self._active >= self.max_connections
            if not full:
                self._active += 1
        if full:
            log.warning("metrics endpoint refused a connection from %s: %d connections are "
                        "open (the limit)", client_address, self.max_connections)
            try:
                request.send(_BUSY_REPLY, socket.MSG_DONTWAIT)
            except OSError:
                pass  # best effort: never wait for a slow client here
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done()

    def _done(self) -> None:
        with self._active_lock:
            self._active -= 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        # OSError (a timeout included): the client stalled or went away
        level = logging.DEBUG if isinstance(sys.exc_info()[1], OSError) else logging.WARNING
        log.log(level, "metrics: error serving %s", client_address, exc_info=True)


class MetricsServer:
    """The running endpoint; ``port`` is where it listens."""

    def __init__(self, httpd: _Server, thread: threading.Thread) -> None:
        self._httpd, self._thread = httpd, thread
        self.port: int = httpd.server_address[1]

    def shutdown(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def serve_metrics(service: MasterService, host: str, port: int, *,
                  max_connections: int = DEFAULT_MAX_CONNECTIONS,
                  idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                  wrap: Callable[[Any], Any] | None = None) -> MetricsServer:
    """Serve ``/metrics`` for ``service`` on ``host:port`` (0: a free port) in a daemon thread.

    ``wrap`` turns the metrics WSGI app into the one served (``admin.admin_app`` adds the
    admin routes)."""
    from prometheus_client import CollectorRegistry, make_wsgi_app

    registry = CollectorRegistry()
    registry.register(_Collector(service))
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
    httpd = _Server((sockaddr[0], port), family, max_connections, idle_timeout_s)
    app = make_wsgi_app(registry)
    httpd.set_app(wrap(app) if wrap is not None else app)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              name=f"mc-metrics-{httpd.server_address[1]}", daemon=True)
    thread.start()
    return MetricsServer(httpd, thread)
