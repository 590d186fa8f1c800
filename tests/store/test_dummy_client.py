"""Standalone-store mode: a ``mooncake_client`` host process and dummy clients using it.

The host and the master are real processes; dummies run in this process (through the
compat ``setup_dummy``) or as child processes (the concurrent and kill -9 cases).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import pytest
from helpers import LineChild, spawn_ready, terminate_group, wait_until

from mooncake_plugins.compat.store import MooncakeDistributedStore
from mooncake_plugins.store.local import DummyClient
from mooncake_plugins.store.rpc import RpcClient

HOST = [sys.executable, "-m", "mooncake_plugins.cli.client"]

# A dummy child: "put KEY VALUE" / "get KEY" / "hammer" (puts and gets in a loop, forever).
DUMMY = r"""
import json, sys
from mooncake_plugins.compat.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup_dummy(64 << 20, 4 << 20, sys.argv[1]) == 0
buf = s.alloc_from_mem_pool(1 << 20)
assert s.register_buffer(buf, 1 << 20) == 0
print("READY " + json.dumps({"pid": __import__("os").getpid()}), flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "put":
        print(s.put(args[0], args[1].encode()), flush=True)
    elif cmd == "get":
        print(s.get(args[0]).decode() or "-", flush=True)
    elif cmd == "hammer":
        print("started", flush=True)
        i = 0
        while True:
            s.put(f"hammer{i % 8}", b"x" * 65536)
            s.get(f"hammer{(i + 3) % 8}")
            s.batch_put_from([f"hf{i}"], [buf], [4096])
            i += 1
    elif cmd == "quit":
        break
s.close()
"""


@pytest.fixture
def host(master_process):
    """A master and a ``mooncake_client`` host process: (proc, "127.0.0.1:port")."""
    _, master = master_process("--default_kv_lease_ttl=200")
    proc, port = spawn_ready(HOST + [f"--master_server_address={master}", "--port=0",
                                     "--host=127.0.0.1", "--metadata_server=P2PHANDSHAKE",
                                     "--global_segment_size=64MB"], timeout_s=60)
    yield proc, f"127.0.0.1:{port}"
    assert terminate_group(proc) == 0  # SIGTERM: a clean exit


@pytest.fixture
def store(host):
    s = MooncakeDistributedStore()
    assert s.setup_dummy(256 << 20, 8 << 20, host[1]) == 0
    yield s
    assert s.close() == 0


def _dummy_mappings(pid: int) -> int:
    """Dummy memfds the host process has mapped now."""
    return Path(f"/proc/{pid}/maps").read_text().count("mooncake-dummy")


def test_put_get_forms(store):
    assert store.put("k", b"hello") == 0
    assert store.get("k") == b"hello" and store.get_size("k") == 5
    assert store.is_exist("k") == 1 and store.batch_is_exist(["k", "nope"]) == [1, 0]
    assert store.put("k", b"again") == 0 and store.upsert("k", b"again!") == 0  # put keeps it
    assert store.get("k") == b"again!"
    assert store.put_parts("p", b"ab", b"cd") == 0 and store.get("p") == b"abcd"
    assert store.put_batch(["a", "b"], [b"1" * 100, b"2" * 3000]) == 0
    assert store.get_batch(["a", "b", "zz"]) == [b"1" * 100, b"2" * 3000, b""]
    assert store.get("nope") == b"" and store.get_size("nope") == -704
    assert store.put("e", b"") == -600
    # larger than the 8 MiB local buffer: staged through a temporary shared buffer
    big = os.urandom(9 << 20)
    assert store.put("big", big) == 0 and store.get("big") == big
    time.sleep(0.25)  # read leases
    assert store.remove("a") == 0 and store.remove("a") == -704
    assert store.remove_by_regex("^[bp]", True) == 3  # b, big, p
    assert store.remove_all(True) == 1  # k


def test_zero_copy_buffers(store):
    size = 3 << 20
    ptr = store.alloc_from_mem_pool(size)
    assert ptr and store.register_buffer(ptr, size) == 0
    data = [bytes([65 + i]) * (1000 * (i + 1)) for i in range(3)]
    ptrs = [ptr + i * (1 << 20) for i in range(3)]
    for p, d in zip(ptrs, data):
        ctypes.memmove(p, d, len(d))
    keys = ["z0", "z1", "z2"]
    assert store.batch_put_from(keys, ptrs, [len(d) for d in data]) == [0, 0, 0]
    assert store.get_batch(keys) == data
    ctypes.memset(ptr, 0, size)
    assert store.batch_get_into(keys, ptrs, [1 << 20] * 3) == [len(d) for d in data]
    assert [ctypes.string_at(p, len(d)) for p, d in zip(ptrs, data)] == data
    assert store.get_into("z2", ptr, 10) == -10  # BUFFER_OVERFLOW
    # memory outside the registered buffers is refused, on both sides of the host
    assert store.put_from("x", ptr + size - 10, 20) == -600
    other = ctypes.create_string_buffer(4096)
    assert store.register_buffer(ctypes.addressof(other), 4096) == -600
    assert store.put_from("x", ctypes.addressof(other), 100) == -600
    assert store.unregister_buffer(ptr) == 0
    assert store.batch_get_into(["z0"], [ptr], [4096]) == [-600]
    assert store.unregister_buffer(ptr) == -600
    assert store.alloc_from_mem_pool(300 << 20) == 0  # past the 256 MiB mem pool


def test_threads_share_one_dummy(store):
    def work(t: int) -> None:
        for i in range(40):
            value = bytes([t]) * (1000 + 997 * i)
            assert store.put(f"t{t}-{i}", value) == 0
            assert store.get(f"t{t}-{i}") == value

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(4)))
    assert store.remove_all(True) == 160


def test_two_dummies_share_the_store(host):
    a = LineChild([sys.executable, "-c", DUMMY, host[1]])
    b = LineChild([sys.executable, "-c", DUMMY, host[1]])
    try:
        assert wait_until(lambda: _dummy_mappings(host[0].pid) >= 4, 10)  # 2 x (local + pool)
        assert a.ask("put from_a alpha") == "0"
        assert b.ask("get from_a") == "alpha"
        assert b.ask("put from_b beta") == "0"
        assert a.ask("get from_b") == "beta"
    finally:
        a.close()
        b.close()
    assert wait_until(lambda: _dummy_mappings(host[0].pid) == 0, 10)


def test_dummy_killed_mid_use_leaks_nothing(host, store):
    proc, _ = host
    child = LineChild([sys.executable, "-c", DUMMY, host[1]])
    try:
        assert child.ask("hammer") == "started"
        time.sleep(0.5)
        os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait(10)
    finally:
        child.close()
    # only this test's own dummy (its local buffer) stays mapped; the host keeps no memfd open
    assert wait_until(lambda: _dummy_mappings(proc.pid) == 1, 10)
    assert not any("mooncake-dummy" in _readlink(f"/proc/{proc.pid}/fd/{fd}")
                   for fd in os.listdir(f"/proc/{proc.pid}/fd"))
    assert proc.poll() is None
    assert store.put("after_kill", b"still here") == 0 and store.get("after_kill") == b"still here"


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # closed meanwhile
        return ""


def _hello(address: str) -> dict:
    host, port = address.rsplit(":", 1)
    rpc = RpcClient(host, int(port))
    try:
        return rpc.call("hello")
    finally:
        rpc.close()


def test_malformed_rpc_frames_close_only_that_connection(host, store):
    hostname, port = host[1].rsplit(":", 1)
    bad_frames = [
        struct.pack("<I", 4) + b"\xc1\xc1\xc1\xc1",                           # not msgpack
        struct.pack("<I", 0xFFFFFFFF),                                        # absurd length
        _frame([1, "put", {"session": "x", "keys": ["k"]}]),                 # missing fields
        _frame([1, "get_into", {"session": 1, "keys": [], "counts": [],
                                "addrs": [], "sizes": []}]),                  # wrong type
        _frame([1, "nope", {}]),                                              # unknown method
    ]
    for frame in bad_frames:
        with socket.create_connection((hostname, int(port)), timeout=10) as s:
            s.sendall(frame)
            assert s.recv(1) == b""  # the host closed this connection
    # well-formed but meaningless: an error reply, the connection stays
    rpc = RpcClient(hostname, int(port))
    try:
        with pytest.raises(Exception, match="unknown or closed dummy session"):
            rpc.call("get_into", session="forged", keys=["k"], counts=[1], addrs=[4096],
                     sizes=[8])
        with pytest.raises(Exception, match="line up"):
            rpc.call("put", session="forged", keys=["k"], counts=[2], addrs=[1], sizes=[1],
                     config={}, upsert=False)
    finally:
        rpc.close()
    assert host[0].poll() is None
    assert store.put("ok", b"1") == 0 and store.get("ok") == b"1"


def _frame(obj: object) -> bytes:
    body = msgpack.packb(obj)
    return struct.pack("<I", len(body)) + body


def test_control_channel_refuses_bad_memory_and_closes_on_garbage(host):
    control = _hello(host[1])["control"]

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        s.connect(control)
        assert "session" in msgpack.unpackb(s.recv(512))
        return s

    with connect() as s:
        unsealed = os.memfd_create("not-sealed")
        r, w = os.pipe()
        try:
            os.ftruncate(unsealed, 4096)
            for fd in (unsealed, r):  # refused, the session goes on
                socket.send_fds(s, [msgpack.packb({"op": "map", "base": 1 << 30, "nbytes": 4096})],
                                [fd])
                reply = msgpack.unpackb(s.recv(512))
                assert reply["code"] == -600, reply
        finally:
            for fd in (unsealed, r, w):
                os.close(fd)
        s.sendall(msgpack.packb({"op": "unmap", "base": 1 << 30}))
        assert msgpack.unpackb(s.recv(512))["code"] == -600
        s.sendall(msgpack.packb({"op": "map", "base": 1, "nbytes": 1}))  # no descriptor
        assert s.recv(512) == b""
    with connect() as s:
        s.sendall(b"\x92garbage")
        assert s.recv(512) == b""
    assert host[0].poll() is None
    with DummyClient(host[1], local_buffer_size=0) as d:  # values staged in temporary memfds
        d.put("fine", b"yes")
        assert d.get("fine") == b"yes"


def test_setup_dummy_errors():
    s = MooncakeDistributedStore()
    assert s.setup_dummy(1 << 20, 1 << 20, "127.0.0.1:1") == -900  # RPC_FAIL: no host there
    assert s.setup_dummy(1 << 20, 1 << 20, "no-port") == -600
    assert s.alloc_from_mem_pool(4096) == 0  # not a dummy
    assert s.close() == 0
