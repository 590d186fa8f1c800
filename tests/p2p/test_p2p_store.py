"""P2P store: real node processes (tests/p2p/node.py) over the HTTP metadata server, etcd
and Redis; fan-out through earlier getters, dead holders, unregister/list, bad inputs,
lossless concurrent directory updates and a metadata server that cannot list."""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from helpers import terminate_group

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.errors import (InvalidArgument, MetadataError, ObjectAlreadyExists,
                                     ObjectNotFound, TransferError)
from mooncake_plugins.p2p import P2PStore
from mooncake_plugins.p2p.store import _Directory
from mooncake_plugins.transfer import TransferEngine
from mooncake_plugins.transfer.metadata import from_url

NODE = str(Path(__file__).with_name("node.py"))
PARTS = [1 << 20, (1 << 20) + 4096, 3 << 19, 123_457]  # 256 KiB chunks: several per part
SIZE = sum(PARTS)


class Node:
    """A running node.py: its segment and a JSON-line command channel."""

    def __init__(self, metadata_url: str, timeout_s: float = 30.0) -> None:
        self.proc = subprocess.Popen([sys.executable, NODE, "--metadata", metadata_url],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        line = self._readline(timeout_s)
        if not line.startswith("READY "):
            terminate_group(self.proc)
            raise RuntimeError(f"node did not start: {line!r}\n{self.proc.stderr.read().decode()}")
        self.segment: str = json.loads(line[6:])["segment"]

    def _readline(self, timeout_s: float) -> str:
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"node {self.proc.pid} did not answer within {timeout_s} s")
        return self.proc.stdout.readline().decode().strip()

    def send(self, cmd: str, **kw: Any) -> None:
        self.proc.stdin.write((json.dumps({"cmd": cmd, **kw}) + "\n").encode())
        self.proc.stdin.flush()

    def reply(self, timeout_s: float = 60.0) -> dict:
        line = self._readline(timeout_s)
        if not line:
            raise RuntimeError(f"node exited: {self.proc.stderr.read().decode()[-3000:]}")
        return json.loads(line)

    def ask(self, cmd: str, **kw: Any) -> dict:
        self.send(cmd, **kw)
        return self.reply()

    def ok(self, cmd: str, **kw: Any) -> dict:
        out = self.ask(cmd, **kw)
        assert out["ok"], out
        return out

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send("quit")
                self.proc.wait(timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            terminate_group(self.proc)


def _url(request: pytest.FixtureRequest, backend: str) -> str:
    if backend == "http":
        return request.getfixturevalue("metadata_server").url
    if backend == "etcd":
        return "etcd://" + request.getfixturevalue("etcd_server").split("://", 1)[1]
    return request.getfixturevalue("redis_server")


BACKENDS = ["http", pytest.param("etcd", marks=pytest.mark.etcd),
            pytest.param("redis", marks=pytest.mark.redis)]


@pytest.fixture(params=BACKENDS)
def metadata_url(request: pytest.FixtureRequest) -> str:
    return _url(request, request.param)


@pytest.fixture
def spawn(metadata_url: str) -> Iterator:
    """Factory: ``spawn()`` starts a node on ``metadata_url``; every node ends after the test."""
    nodes: list[Node] = []

    def start() -> Node:
        nodes.append(Node(metadata_url))
        return nodes[-1]

    try:
        yield start
    finally:
        for node in nodes:
            node.close()


@pytest.fixture
def ns() -> str:
    """A fresh name prefix: etcd and redis outlive a test, so names must not collide."""
    return f"t{uuid.uuid4().hex[:8]}/"


def expected_sha(seed: int, sizes: list[int] = PARTS) -> str:
    rng = np.random.default_rng(seed)
    h = hashlib.sha256()
    for n in sizes:
        h.update(rng.integers(0, 256, size=n, dtype=np.uint8).data)
    return h.hexdigest()


# -- cross-process ---------------------------------------------------------------------------

def test_later_getters_read_from_earlier_getters(spawn, ns):
    provider, *getters = [spawn() for _ in range(5)]
    assert provider.ok("register", name=ns + "ckpt/step-100", parts=PARTS, seed=7)["sha"] == \
        expected_sha(7)
    first = getters[0].ok("get", name=ns + "ckpt/step-100")
    assert first["sha"] == expected_sha(7)
    assert first["read_from"] == {provider.segment: SIZE}  # the only holder so far
    for g in getters[1:]:  # three at once: they also add themselves concurrently
        g.send("get", name=ns + "ckpt/step-100")
    answers = [g.reply() for g in getters[1:]]
    for a in answers:
        assert a["ok"], a
        assert a["sha"] == expected_sha(7)
        assert provider.segment not in a["read_from"]  # replicas exist: the provider is spared
        assert sum(a["read_from"].values()) == SIZE
    served = {n.segment: n.ok("stats")["bytes_out"] for n in [provider, *getters]}
    print(f"\nprovider bytes_out {served[provider.segment]} for {len(getters)} getters x "
          f"{SIZE} bytes = {len(getters) * SIZE}; all nodes served {sum(served.values())}")
    assert served[provider.segment] == SIZE  # well below getters x size
    assert sum(served.values()) == len(getters) * SIZE
    # no holder entry was lost to the concurrent adds
    holders = provider.ok("holders", name=ns + "ckpt/step-100")["segments"]
    assert sorted(holders) == sorted(n.segment for n in [provider, *getters])


def test_killed_holders_are_skipped(spawn, ns):
    provider, g1, g2, g3, g4 = [spawn() for _ in range(5)]
    provider.ok("register", name=ns + "shard", parts=PARTS, seed=3)
    g1.ok("get", name=ns + "shard")
    g1.kill()
    got = g2.ok("get", name=ns + "shard")  # g1 is the only replica: tried first, then the provider
    assert got["sha"] == expected_sha(3)
    assert got["failed"] == [g1.segment]
    assert got["read_from"] == {provider.segment: SIZE}
    # g2 found g1 dead and delisted it: later getters do not try it again
    assert sorted(g3.ok("holders", name=ns + "shard")["segments"]) == sorted(
        [provider.segment, g2.segment])
    provider.kill()  # the record stays; g2 still serves it
    got = g3.ok("get", name=ns + "shard")
    assert got["sha"] == expected_sha(3)
    assert got["read_from"] == {g2.segment: SIZE} and got["failed"] == []
    g2.kill()
    g3.kill()
    lost = g4.ask("get", name=ns + "shard")
    assert not lost["ok"] and lost["error"] == "TransferError", lost
    assert g4.ok("holders", name=ns + "shard")["segments"] == []  # all three were delisted


def test_last_replica_out_removes_record_of_dead_provider(spawn, ns):
    provider, g1, g2 = spawn(), spawn(), spawn()
    provider.ok("register", name=ns + "tmp", parts=[4096], seed=1)
    g1.ok("get", name=ns + "tmp")
    g2.ok("get", name=ns + "tmp")
    provider.kill()
    g1.ok("unregister", name=ns + "tmp")  # g2 is alive: the object stays
    assert g2.ok("list", prefix=ns)["names"] == [ns + "tmp"]
    g2.ok("unregister", name=ns + "tmp")  # only the dead provider is left listed
    assert g1.ok("list", prefix=ns)["names"] == []
    assert g1.ask("get", name=ns + "tmp")["error"] == "ObjectNotFound"


def test_unregister_and_list(spawn, ns):
    provider, getter = spawn(), spawn()
    for name, seed in (("ckpt/a", 1), ("ckpt/b", 2), ("other", 3)):
        provider.ok("register", name=ns + name, parts=PARTS, seed=seed)
    assert getter.ok("list", prefix=ns)["names"] == [ns + "ckpt/a", ns + "ckpt/b", ns + "other"]
    assert getter.ok("list", prefix=ns + "ckpt/")["names"] == [ns + "ckpt/a", ns + "ckpt/b"]
    assert getter.ok("list", prefix=ns + "nothing")["names"] == []
    again = provider.ask("register", name=ns + "ckpt/b", parts=PARTS, seed=2)
    assert again["error"] == "ObjectAlreadyExists", again

    assert getter.ok("get", name=ns + "ckpt/a")["sha"] == expected_sha(1)
    assert sorted(getter.ok("holders", name=ns + "ckpt/a")["segments"]) == sorted(
        [provider.segment, getter.segment])
    getter.ok("unregister", name=ns + "ckpt/a")  # a replica leaves: the object stays
    assert getter.ok("holders", name=ns + "ckpt/a")["segments"] == [provider.segment]
    assert getter.ask("unregister", name=ns + "ckpt/a")["error"] == "InvalidArgument"

    got = getter.ok("get", name=ns + "ckpt/a", serve=False)  # read without becoming a holder
    assert got["sha"] == expected_sha(1)
    assert getter.ok("holders", name=ns + "ckpt/a")["segments"] == [provider.segment]

    getter.ok("get", name=ns + "ckpt/b")
    provider.ok("unregister", name=ns + "ckpt/b")  # the provider withdraws the object
    assert getter.ok("list", prefix=ns)["names"] == [ns + "ckpt/a", ns + "other"]
    still_held = getter.ask("get", name=ns + "ckpt/b", parts=PARTS)  # its replica is still held
    assert still_held["error"] == "ObjectAlreadyExists"
    getter.ok("unregister", name=ns + "ckpt/b")
    assert getter.ask("get", name=ns + "ckpt/b")["error"] == "ObjectNotFound"
    provider.ok("register", name=ns + "ckpt/b", parts=[8192], seed=9)  # the name is free again
    assert getter.ok("get", name=ns + "ckpt/b")["sha"] == expected_sha(9, [8192])

    provider.close()  # close() unregisters everything it provided
    assert getter.ok("list", prefix=ns)["names"] == []


# -- in-process: bad inputs and directories --------------------------------------------------

@pytest.fixture
def stores(metadata_url: str) -> Iterator[tuple[P2PStore, P2PStore]]:
    made = []
    try:
        for _ in range(2):
            made.append(P2PStore(metadata_url, "127.0.0.1"))
        yield made[0], made[1]
    finally:
        for s in made:
            s.close()


def test_bad_inputs(stores, ns):
    a, b = stores
    parts = [np.arange(4096, dtype=np.uint8), np.ones(10_000, dtype=np.uint8)]
    with pytest.raises(InvalidArgument, match="P2PHANDSHAKE"):
        P2PStore("P2PHANDSHAKE")
    with pytest.raises(InvalidArgument):
        P2PStore("ftp://nowhere:1")
    for bad in ("", "a\0b", "x" * 600, 7):
        with pytest.raises(InvalidArgument):
            a.register(bad, parts)
    with pytest.raises(InvalidArgument):
        a.register(ns + "empty", [])
    with pytest.raises(InvalidArgument):
        a.register(ns + "zero", [bytearray(0)])
    with pytest.raises(InvalidArgument):
        a.register(ns + "notalist", bytearray(10))
    a.register(ns + "obj", parts)
    with pytest.raises(ObjectAlreadyExists):
        b.register(ns + "obj", [bytearray(5)])
    with pytest.raises(ObjectNotFound, match="unknown"):
        b.get_replica(ns + "unknown", [bytearray(4096)])
    with pytest.raises(InvalidArgument, match="2 parts"):
        b.get_replica(ns + "obj", [bytearray(4096)])
    with pytest.raises(InvalidArgument, match="10000"):
        b.get_replica(ns + "obj", [bytearray(4096), bytearray(9_999)])
    with pytest.raises(InvalidArgument, match="read-only"):
        b.get_replica(ns + "obj", [bytes(4096), bytearray(10_000)])
    with pytest.raises(InvalidArgument):
        b.unregister(ns + "obj")  # b does not hold it
    assert b.engine.regions() == []  # failed calls left nothing registered
    out = [bytearray(4096), np.zeros(10_000, dtype=np.uint8)]
    report = b.get_replica(ns + "obj", out, serve=False)
    assert report.read_from == {a.segment: 14_096} and report.failed == []
    assert bytes(out[0]) == parts[0].tobytes() and (out[1] == 1).all()
    assert b.engine.regions() == []  # serve=False: registered only for the read
    # (address, nbytes) pairs of memory the engine already has
    buf = b.engine.allocate(16384)
    b.get_replica(ns + "obj", [(buf.address, 4096), (buf.address + 4096, 10_000)])
    assert bytes(buf.view()[:4096]) == parts[0].tobytes()
    assert b.held() == [ns + "obj"]
    b.unregister(ns + "obj")
    b.engine.free(buf)
    b.register(ns + "replaced", [bytearray(b"old" * 100)])
    a.register(ns + "replaced", [bytearray(b"new" * 200)], replace=True)
    assert a.describe(ns + "replaced").part_nbytes == (600,)


def test_all_holders_unreachable(metadata_url, ns):
    with P2PStore(metadata_url) as a:
        gone = TransferEngine("127.0.0.1", metadata_url, config=EngineConfig(transports=["tcp"]))
        p = P2PStore(metadata_url, engine=gone)
        p.register(ns + "orphan", [bytearray(4096)])
        p._held.clear()  # leave it published, as a crashed process would
        p.close()
        gone.close()
        with pytest.raises(TransferError, match="no holder left"):
            a.get_replica(ns + "orphan", [bytearray(4096)])
        assert a.engine.regions() == []


def test_buffers_registered_privately_elsewhere(stores, ns):
    a, b = stores
    src = bytearray(b"p" * 8192)
    private = a.engine.register(src, private=True)  # not published: peers cannot read it
    with pytest.raises(InvalidArgument, match="privately registered"):
        a.register(ns + "private", [src])
    a.engine.unregister(private)
    a.register(ns + "private", [src])
    dst = bytearray(8192)
    region = b.engine.register(dst, private=True)
    report = b.get_replica(ns + "private", [dst], serve=False)  # reads into it as it is
    assert report.read_from == {a.segment: 8192} and bytes(dst) == bytes(src)
    assert b.engine.regions() == [] and b.engine.is_registered(region.address, 8192)
    b.engine.unregister(region)


def test_list_is_by_plain_prefix_and_literal(stores, ns):
    a, b = stores
    names = ["ckpt/1", "ckpt/10", "ckpt/2/x", "glob*[a]?\\", "glob-other", "ключ/🙂"]
    for name in names:
        a.register(ns + name, [bytearray(4096)])
    assert b.list(ns) == sorted(ns + n for n in names)
    assert b.list(ns + "ckpt/1") == [ns + "ckpt/1", ns + "ckpt/10"]  # a string prefix
    assert b.list(ns + "ckpt/2/") == [ns + "ckpt/2/x"]
    assert b.list(ns + "glob*") == [ns + "glob*[a]?\\"]  # Redis glob characters are literal
    assert b.list(ns + "glob?") == []
    assert b.list(ns + "ключ/") == [ns + "ключ/🙂"]
    with pytest.raises(InvalidArgument):
        b.list(ns + "a\0")
    a.unregister(ns + "ckpt/10")
    assert b.list(ns + "ckpt/1") == [ns + "ckpt/1"]


class _NoListingHandler(BaseHTTPRequestHandler):
    """Stands in for the original Mooncake metadata server: ``key=`` only."""

    def do_GET(self) -> None:
        self.send_response(400)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_a_metadata_server_that_cannot_list_is_refused_at_once():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoListingHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metadata"
        with pytest.raises(MetadataError, match="cannot list keys"):
            P2PStore(url)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_directory_adds_lose_nothing(request, backend):
    url = _url(request, backend)
    clients = [from_url(url) for _ in range(8)]
    try:
        dirs = [_Directory(c) for c in clients]
        for round_ in range(4):
            base = f"test/p2p-dir/{time.monotonic_ns()}/{round_}"
            barrier = threading.Barrier(len(dirs))
            errors: list[BaseException] = []

            def add(i: int) -> None:
                try:
                    barrier.wait()
                    dirs[i].add(base, f"m{i}", str(i).encode())
                except BaseException as exc:  # surfaced below
                    errors.append(exc)

            threads = [threading.Thread(target=add, args=(i,)) for i in range(len(dirs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors
            assert dirs[1].entries(base) == [(f"m{i}", str(i).encode()) for i in range(8)]
            clients[0].put(base + "-sibling/m9", b"not in the directory")
            dirs[0].remove(base, "m3")
            dirs[0].remove(base, "m3")  # removing a missing member is not an error
            assert [m for m, _ in dirs[1].entries(base)] == [f"m{i}" for i in range(8) if i != 3]
            dirs[0].destroy(base)
            assert dirs[1].entries(base) == []
            assert clients[1].get(base + "-sibling/m9") == b"not in the directory"
            clients[0].delete(base + "-sibling/m9")
    finally:
        for c in clients:
            c.close()
