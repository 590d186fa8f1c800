"""Prometheus metrics of the master (``/metrics`` over HTTP, prometheus-client).

prometheus-client is the well-kept standard exposition library; a custom collector reads
the master's counters at scrape time, so the hot paths update nothing extra.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

from .master import MasterService


class _Collector:
    def __init__(self, service: MasterService) -> None:
        self._service = service

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self._service.stats()
        for name in ("objects", "segments", "clients", "used_bytes", "capacity_bytes"):
            yield GaugeMetricFamily(f"mooncake_master_{name}", f"current {name.replace('_', ' ')}",
                                    value=st[name])
        for name in ("puts", "gets", "removes", "evicted", "offloaded_evictions",
                     "expired_clients", "discarded_puts"):
            yield CounterMetricFamily(f"mooncake_master_{name}", f"{name.replace('_', ' ')} so far",
                                      value=st[name])


class MetricsServer:
    """The running endpoint; ``port`` is where it listens."""

    def __init__(self, httpd: Any, thread: threading.Thread) -> None:
        self._httpd, self._thread = httpd, thread
        self.port: int = httpd.server_address[1]

    def shutdown(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def serve_metrics(service: MasterService, host: str, port: int) -> MetricsServer:
    """Serve ``/metrics`` for ``service`` on ``host:port`` in a daemon thread."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(_Collector(service))
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(httpd, thread)
