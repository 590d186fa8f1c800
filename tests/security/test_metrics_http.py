"""The master's Prometheus endpoint against a hostile client: it only ever reads counters.

Nothing a client sends changes the master or reaches a file; stalled and surplus
connections are closed, and the endpoint keeps answering scrapes.
"""

from __future__ import annotations

import http.client
import logging
from collections.abc import Iterator

import pytest
from helpers import wait_until
from rawnet import closed_by_peer, connect, exchange

from mooncake_plugins.store.master import MasterConfig, MasterService
from mooncake_plugins.store.metrics import MetricsServer, serve_metrics

# This module checks the master's metrics and admin HTTP. CI's MOONCAKE_PUREPYTHON=1 pass
# leaves it out (-m 'not control_plane'): the Python fallbacks would carry only its RPC
# frames, which that pass's data-path modules and tests/security/test_master_rpc.py cover.
pytestmark = pytest.mark.control_plane

LOG = "mooncake_plugins.store.metrics"


@pytest.fixture
def service() -> MasterService:
    return MasterService(MasterConfig())


@pytest.fixture
def metrics(service: MasterService) -> Iterator[MetricsServer]:
    """The endpoint on a free port: at most 2 connections, silent ones closed after 0.3 s."""
    server = serve_metrics(service, "127.0.0.1", 0, max_connections=2, idle_timeout_s=0.3)
    try:
        yield server
    finally:
        server.shutdown()


def scrape(port: int, method: str = "GET", path: str = "/metrics") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/metrics", 200),
    ("GET", "/../../../../etc/passwd", 200),  # any path answers the metrics, never a file
    ("GET", "/metrics?name[]=/etc/passwd", 200),
    ("POST", "/metrics", 405),
    ("PUT", "/metrics", 405),
    ("DELETE", "/metrics", 405),
], ids=["scrape", "traversal", "name-filter", "post", "put", "delete"])
def test_requests_only_read_counters(metrics: MetricsServer, service: MasterService, method: str,
                                     path: str, status: int) -> None:
    before = service.stats()
    got, body = scrape(metrics.port, method, path)
    assert got == status and b"root:" not in body
    if status == 200 and "name[]" not in path:
        assert b"mooncake_master_objects 0.0" in body
    assert service.stats() == before


def test_garbage_is_refused(metrics: MetricsServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOG):
        reply = exchange(metrics.port, b"\x00\xff garbage\r\n\r\n")
    assert b"Error code explanation: 400" in reply  # an HTTP/0.9 reply: a body, no status line
    assert "code 400" in caplog.text
    assert scrape(metrics.port)[0] == 200


def test_a_silent_connection_is_closed(metrics: MetricsServer) -> None:
    with connect(metrics.port) as sock:
        sock.sendall(b"GET /metr")  # and nothing more
        assert closed_by_peer(sock, within_s=5)
    assert scrape(metrics.port)[0] == 200


def test_connections_over_the_limit_get_503(service: MasterService,
                                            caplog: pytest.LogCaptureFixture) -> None:
    server = serve_metrics(service, "127.0.0.1", 0, max_connections=2, idle_timeout_s=5)
    holders = [connect(server.port) for _ in range(2)]
    try:
        for sock in holders:
            sock.sendall(b"GET /metr")  # being served: the handler waits for the rest
        with caplog.at_level(logging.WARNING, logger=LOG):
            assert wait_until(lambda: exchange(server.port, b"GET /metrics HTTP/1.0\r\n\r\n")
                              .startswith(b"HTTP/1.0 503"), 5, interval_s=0.05)
        assert "connections are open (the limit)" in caplog.text
        for sock in holders:
            sock.close()
        assert wait_until(lambda: scrape(server.port)[0] == 200, 10, interval_s=0.05)
    finally:
        for sock in holders:
            sock.close()
        server.shutdown()
