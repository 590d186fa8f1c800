"""Metadata service: one suite over the HTTP, etcd and Redis backends (put/get/delete and
listing by prefix), URL parsing, HTTP server robustness (the listing route included), servers
that cannot list, unreachable servers and the metadata server CLI."""

from __future__ import annotations

import hashlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, urlsplit

import msgpack
import pytest
from helpers import spawn_ready, terminate_group

from mooncake_plugins.errors import InvalidArgument, MetadataError
from mooncake_plugins.transfer.metadata import MetadataServer, MetadataStore, from_url
from mooncake_plugins.transfer.metadata.base import (
    MAX_KEY_NBYTES,
    MAX_VALUE_NBYTES,
    parse_url,
)
from mooncake_plugins.transfer.metadata.http import MAX_LIST_NBYTES

REPO_ROOT = Path(__file__).resolve().parents[2]


def _etcd_metadata_url(client_url: str) -> str:
    return f"etcd://{urlsplit(client_url).netloc}"


@pytest.fixture(params=[
    pytest.param("http", id="http"),
    pytest.param("etcd", id="etcd", marks=pytest.mark.etcd),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
])
def store(request: pytest.FixtureRequest) -> Iterator[MetadataStore]:
    """A store on a real server of each backend."""
    if request.param == "http":
        url = request.getfixturevalue("metadata_server").url
    elif request.param == "etcd":
        url = _etcd_metadata_url(request.getfixturevalue("etcd_server"))
    else:
        url = request.getfixturevalue("redis_server")
    opened = _open(url)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def key() -> str:
    """A key no other test uses (the etcd and Redis servers are shared by the session)."""
    return f"mooncake/test/{uuid.uuid4().hex}"


def _open(url: str, timeout_s: float = 5.0) -> MetadataStore:
    store = from_url(url, timeout_s)
    assert store is not None
    return store


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------
# The same suite on every backend
# ---------------------------------------------------------------------------------------

def test_put_then_get_returns_the_value(store: MetadataStore, key: str) -> None:
    store.put(key, b'{"name": "node0:12345", "buffers": []}')
    assert store.get(key) == b'{"name": "node0:12345", "buffers": []}'


def test_get_missing_key_returns_none(store: MetadataStore, key: str) -> None:
    assert store.get(key) is None


def test_put_overwrites(store: MetadataStore, key: str) -> None:
    store.put(key, b"first, longer value")
    store.put(key, b"second")
    assert store.get(key) == b"second"


def test_delete_removes_the_key(store: MetadataStore, key: str) -> None:
    store.put(key, b"value")
    store.delete(key)
    assert store.get(key) is None


def test_delete_missing_key_is_not_an_error(store: MetadataStore, key: str) -> None:
    store.delete(key)
    store.delete(key)
    assert store.get(key) is None


@pytest.mark.parametrize("value", [b"", bytes(range(256)) * 4, b"\0" * 100, b"\r\n\r\n"],
                         ids=["empty", "all-bytes", "nuls", "crlf"])
def test_binary_values_roundtrip(store: MetadataStore, key: str, value: bytes) -> None:
    store.put(key, value)
    assert store.get(key) == value


def test_largest_value_roundtrips(store: MetadataStore, key: str) -> None:
    value = os.urandom(MAX_VALUE_NBYTES)
    store.put(key, value)
    got = store.get(key)
    assert got is not None and len(got) == MAX_VALUE_NBYTES
    assert _digest(got) == _digest(value)
    store.delete(key)


@pytest.mark.parametrize("suffix", [
    "/segment/ключ/🙂", "a b+c&d=e?f#g%h", "%20%2F", "node0:12345",
])
def test_unusual_keys_are_stored_exactly(store: MetadataStore, key: str, suffix: str) -> None:
    store.put(key + suffix, suffix.encode())
    store.put(key, b"plain")
    assert store.get(key + suffix) == suffix.encode()
    assert store.get(key) == b"plain"


def test_longest_key_is_accepted(store: MetadataStore, key: str) -> None:
    long_key = key + "k" * (MAX_KEY_NBYTES - len(key))
    store.put(long_key, b"v")
    assert store.get(long_key) == b"v"
    store.delete(long_key)
    assert store.get(long_key) is None


def test_keys_sharing_a_prefix_are_independent(store: MetadataStore, key: str) -> None:
    store.put(key, b"parent")
    store.put(key + "/child", b"child")
    store.delete(key)
    assert store.get(key + "/child") == b"child"
    assert store.get(key) is None


@pytest.mark.parametrize("bad_key", [
    "", "a\0b", "k" * (MAX_KEY_NBYTES + 1), "é" * (MAX_KEY_NBYTES // 2 + 1), "\ud800",
    b"bytes-key", None, 42,
], ids=["empty", "nul", "too-long", "too-long-utf8", "surrogate", "bytes", "none", "int"])
def test_bad_keys_are_rejected(store: MetadataStore, bad_key: object) -> None:
    with pytest.raises(InvalidArgument):
        store.put(bad_key, b"v")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        store.get(bad_key)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        store.delete(bad_key)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad_value", [
    "text", bytearray(b"v"), memoryview(b"v"), None, b"x" * (MAX_VALUE_NBYTES + 1),
], ids=["str", "bytearray", "memoryview", "none", "too-large"])
def test_bad_values_are_rejected(store: MetadataStore, key: str, bad_value: object) -> None:
    with pytest.raises(InvalidArgument):
        store.put(key, bad_value)  # type: ignore[arg-type]
    assert store.get(key) is None


def test_concurrent_puts_from_threads(store: MetadataStore, key: str) -> None:
    errors: list[BaseException] = []

    def writer(thread_id: int) -> None:
        try:
            for i in range(20):
                store.put(f"{key}/{thread_id}/{i}", f"{thread_id}:{i}".encode())
        except BaseException as exc:  # reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    for t in range(4):
        for i in range(20):
            assert store.get(f"{key}/{t}/{i}") == f"{t}:{i}".encode()


def test_closed_store_raises(store: MetadataStore, key: str) -> None:
    store.close()
    store.close()
    assert store.closed
    with pytest.raises(MetadataError, match="closed"):
        store.get(key)
    with pytest.raises(MetadataError, match="closed"):
        store.put(key, b"v")
    with pytest.raises(MetadataError, match="closed"):
        store.list_prefix(key)


# ---------------------------------------------------------------------------------------
# Listing by prefix, on every backend
# ---------------------------------------------------------------------------------------

def test_list_prefix_is_a_plain_string_prefix(store: MetadataStore, key: str) -> None:
    for suffix in ("/a/b", "/a/b/c", "/a/b/d/e", "/a/bc", "/a", "/ab", "/b"):
        store.put(key + suffix, suffix.encode())
    store.put(key + "-sibling/a/b", b"outside")
    assert store.list_prefix(key + "/a/b") == [  # "a/b" also matches "a/bc"...
        (key + "/a/b", b"/a/b"), (key + "/a/b/c", b"/a/b/c"), (key + "/a/b/d/e", b"/a/b/d/e"),
        (key + "/a/bc", b"/a/bc")]
    assert store.list_prefix(key + "/a/b/") == [  # ...so directories end with the separator
        (key + "/a/b/c", b"/a/b/c"), (key + "/a/b/d/e", b"/a/b/d/e")]
    assert [k for k, _ in store.list_prefix(key + "/")] == [
        key + s for s in ("/a", "/a/b", "/a/b/c", "/a/b/d/e", "/a/bc", "/ab", "/b")]
    assert store.list_prefix(key + "/a/b/c") == [(key + "/a/b/c", b"/a/b/c")]  # a whole key


def test_list_prefix_of_nothing_is_empty(store: MetadataStore, key: str) -> None:
    assert store.list_prefix(key) == []
    store.put(key + "/x", b"v")
    assert store.list_prefix(key + "/y") == []
    assert store.list_prefix(key + "/x/") == []
    store.delete(key + "/x")
    assert store.list_prefix(key) == []


def test_list_prefix_values_roundtrip(store: MetadataStore, key: str) -> None:
    values = {"/empty": b"", "/bytes": bytes(range(256)) * 4, "/nuls": b"\0" * 100,
              "/crlf": b"\r\n\r\n", "/big": os.urandom(1 << 20)}
    for suffix, value in values.items():
        store.put(key + suffix, value)
    got = store.list_prefix(key + "/")
    assert [k for k, _ in got] == sorted(key + s for s in values)
    assert {k[len(key):]: _digest(v) for k, v in got} == {
        s: _digest(v) for s, v in values.items()}
    store.put(key + "/crlf", b"replaced")
    assert store.list_prefix(key + "/crlf") == [(key + "/crlf", b"replaced")]


@pytest.mark.parametrize("suffix", ["*", "?", "[a]", "[!a]", "\\", "a\\*", "%2A", "^-"],
                         ids=["star", "question", "class", "negated", "backslash",
                              "escaped-star", "percent", "caret-dash"])
def test_list_prefix_glob_characters_are_literal(store: MetadataStore, key: str,
                                                 suffix: str) -> None:
    # Read as a glob, each suffix would match some of these keys; literally, none.
    for other in ("/a", "/ax", "/b", "/x", "/a*", "/a\\", "/%2a"):
        store.put(key + other, b"other")
    store.put(key + "/" + suffix, b"exact")
    store.put(key + "/" + suffix + "/child", b"child")
    assert store.list_prefix(key + "/" + suffix) == [
        (key + "/" + suffix, b"exact"), (key + "/" + suffix + "/child", b"child")]


def test_list_prefix_of_non_ascii_keys(store: MetadataStore, key: str) -> None:
    # "п" is D0 BF in UTF-8 and "р" is D1 80: the prefix's range end must be built on bytes.
    for suffix in ("/п", "/п/1", "/пa", "/р", "/р/1", "/ж", "/з", "/🙂/x", "/🙃/x"):
        store.put(key + suffix, suffix.encode())
    assert [k for k, _ in store.list_prefix(key + "/п")] == [key + "/п", key + "/п/1",
                                                             key + "/пa"]
    assert [k for k, _ in store.list_prefix(key + "/ж")] == [key + "/ж"]
    assert store.list_prefix(key + "/🙂") == [(key + "/🙂/x", "/🙂/x".encode())]


def test_list_prefix_of_many_keys(store: MetadataStore, key: str) -> None:
    nkeys = 1100  # more than one Redis SCAN/MGET batch
    for i in range(nkeys):
        store.put(f"{key}/{i:05d}", str(i).encode())
    got = store.list_prefix(key + "/")
    assert got == [(f"{key}/{i:05d}", str(i).encode()) for i in range(nkeys)]
    assert len(store.list_prefix(key + "/001")) == 100


def test_list_prefix_sees_concurrent_writers_finish(store: MetadataStore, key: str) -> None:
    errors: list[BaseException] = []

    def writer(thread_id: int) -> None:
        try:
            for i in range(20):
                store.put(f"{key}/{thread_id}/{i:02d}", b"v")
                store.list_prefix(f"{key}/")  # listings interleave with the writes
        except BaseException as exc:  # reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    assert [k for k, _ in store.list_prefix(key + "/")] == [
        f"{key}/{t}/{i:02d}" for t in range(4) for i in range(20)]


@pytest.mark.parametrize("bad_prefix", [
    "", "a\0b", "k" * (MAX_KEY_NBYTES + 1), "\ud800", b"bytes-prefix", None, 42,
], ids=["empty", "nul", "too-long", "surrogate", "bytes", "none", "int"])
def test_bad_prefixes_are_rejected(store: MetadataStore, bad_prefix: object) -> None:
    with pytest.raises(InvalidArgument, match="prefix"):
        store.list_prefix(bad_prefix)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# Backend specifics: keys land under the exact name given
# ---------------------------------------------------------------------------------------

@pytest.mark.etcd
def test_etcd_stores_under_the_exact_key(etcd_server: str, key: str) -> None:
    import etcd3gw

    full_key = key + "/ключ"
    with _open(_etcd_metadata_url(etcd_server)) as store:
        store.put(full_key, b"\x00descriptor")
    host, _, port = urlsplit(etcd_server).netloc.rpartition(":")
    raw = etcd3gw.Etcd3Client(host=host, port=int(port))
    try:
        assert raw.get(full_key.encode("utf-8")) == [b"\x00descriptor"]
        raw.delete(full_key.encode("utf-8"))
    finally:
        raw.session.close()


@pytest.mark.redis
def test_redis_stores_under_the_exact_key_in_the_chosen_db(redis_server: str, key: str) -> None:
    import redis

    with _open(redis_server + "/3") as store:
        store.put(key, b"in db 3")
    raw3 = redis.Redis.from_url(redis_server + "/3")
    raw0 = redis.Redis.from_url(redis_server + "/0")
    try:
        assert raw3.get(key) == b"in db 3"
        assert raw0.get(key) is None
        raw3.delete(key)
    finally:
        raw3.close()
        raw0.close()


# ---------------------------------------------------------------------------------------
# from_url parsing (no server is contacted: stores connect on first use)
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("url, scheme, host, port, extra", [
    ("http://127.0.0.1:8080/metadata", "http", "127.0.0.1", 8080, "/metadata"),
    ("https://meta.example:8443/metadata", "https", "meta.example", 8443, "/metadata"),
    ("http://meta.example/metadata", "http", "meta.example", 80, "/metadata"),
    ("etcd://10.0.0.1:2379", "etcd", "10.0.0.1", 2379, None),
    ("etcd://etcd.local", "etcd", "etcd.local", 2379, None),
    ("10.0.0.1:2379", "etcd", "10.0.0.1", 2379, None),
    ("localhost:12379", "etcd", "localhost", 12379, None),
    ("[::1]:2379", "etcd", "::1", 2379, None),
    ("redis://10.0.0.2:6379", "redis", "10.0.0.2", 6379, 0),
    ("redis://10.0.0.2:6380/5", "redis", "10.0.0.2", 6380, 5),
    ("redis://cache", "redis", "cache", 6379, 0),
])
def test_parse_url_accepts_the_original_forms(url: str, scheme: str, host: str, port: int,
                                              extra: object) -> None:
    target = parse_url(url)
    assert target is not None
    assert (target.scheme, target.host, target.port) == (scheme, host, port)
    if scheme.startswith("http"):
        assert target.path == extra
    if scheme == "redis":
        assert target.db == extra


@pytest.mark.parametrize("url, cls_name", [
    ("http://127.0.0.1:8080/metadata", "HttpMetadataStore"),
    ("etcd://127.0.0.1:2379", "EtcdMetadataStore"),
    ("127.0.0.1:2379", "EtcdMetadataStore"),
    ("redis://127.0.0.1:6379/1", "RedisMetadataStore"),
])
def test_from_url_picks_the_backend(url: str, cls_name: str) -> None:
    store = from_url(url)
    assert store is not None
    try:
        assert type(store).__name__ == cls_name
        assert store.url == url
    finally:
        store.close()


@pytest.mark.parametrize("url", ["P2PHANDSHAKE", " P2PHANDSHAKE\n"])
def test_p2p_handshake_means_no_store(url: str) -> None:
    assert from_url(url) is None


@pytest.mark.parametrize("url", [
    "", "   ", "ftp://h:21", "p2phandshake", "localhost", "etcd://:2379", "http:///metadata",
    "http://h:99999/metadata", "http://h:0/metadata", "host:notaport", "[::1",
    "etcd://h:2379/path", "redis://h:6379/abc", "redis://user:pw@h:6379",
    "http://h:8080/metadata?key=x", "etcd://h1:2379;h2:2379",
])
def test_bad_urls_list_the_accepted_forms(url: str) -> None:
    with pytest.raises(InvalidArgument, match="accepted forms") as info:
        from_url(url)
    assert "P2PHANDSHAKE" in str(info.value) and "redis://" in str(info.value)


def test_non_str_url_and_bad_timeout_are_rejected() -> None:
    with pytest.raises(InvalidArgument, match="accepted forms"):
        from_url(b"etcd://h:2379")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="timeout_s"):
        from_url("etcd://h:2379", timeout_s=0)


def test_backends_are_imported_only_when_used() -> None:
    code = (
        "import sys\n"
        "from mooncake_plugins.transfer.metadata import from_url\n"
        "from_url('http://127.0.0.1:1/metadata').close()\n"
        "assert 'etcd3gw' not in sys.modules and 'redis' not in sys.modules, sys.modules\n"
        "from_url('redis://127.0.0.1:1').close()\n"
        "assert 'redis' in sys.modules and 'etcd3gw' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, env=_child_env())
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------------------
# Unreachable servers
# ---------------------------------------------------------------------------------------

@pytest.fixture
def dead_port() -> Iterator[int]:
    """A loopback port that is bound (so nobody else takes it) but refuses connections."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.mark.parametrize("template", [
    "http://127.0.0.1:{port}/metadata", "etcd://127.0.0.1:{port}", "127.0.0.1:{port}",
    "redis://127.0.0.1:{port}",
])
def test_unreachable_server_raises_metadata_error_naming_the_url(dead_port: int,
                                                                 template: str) -> None:
    url = template.format(port=dead_port)
    store = _open(url, timeout_s=2.0)
    try:
        with pytest.raises(MetadataError) as put_info:
            store.put("k", b"v")
        with pytest.raises(MetadataError) as get_info:
            store.get("k")
        with pytest.raises(MetadataError) as delete_info:
            store.delete("k")
        with pytest.raises(MetadataError) as list_info:
            store.list_prefix("k")
        for info in (put_info, get_info, delete_info, list_info):
            assert url in str(info.value)
    finally:
        store.close()


# ---------------------------------------------------------------------------------------
# HTTP server: protocol and robustness
# ---------------------------------------------------------------------------------------

def _exchange(port: int, data: bytes, shut_write: bool = False) -> bytes:
    """Send raw bytes and read the reply until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        if shut_write:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def _assert_still_serving(server: MetadataServer) -> None:
    with _open(server.url) as store:
        store.put("alive", b"yes")
        assert store.get("alive") == b"yes"


def test_http_protocol_matches_the_original(metadata_server: MetadataServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", metadata_server.port, timeout=10)
    try:
        conn.request("GET", "/metadata?key=seg%2F0")
        response = conn.getresponse()
        assert (response.status, response.read()) == (404, b"metadata not found")
        conn.request("PUT", "/metadata?key=seg%2F0", body=b"\x01\x02descriptor")
        response = conn.getresponse()
        assert response.status == 200
        response.read()
        conn.request("GET", "/metadata?key=seg/0")  # same key, and the connection is reused
        response = conn.getresponse()
        assert (response.status, response.read()) == (200, b"\x01\x02descriptor")
        conn.request("DELETE", "/metadata?key=seg%2F0")
        response = conn.getresponse()
        assert response.status == 200
        response.read()
        conn.request("DELETE", "/metadata?key=seg%2F0")
        assert conn.getresponse().status == 404
    finally:
        conn.close()


@pytest.mark.parametrize("request_bytes, status", [
    (b"\x00\xff\xfe garbage \x01\r\n\r\n", 400),
    (b"GET /metadata HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /metadata?key= HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /metadata?other=1 HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /metadata?key=%ff%fe HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /metadata?key=a%00b HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /other?key=a HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"POST /metadata?key=a HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx", 405),
    (b"PATCH /metadata?key=a HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    (b"BREW /metadata?key=a HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    (b"PUT /metadata?key=a HTTP/1.1\r\nHost: x\r\n\r\n", 411),
    (b"PUT /metadata?key=a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"1\r\nx\r\n0\r\n\r\n", 411),
    (b"PUT /metadata?key=a HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
    (b"PUT /metadata?key=a HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
    (b"PUT /metadata?key=a HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
     b"Content-Length: 2\r\n\r\nxy", 400),
    (b"PUT /metadata?key=a HTTP/1.1\r\nHost: x\r\nContent-Length: "
     + str(MAX_VALUE_NBYTES + 1).encode() + b"\r\n\r\n", 413),
    (b"PUT /metadata?key=a HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n",
     413),
    (b"GET /metadata?prefix= HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /metadata?prefix HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /metadata?prefix=%ff HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /metadata?prefix=a%00 HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /metadata?prefix=" + b"k" * (MAX_KEY_NBYTES + 1) + b" HTTP/1.1\r\nHost: x\r\n\r\n",
     400),
    (b"GET /metadata?prefix=a&prefix=b HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /metadata?key=a&prefix=a HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /metadata?prefix=a&key=a HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"PUT /metadata?key=a&prefix=a HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx", 400),
    (b"PUT /metadata?prefix=a HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx", 400),
    (b"DELETE /metadata?prefix=a HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"DELETE /metadata?key=a&prefix=a HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"POST /metadata?prefix=a HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx", 405),
    (b"GET /other?prefix=a HTTP/1.1\r\nHost: x\r\n\r\n", 404),
], ids=["garbage", "no-key", "empty-key", "other-param", "non-utf8-key", "nul-key",
        "other-path", "post", "patch", "unknown-method", "no-length", "chunked",
        "length-not-a-number", "negative-length", "two-lengths", "over-16MiB", "huge-length",
        "empty-prefix", "bare-prefix", "non-utf8-prefix", "nul-prefix", "too-long-prefix",
        "two-prefixes", "key-and-prefix", "prefix-and-key", "put-key-and-prefix",
        "put-prefix", "delete-prefix", "delete-key-and-prefix", "post-prefix",
        "other-path-prefix"])
def test_http_server_answers_bad_requests_with_4xx(metadata_server: MetadataServer,
                                                   request_bytes: bytes, status: int) -> None:
    reply = _exchange(metadata_server.port, request_bytes)
    assert _status(reply) == status, reply[:200]
    assert b"Connection: close" in reply
    with _open(metadata_server.url) as store:
        assert store.get("a") is None
    _assert_still_serving(metadata_server)


def test_http_listing_route(metadata_server: MetadataServer) -> None:
    with _open(metadata_server.url) as store:
        store.put("seg/b", b"\x00two")
        store.put("seg/a", b"one")
        store.put("seg/a b&c=d", b"")
        store.put("segment", b"not under seg/")
    conn = http.client.HTTPConnection("127.0.0.1", metadata_server.port, timeout=10)
    try:
        conn.request("GET", "/metadata?prefix=" + quote("seg/", safe=""))
        response = conn.getresponse()
        assert response.status == 200
        assert response.getheader("Content-Type") == "application/msgpack"
        assert msgpack.unpackb(response.read(), raw=False) == [
            ["seg/a", b"one"], ["seg/a b&c=d", b""], ["seg/b", b"\x00two"]]
        conn.request("GET", "/metadata?prefix=nothing")  # the connection is reused
        response = conn.getresponse()
        assert (response.status, response.read()) == (200, msgpack.packb([]))
        conn.request("GET", "/metadata?key=seg/a")  # key= answers exactly as before
        response = conn.getresponse()
        assert (response.status, response.read()) == (200, b"one")
        conn.request("GET", "/metadata?key=seg/a&prefix=seg/")
        response = conn.getresponse()
        assert (response.status, response.read()) == (400, b"give either key or prefix, not both")
    finally:
        conn.close()


def test_http_listing_over_64MiB_is_refused_with_413(metadata_server: MetadataServer,
                                                     key: str) -> None:
    value = os.urandom(MAX_VALUE_NBYTES)
    with _open(metadata_server.url, timeout_s=30.0) as store:
        for i in range(MAX_LIST_NBYTES // MAX_VALUE_NBYTES - 1):
            store.put(f"{key}/{i}", value)
        assert len(store.list_prefix(key + "/")) == 3  # 48 MiB: still served
        store.put(f"{key}/last", value)
        with pytest.raises(MetadataError, match="over 67108864 bytes; list a longer prefix"):
            store.list_prefix(key + "/")
        assert [k for k, _ in store.list_prefix(key + "/l")] == [f"{key}/last"]
    reply = _exchange(metadata_server.port,
                      f"GET /metadata?prefix={key}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert _status(reply) == 413 and b"Connection: close" in reply
    _assert_still_serving(metadata_server)


def test_http_listing_with_a_body_closes_the_connection(
        metadata_server: MetadataServer) -> None:
    reply = _exchange(metadata_server.port, b"GET /metadata?prefix=a HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Length: 26\r\n\r\nGET /metadata?key=a HTTP/1.1")
    assert _status(reply) == 200 and b"Connection: close" in reply
    assert reply.count(b"HTTP/1.1 ") == 1  # the body was not taken for a second request
    _assert_still_serving(metadata_server)


def test_http_head_on_the_listing_route_gets_405(metadata_server: MetadataServer) -> None:
    reply = _exchange(metadata_server.port,
                      b"HEAD /metadata?prefix=a HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _status(reply) == 405
    assert reply.endswith(b"\r\n\r\n")


class _FixedReplyHandler(BaseHTTPRequestHandler):
    """Answers every GET with the server's ``reply``: (status, content type, body)."""

    protocol_version = "HTTP/1.1"
    server: _FixedReplyServer

    def do_GET(self) -> None:
        status, content_type, body = self.server.reply
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class _FixedReplyServer(ThreadingHTTPServer):
    daemon_threads = True
    reply: tuple[int, str, bytes]


@pytest.fixture
def fixed_reply_server() -> Iterator[_FixedReplyServer]:
    """An HTTP server that answers every GET with ``server.reply`` (set by the test)."""
    server = _FixedReplyServer(("127.0.0.1", 0), _FixedReplyHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.mark.parametrize("reply", [
    (400, "text/plain", b"metadata key is required"),  # the original Mooncake server
    (404, "text/plain", b"not found"),
    (405, "text/plain", b"method not allowed"),
    (200, "application/octet-stream", b"a value, prefix= ignored"),
], ids=["original-400", "404", "405", "ignores-prefix"])
def test_http_server_that_cannot_list(fixed_reply_server: _FixedReplyServer,
                                      reply: tuple[int, str, bytes]) -> None:
    fixed_reply_server.reply = reply
    url = f"http://127.0.0.1:{fixed_reply_server.server_address[1]}/metadata"
    with _open(url) as store, pytest.raises(MetadataError, match="cannot list keys") as info:
        store.list_prefix("seg/")
    assert f"HTTP {reply[0]}" in str(info.value)


@pytest.mark.parametrize("body, match", [
    (b"\xc1", "malformed"),
    (msgpack.packb([["seg/a", b"v"]]) + b"\x00", "malformed"),
    (msgpack.packb({"seg/a": b"v"}), "not an array"),
    (msgpack.packb([["seg/a", "str value"]]), "bad entry"),
    (msgpack.packb([["seg/a", b"v", 3]]), "bad entry"),
    (msgpack.packb([["other", b"v"]]), "bad entry"),
    (msgpack.packb([[b"seg/a", b"v"]]), "bad entry"),
], ids=["invalid", "trailing", "map", "str-value", "triple", "outside-prefix", "bin-key"])
def test_http_client_rejects_a_malformed_listing(fixed_reply_server: _FixedReplyServer,
                                                 body: bytes, match: str) -> None:
    fixed_reply_server.reply = (200, "application/msgpack", body)
    url = f"http://127.0.0.1:{fixed_reply_server.server_address[1]}/metadata"
    with _open(url) as store, pytest.raises(MetadataError, match=match):
        store.list_prefix("seg/")


def test_http_server_head_gets_405_without_body(metadata_server: MetadataServer) -> None:
    reply = _exchange(metadata_server.port, b"HEAD /metadata?key=a HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _status(reply) == 405
    assert reply.endswith(b"\r\n\r\n")


def test_http_server_drops_a_truncated_body(metadata_server: MetadataServer) -> None:
    reply = _exchange(metadata_server.port,
                      b"PUT /metadata?key=a HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc",
                      shut_write=True)
    assert reply == b""
    with _open(metadata_server.url) as store:
        assert store.get("a") is None
    _assert_still_serving(metadata_server)


def test_http_server_serves_others_while_a_client_stalls(
        metadata_server: MetadataServer) -> None:
    with socket.create_connection(("127.0.0.1", metadata_server.port), timeout=10) as stalled:
        stalled.sendall(b"PUT /metadata?key=a HTTP/1.1\r\nContent-Length: 100\r\n\r\npart")
        _assert_still_serving(metadata_server)


def test_http_server_stop_closes_open_connections() -> None:
    server = MetadataServer().start()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", "/metadata?key=a")  # keep-alive: the connection stays open
        assert conn.getresponse().status == 404
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 5.0
        assert not [t for t in threading.enumerate() if t.name.startswith("metadata-server")]
        with pytest.raises(MetadataError):
            _open(server.url, timeout_s=2.0).get("a")
    finally:
        conn.close()
        server.stop()


def test_http_server_bind_failure_is_a_metadata_error() -> None:
    with MetadataServer() as first, pytest.raises(MetadataError, match="cannot listen"):
        MetadataServer(port=first.port).start()


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------

def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


_CLI = [sys.executable, "-m", "mooncake_plugins.cli.metadata_server"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_cli_serves_until_signalled(key: str, signum: int) -> None:
    proc, port = spawn_ready([*_CLI, "--port", "0"], timeout_s=30, env=_child_env())
    try:
        with _open(f"http://127.0.0.1:{port}/metadata") as store:
            store.put(key, b"from the cli test")
            assert store.get(key) == b"from the cli test"
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == 0
    finally:
        terminate_group(proc)


def test_cli_reports_a_busy_port(dead_port: int) -> None:
    result = subprocess.run([*_CLI, "--port", str(dead_port)], capture_output=True,
                            text=True, timeout=60, env=_child_env())
    assert result.returncode == 1
    assert "cannot listen" in result.stderr
    assert "READY" not in result.stdout


def test_cli_limits_the_room_for_values(key: str) -> None:
    proc, port = spawn_ready([*_CLI, "--port", "0", "--max-bytes", "4096"], timeout_s=30,
                             env=_child_env())
    try:
        with _open(f"http://127.0.0.1:{port}/metadata") as store:
            store.put(key, b"x" * 1000)
            with pytest.raises(MetadataError):
                store.put(key + "-big", b"x" * 8192)
            assert store.get(key) == b"x" * 1000
    finally:
        terminate_group(proc)


def test_cli_rejects_bad_limits() -> None:
    result = subprocess.run([*_CLI, "--port", "0", "--max-connections", "0"], capture_output=True,
                            text=True, timeout=60, env=_child_env())
    assert result.returncode == 2 and "must be positive" in result.stderr
