"""The HTTP metadata server against a hostile client: storage and connection limits,
stalled clients, paths that look like files, oversized request heads.

tests/transfer/test_metadata.py covers the protocol's 4xx answers (bad keys, lengths,
methods, routes), truncated bodies and a stalled client next to a good one; here: what a
client can make the server hold (bytes, connections, threads, time) and that nothing it
sends reaches the file system.
"""

from __future__ import annotations

import http.client
import logging
import os
import uuid
from collections.abc import Iterator

import pytest
from helpers import wait_until
from rawnet import closed_by_peer, connect, exchange

from mooncake_plugins.cli.metadata_server import _parse_args
from mooncake_plugins.transfer.metadata import MetadataServer
from mooncake_plugins.transfer.metadata.http import ENTRY_OVERHEAD_NBYTES

# This module checks the metadata server's HTTP. CI's MOONCAKE_PUREPYTHON=1 pass leaves it
# out (-m 'not control_plane'): the Python fallbacks would carry only its RPC frames, which
# that pass's data-path modules and tests/security/test_master_rpc.py cover.
pytestmark = pytest.mark.control_plane

LOG = "mooncake_plugins.transfer.metadata.http"
VALUE_NBYTES = 16 << 10
ROOM = 4 * (VALUE_NBYTES + ENTRY_OVERHEAD_NBYTES + 2)  # exactly four 2-byte keys of 16 KiB


@pytest.fixture
def server() -> Iterator[MetadataServer]:
    """Room for four 16 KiB values; idle connections are closed after 0.3 s."""
    with MetadataServer(max_nbytes=ROOM, idle_timeout_s=0.3) as srv:
        yield srv


def request(srv: MetadataServer, method: str, key: str, body: bytes | None = None
            ) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
    try:
        conn.request(method, f"/metadata?key={key}", body=body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def test_the_store_cannot_grow_past_its_room(server: MetadataServer,
                                             caplog: pytest.LogCaptureFixture) -> None:
    values = {f"k{i}": bytes([i]) * VALUE_NBYTES for i in range(4)}
    for key, value in values.items():
        assert request(server, "PUT", key, value)[0] == 200
    with caplog.at_level(logging.WARNING, logger=LOG):
        status, body = request(server, "PUT", "k4", b"x" * VALUE_NBYTES)
    assert status == 507 and b"full" in body
    assert server.used_nbytes == ROOM
    assert "refused PUT" in caplog.text
    assert request(server, "GET", "k4")[0] == 404
    assert all(request(server, "GET", k) == (200, v) for k, v in values.items())
    assert request(server, "PUT", "k0", b"y" * VALUE_NBYTES)[0] == 200  # a replacement fits
    assert request(server, "DELETE", "k1")[0] == 200
    assert request(server, "PUT", "k4", b"x" * VALUE_NBYTES)[0] == 200  # deleting made room


def test_bodies_being_received_count_against_the_room() -> None:
    half = ROOM // 2
    with MetadataServer(max_nbytes=ROOM, idle_timeout_s=2.0) as srv, connect(srv.port) as slow:
        slow.sendall(f"PUT /metadata?key=a HTTP/1.1\r\nContent-Length: {half}\r\n\r\n".encode()
                     + b"x" * 100)
        assert wait_until(lambda: srv.used_nbytes > half, 5)  # the server read the head
        assert request(srv, "PUT", "b", b"y" * half)[0] == 507
        assert closed_by_peer(slow, within_s=10)  # the idle deadline ends the slow upload
        assert wait_until(lambda: srv.used_nbytes == 0, 5)  # and gives its room back
        assert request(srv, "PUT", "b", b"y" * half)[0] == 200
        assert request(srv, "GET", "a")[0] == 404


def test_connections_over_the_limit_get_503(caplog: pytest.LogCaptureFixture) -> None:
    with MetadataServer(max_connections=3) as srv:
        assert request(srv, "PUT", "a", b"v")[0] == 200
        # the server ends that connection in its own thread, after the client has closed it
        assert wait_until(lambda: srv.open_connections == 0, 5)
        holders = [connect(srv.port) for _ in range(3)]
        try:
            for sock in holders:  # each is being served: one request answered, kept alive
                sock.sendall(b"GET /metadata?key=a HTTP/1.1\r\nHost: x\r\n\r\n")
                assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            with caplog.at_level(logging.WARNING, logger=LOG):
                reply = exchange(srv.port, b"GET /metadata?key=a HTTP/1.1\r\nHost: x\r\n\r\n")
            assert reply == b"" or status_of(reply) == 503
            assert "connections are open (the limit)" in caplog.text
        finally:
            for sock in holders:
                sock.close()
        assert wait_until(lambda: request(srv, "GET", "a")[0] == 200, 5)


def test_a_silent_connection_is_closed(server: MetadataServer,
                                       caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOG), connect(server.port) as sock:
        sock.sendall(b"GET /metadata?key=a HTT")  # and nothing more
        assert closed_by_peer(sock, within_s=5)
    assert "timed out" in caplog.text
    assert request(server, "GET", "a")[0] == 404


@pytest.mark.parametrize("target", [
    "/metadata?key=../../../../etc/passwd", "/metadata?key=%2Fetc%2Fpasswd",
    "/../../../../etc/passwd", "/metadata/../../etc/passwd?key=a", "//etc/passwd",
    "/metadata?prefix=/etc/",
])
def test_paths_never_reach_the_file_system(server: MetadataServer, target: str) -> None:
    reply = exchange(server.port, f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert status_of(reply) in (200, 404)
    assert b"root:" not in reply
    probe = f"/tmp/mooncake-security-{uuid.uuid4().hex}"
    assert request(server, "PUT", probe, b"not a file")[0] == 200  # a key, nothing more
    assert not os.path.exists(probe)
    assert request(server, "GET", probe) == (200, b"not a file")


@pytest.mark.parametrize("head, status", [
    (b"GET /metadata?key=" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"GET /metadata?key=a HTTP/1.1\r\n" + b"X-A: b\r\n" * 101 + b"\r\n", 431),
    (b"GET /metadata?key=a HTTP/1.1\r\nX-A: " + b"b" * 70_000 + b"\r\n\r\n", 431),
], ids=["request-line", "header-count", "header-line"])
def test_oversized_request_heads_are_refused(server: MetadataServer, head: bytes, status: int,
                                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert status_of(exchange(server.port, head)) == status
    assert f"code {status}" in caplog.text
    assert request(server, "GET", "a")[0] == 404


def test_the_cli_listens_on_loopback_unless_told_otherwise() -> None:
    assert _parse_args([]).host == "127.0.0.1"


def test_health_answers_and_is_no_key(server: MetadataServer) -> None:
    assert exchange(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").endswith(b"\r\n\r\nOK")
    assert status_of(exchange(server.port, b"PUT /health HTTP/1.1\r\nHost: x\r\n"
                                           b"Content-Length: 1\r\n\r\nx")) == 404
    assert request(server, "GET", "/health")[0] == 404  # a key named /health is just a key
