"""Standalone-store mode: a ``mooncake_client`` host process and dummy clients using it.

The host and the master are real processes; dummies run in this process (through the
compat ``setup_dummy``) or as child processes (the concurrent and kill -9 cases).
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import pytest
from helpers import LineChild, spawn_ready, terminate_group, wait_until

from mooncake_plugins.cli.client import build_parser
from mooncake_plugins.compat.store import MooncakeDistributedStore
from mooncake_plugins.errors import InvalidParams, RpcFailed
from mooncake_plugins.store.local import DummyClient, common
from mooncake_plugins.store.local.host import _Session
from mooncake_plugins.store.rpc import RpcClient, RpcServer

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


# Each ends with memory of a closed dummy still in use; run in a child, so that a
# regression shows as a signal instead of killing the test session.
USE_AFTER_CLOSE = {
    "views of the pool after close": """
        p = d.alloc_from_mem_pool(1 << 20)
        d.register_buffer(p, 1 << 20)
        v, w = d.local_view(p, 1 << 20), d.local_view(d.alloc_from_mem_pool(4096), 16)
        d.close()
        v[:] = b"x" * (1 << 20); w[0] = 1
        assert bytes(v[-2:]) == b"xx"
    """,
    "close while another thread copies into the staging buffer": """
        import threading
        from mooncake_plugins.transfer import memory
        started, go, copy_many = threading.Event(), threading.Event(), memory.copy_many
        def slow_copy(copies):
            started.set(); go.wait(); copy_many(copies)
        memory.copy_many = slow_copy
        out = []
        def put():
            try:
                d.put("k", b"y" * 65536)
            except Exception as exc:  # the client closed under it: an error, not a crash
                out.append(exc)
        t = threading.Thread(target=put); t.start()
        started.wait(); d.close(); go.set(); t.join()
        assert out, "the put did not notice the close"
    """,
}


@pytest.mark.parametrize("case", sorted(USE_AFTER_CLOSE))
def test_memory_in_use_outlives_close(host, case, impl_env):
    code = "from mooncake_plugins.store.local import DummyClient\n" \
        f"d = DummyClient({host[1]!r}, local_buffer_size=1 << 20)\n" \
        + textwrap.dedent(USE_AFTER_CLOSE[case]) + "\nprint('ok')\n"
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **impl_env},
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr.decode()[-2000:])
    assert proc.stdout.strip() == b"ok"


@pytest.mark.parametrize("greeting", [b"", b"\x92garbage", msgpack.packb(["session"]),
                                      msgpack.packb({"session": 5}),
                                      msgpack.packb({"token": "abc"})])
def test_a_malformed_session_greeting_is_rpc_failed(greeting):
    name = f"\0mooncake-test-greeting-{os.getpid()}"
    control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    control.bind(name)
    control.listen(1)

    def greet() -> None:
        conn, _ = control.accept()
        with conn:
            if greeting:
                conn.sendall(greeting)
            conn.recv(1)  # until the dummy gives up

    t = threading.Thread(target=greet)
    t.start()
    server = RpcServer("127.0.0.1", 0, {"hello": ({}, lambda: {"control": name, "segment": "s"})})
    try:
        with pytest.raises(RpcFailed, match="session greeting"):
            DummyClient(f"127.0.0.1:{server.port}", timeout_s=10)
    finally:
        server.close()
        t.join(10)
        control.close()


class _BlockingEngine:
    """An engine whose register_address waits for ``go``."""

    def __init__(self) -> None:
        self.entered, self.go = threading.Event(), threading.Event()
        self.unregistered: list[int] = []

    def register_address(self, address: int, nbytes: int, private: bool = False) -> None:
        self.entered.set()
        assert self.go.wait(10)

    def unregister(self, address: int, wait_s: float = 1.0) -> None:
        self.unregistered.append(address)


def _sealed_memfd(nbytes: int, flags: int = 0) -> int:
    fd = os.memfd_create("mooncake-dummy-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | flags)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def test_session_add_maps_outside_the_lock():
    engine = _BlockingEngine()
    session = _Session(engine)
    fd = _sealed_memfd(1 << 16)
    adder = threading.Thread(target=session.add, args=(fd, 1 << 30, 1 << 16))
    try:
        adder.start()
        assert engine.entered.wait(10)
        done = threading.Event()

        def pin() -> None:
            with session.pinned([[(0, 0)]]):
                done.set()

        pinner = threading.Thread(target=pin)
        pinner.start()
        assert done.wait(5), "pinned() waited for another call's map + register"
    finally:
        engine.go.set()
        adder.join(10)
        pinner.join(10)
        os.close(fd)
    with session.pinned([[(1 << 30, 16)]]) as local:  # the mapping is in place
        assert local[0][0][1] == 16
    session.close()
    assert len(engine.unregistered) == 1


def test_session_add_undoes_a_mapping_the_closed_session_cannot_take():
    engine = _BlockingEngine()
    session = _Session(engine)
    fd = _sealed_memfd(1 << 16)
    errors: list[BaseException] = []

    def add() -> None:
        try:
            session.add(fd, 1 << 30, 1 << 16)
        except InvalidParams as exc:
            errors.append(exc)

    adder = threading.Thread(target=add)
    try:
        adder.start()
        assert engine.entered.wait(10)
        session.close()  # while the add maps and registers
        engine.go.set()
        adder.join(10)
    finally:
        engine.go.set()
        os.close(fd)
    assert "closed" in str(errors[0]) and len(engine.unregistered) == 1


def test_session_refuses_hugetlb_memfds():
    fd = _sealed_memfd(2 << 20, os.MFD_HUGETLB)
    try:
        with pytest.raises(InvalidParams, match="hugetlb"):
            _Session(_BlockingEngine()).add(fd, 1 << 30, 2 << 20)
    finally:
        os.close(fd)


def test_a_failed_munmap_is_logged(caplog):
    with caplog.at_level(logging.ERROR, logger=common.__name__):
        assert common.unmap(4097, 4096) is False  # not page-aligned: EINVAL
    assert "munmap of 4096 bytes at 0x1001 failed" in caplog.text


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_control_socket_refuses_other_users(host):
    control = _hello(host[1])["control"]

    def greeting_as(uid: int) -> bytes:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: connect as ``uid``, report what the host said
            try:
                os.close(r)
                os.setuid(uid)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.settimeout(10)
                s.connect(control)
                os.write(w, s.recv(512) or b"closed")
            finally:
                os._exit(0)
        os.close(w)
        try:
            return os.read(r, 512)
        finally:
            os.close(r)
            os.waitpid(pid, 0)

    assert greeting_as(65534) == b"closed"
    assert "session" in msgpack.unpackb(greeting_as(0))
    assert host[0].poll() is None


def test_rpc_listens_on_loopback_unless_told(master_process):
    args = build_parser().parse_args([])
    assert (args.host, args.rpc_host) == ("0.0.0.0", "127.0.0.1")
    _, master = master_process()
    proc, port = spawn_ready(HOST + [f"--master_server_address={master}", "--port=0",
                                     "--metadata_server=P2PHANDSHAKE",
                                     "--global_segment_size=16MB"], timeout_s=60)
    try:
        listening = [line.split()[1] for line in
                     Path(f"/proc/{proc.pid}/net/tcp").read_text().splitlines()[1:]
                     if line.split()[3] == "0A" and line.split()[1].endswith(f":{port:04X}")]
        assert listening == [f"0100007F:{port:04X}"]
        with DummyClient(f"127.0.0.1:{port}") as d:
            assert not d.exists("nothing")
    finally:
        assert terminate_group(proc) == 0
