"""The master's msgpack RPC against a hostile client: memory bombs, stalls, too many
connections, replies that cannot be encoded, and calls on another client's behalf.

tests/store/test_server.py covers malformed frames (bad length, invalid msgpack, wrong
shapes and argument types); here: what a well-formed but hostile frame can cost the
master, and which calls a client may make about another client's segments and puts.
"""

from __future__ import annotations

import logging
import socket
import time
import tracemalloc
from collections.abc import Iterator

import msgpack
import pytest
from helpers import wait_until
from rawnet import (closed_by_peer, connect, exchange, peak_rss_nbytes, recv_exact,
                    reset_peak_rss, rss_nbytes)

from mooncake_plugins.errors import (ClientNotFound, InvalidParams, ObjectNotFound, RpcFailed,
                                     StoreSegmentNotFound)
from mooncake_plugins.store.master import MasterConfig
from mooncake_plugins.store.rpc import LENGTH, MAX_FRAME_NBYTES, RpcClient, RpcServer
from mooncake_plugins.store.server import MasterServer, ServerOptions

RPC_LOG = "mooncake_plugins.store.rpc"
LISTENER_LOG = "mooncake_plugins.transfer.listener"
MiB = 1 << 20
PUT_CONFIG = {"replica_num": 1, "preferred_segments": [], "with_soft_pin": False, "upsert": False}


@pytest.fixture
def master() -> Iterator[MasterServer]:
    server = MasterServer(MasterConfig(), ServerOptions(rpc_port=0))
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def bare() -> Iterator[RpcServer]:
    """An RpcServer with two methods, 0.3 s frame deadline and at most 3 connections."""
    handlers = {"echo": ({"x": int}, lambda x: x), "huge": ({}, lambda: 1 << 70)}
    server = RpcServer("127.0.0.1", 0, handlers, max_connections=3, frame_timeout_s=0.3)
    try:
        yield server
    finally:
        server.close()


def frame(obj: object) -> bytes:
    body = msgpack.packb(obj)
    return LENGTH.pack(len(body)) + body


def call(sock: socket.socket, req_id: int, method: str, **args: object) -> list:
    """One request on a raw socket; the decoded reply ``[req_id, code, result]``."""
    sock.sendall(frame([req_id, method, args]))
    (n,) = LENGTH.unpack(recv_exact(sock, LENGTH.size))
    return msgpack.unpackb(recv_exact(sock, n))


def serves(port: int) -> bool:
    rpc = RpcClient("127.0.0.1", port, timeout_s=5)
    try:
        return rpc.call("exist", keys=["k"]) == [0]
    finally:
        rpc.close()


def unread_nbytes(server_port: int, client_ports: set[int]) -> dict[int, int]:
    """Bytes the server has not yet read on each of its loopback connections from
    ``client_ports`` (its sockets' receive queues in /proc/net/tcp), by client port."""
    out = {}
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            local, remote, queues = fields[1], fields[2], fields[4]
            if (int(local.split(":")[1], 16) == server_port
                    and (peer := int(remote.split(":")[1], 16)) in client_ports):
                out[peer] = int(queues.split(":")[1], 16)
    return out


def test_an_announced_length_is_not_allocated_before_the_bytes_come() -> None:
    # a frame deadline far longer than the test: the server must still be waiting for the
    # rest of each frame when memory is measured, however slow this machine is
    server = RpcServer("127.0.0.1", 0, {"echo": ({"x": int}, lambda x: x)}, max_connections=3,
                       frame_timeout_s=120)
    socks: list[socket.socket] = []
    try:
        before = rss_nbytes()
        tracemalloc.start()
        socks = [connect(server.port) for _ in range(3)]
        for s in socks:
            s.sendall(LENGTH.pack(MAX_FRAME_NBYTES) + b"\x93")  # 64 MiB announced, 1 byte sent
        ports = {s.getsockname()[1] for s in socks}
        # the server has read the length and the byte after it on every connection, so it
        # has made room for what it reads next and now waits for the rest
        assert wait_until(lambda: unread_nbytes(server.port, ports) == dict.fromkeys(ports, 0),
                          60), unread_nbytes(server.port, ports)
        assert not any(closed_by_peer(s, within_s=0.05) for s in socks)  # still waiting
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 32 * MiB, peak  # not 3 x 64 MiB (counted allocated, touched or not)
        assert rss_nbytes() - before < 32 * MiB
    finally:
        tracemalloc.stop()
        for s in socks:
            s.close()
        server.close()


def test_a_bomb_of_empty_maps_is_refused_before_it_is_built(
        master: MasterServer, caplog: pytest.LogCaptureFixture) -> None:
    inner = b"\xdc\xff\xff" + b"\x80" * 0xFFFF  # 65535 empty maps: within the batch limit
    keys = b"\xdd" + (64).to_bytes(4, "big") + inner * 64  # 4 MiB of wire: 4M dicts, ~300 MB
    body = b"\x93\x01" + msgpack.packb("exist") + b"\x81" + msgpack.packb("keys") + keys
    data = LENGTH.pack(len(body)) + body
    reset_peak_rss()
    before = rss_nbytes()
    with caplog.at_level(logging.ERROR, logger=RPC_LOG):
        assert exchange(master.port, data) == b""
    assert peak_rss_nbytes() - before < 64 * MiB
    assert "more than 16 maps and arrays" in caplog.text
    assert serves(master.port)


def test_deep_nesting_is_refused(master: MasterServer, caplog: pytest.LogCaptureFixture) -> None:
    body = (b"\x93\x01" + msgpack.packb("exist") + b"\x81" + msgpack.packb("keys")
            + b"\x91" * 100_000 + b"\xc0")
    with caplog.at_level(logging.ERROR, logger=RPC_LOG):
        assert exchange(master.port, LENGTH.pack(len(body)) + body) == b""
    assert "malformed frame" in caplog.text
    assert serves(master.port)


def test_a_stalled_frame_is_closed(bare: RpcServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=RPC_LOG), connect(bare.port) as sock:
        sock.sendall(frame([1, "echo", {"x": 1}])[:7])
        assert closed_by_peer(sock, within_s=5)
    assert "made no progress" in caplog.text


def test_an_idle_connection_between_calls_stays_open(bare: RpcServer) -> None:
    with connect(bare.port) as sock:
        assert call(sock, 1, "echo", x=5) == [1, 0, 5]
        time.sleep(3 * bare.frame_timeout_s)  # RpcClient pools connections like this
        assert call(sock, 2, "echo", x=6) == [2, 0, 6]


def test_connections_over_the_limit_are_closed(bare: RpcServer,
                                               caplog: pytest.LogCaptureFixture) -> None:
    socks = [connect(bare.port) for _ in range(bare.max_connections)]
    try:
        assert all(call(s, 1, "echo", x=1) == [1, 0, 1] for s in socks)
        with caplog.at_level(logging.WARNING, logger=LISTENER_LOG), connect(bare.port) as extra:
            assert closed_by_peer(extra, within_s=5)
        assert "connections are open (the limit)" in caplog.text
        socks.pop().close()

        def served() -> bool:
            with connect(bare.port) as again:
                try:
                    return call(again, 1, "echo", x=2) == [1, 0, 2]
                except (ConnectionError, TimeoutError):
                    return False

        assert wait_until(served, 5, interval_s=0.05)
    finally:
        for s in socks:
            s.close()


def test_a_result_that_cannot_be_encoded_is_an_error_reply(
        bare: RpcServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger=RPC_LOG), connect(bare.port) as sock:
        req_id, code, message = call(sock, 1, "huge")
        assert (req_id, code) == (1, -1) and "internal error" in message
        assert call(sock, 2, "echo", x=3) == [2, 0, 3]  # the same connection still serves
    assert "huge from" in caplog.text


# -- one client acting on another's behalf --------------------------------------------------

@pytest.fixture
def victim(master: MasterServer) -> Iterator[RpcClient]:
    """Client ``victim-id`` with segment ``victim-seg`` and a put of ``k`` in progress."""
    rpc = RpcClient("127.0.0.1", master.port, timeout_s=5)
    try:
        rpc.call("register_client", client_id="victim-id", host_id="h")
        rpc.call("mount_segment", client_id="victim-id", segment="victim-seg", base=1 << 30,
                 nbytes=1 << 20)
        [[code, _]] = rpc.call("put_start", client_id="victim-id", keys=["k"], sizes=[100],
                               config=PUT_CONFIG)
        assert code == 0
        yield rpc
    finally:
        rpc.close()


@pytest.fixture
def attacker(master: MasterServer) -> Iterator[RpcClient]:
    rpc = RpcClient("127.0.0.1", master.port, timeout_s=5)
    try:
        rpc.call("register_client", client_id="attacker-id", host_id="h")
        yield rpc
    finally:
        rpc.close()


def test_a_client_cannot_unmount_another_clients_segment(victim: RpcClient,
                                                         attacker: RpcClient) -> None:
    with pytest.raises(StoreSegmentNotFound):
        attacker.call("unmount_segment", client_id="attacker-id", segment="victim-seg")
    assert attacker.call("stats")["segments"] == 1
    victim.call("unmount_segment", client_id="victim-id", segment="victim-seg")  # its owner may
    assert attacker.call("stats")["segments"] == 0


def test_a_client_cannot_end_or_revoke_another_clients_put(victim: RpcClient,
                                                           attacker: RpcClient) -> None:
    for method in ("put_end", "put_revoke"):
        [[code, _]] = attacker.call(method, client_id="attacker-id", keys=["k"])
        assert code == ObjectNotFound.code
    assert attacker.call("exist", keys=["k"]) == [0]  # still pending, still the victim's
    assert victim.call("put_end", client_id="victim-id", keys=["k"]) == [[0, None]]
    assert attacker.call("exist", keys=["k"]) == [1]


def test_an_unregistered_client_cannot_put_or_mount(master: MasterServer) -> None:
    rpc = RpcClient("127.0.0.1", master.port, timeout_s=5)
    try:
        with pytest.raises(ClientNotFound):
            rpc.call("put_start", client_id="nobody", keys=["k"], sizes=[1], config=PUT_CONFIG)
        with pytest.raises(ClientNotFound):
            rpc.call("mount_segment", client_id="nobody", segment="s", base=0, nbytes=1 << 20)
    finally:
        rpc.close()


def test_a_put_conflict_does_not_disclose_the_writers_client_id(victim: RpcClient,
                                                                attacker: RpcClient) -> None:
    [[code, message]] = attacker.call("put_start", client_id="attacker-id", keys=["k"],
                                      sizes=[100], config=PUT_CONFIG)
    assert code != 0
    assert "victim-id" not in message


def test_a_segment_beyond_the_address_space_is_refused(attacker: RpcClient) -> None:
    with pytest.raises(InvalidParams):
        attacker.call("mount_segment", client_id="attacker-id", segment="s",
                      base=(1 << 64) - 64, nbytes=1 << 20)


def test_key_listing_and_peeks_are_validated(master: MasterServer,
                                             caplog: pytest.LogCaptureFixture) -> None:
    rpc = RpcClient("127.0.0.1", master.port)
    try:
        assert rpc.call("keys_with_suffix", suffix="/ab", limit=10) == []
        assert rpc.call("peek", keys=["a", "b"]) == [0, 0]
        assert rpc.call("keys_with_suffix", suffix="", limit=10) == []   # any key
        assert rpc.call("keys_containing", part="@ab@", limit=10) == []
        for bad in ({"suffix": "/ab", "limit": 0}, {"suffix": "/ab", "limit": 1 << 40}):
            with pytest.raises(InvalidParams):
                rpc.call("keys_with_suffix", **bad)
            with pytest.raises(InvalidParams):
                rpc.call("keys_containing", part=bad["suffix"], limit=bad["limit"])
        # a field of the wrong type is a malformed frame: that connection is closed
        for method, bad in (("keys_with_suffix", {"suffix": 5, "limit": 10}),
                            ("keys_with_suffix", {"suffix": "/ab", "limit": "10"}),
                            ("keys_with_suffix", {"suffix": "/ab"}),
                            ("keys_containing", {"part": b"@ab@", "limit": 10}),
                            ("keys_containing", {"limit": 10}),
                            ("peek", {"keys": [1, 2]})):
            with caplog.at_level(logging.ERROR, RPC_LOG):
                with pytest.raises(RpcFailed):
                    rpc.call(method, **bad)
            assert "malformed frame" in caplog.text
            caplog.clear()
        assert rpc.call("peek", keys=["a"]) == [0]   # the master serves on
    finally:
        rpc.close()


def test_a_client_cannot_use_another_clients_slot(victim: RpcClient, attacker: RpcClient) -> None:
    granted = victim.call("reserve", client_id="victim-id", nbytes=4096, replica_num=1, count=2)
    (rid, _), _ = granted["slots"]
    assert 0 < granted["use_within_s"]
    # the attacker neither turns the victim's slot into its object nor learns it exists
    [[code, message]], _ = attacker.call("put_reserved", client_id="attacker-id", keys=["x"],
                                         slots=[rid], config=PUT_CONFIG, refill=[])
    assert code == ObjectNotFound.code and "victim-id" not in message
    [[code, _]], _ = victim.call("put_reserved", client_id="victim-id", keys=["x"], slots=[rid],
                                 config=PUT_CONFIG, refill=[])
    assert code == 0 and attacker.call("exist", keys=["x"]) == [1]
    with pytest.raises(ClientNotFound):   # nor reserve as a client nobody registered
        attacker.call("reserve", client_id="nobody", nbytes=4096, replica_num=1, count=1)


def test_slot_requests_are_validated(victim: RpcClient, caplog: pytest.LogCaptureFixture) -> None:
    for bad in ({"nbytes": 0, "replica_num": 1, "count": 1},
                {"nbytes": 1 << 20, "replica_num": 1, "count": 1},
                {"nbytes": 4096, "replica_num": 99, "count": 1},
                {"nbytes": 4096, "replica_num": 1, "count": 1 << 40}):
        with pytest.raises(InvalidParams):
            victim.call("reserve", client_id="victim-id", **bad)
    for refill in ([4096, 1], [4096, 1, 1, 1], [0, 1, 1]):
        with pytest.raises(InvalidParams):
            victim.call("put_reserved", client_id="victim-id", keys=[], slots=[],
                        config=PUT_CONFIG, refill=refill)
    with pytest.raises(InvalidParams):
        victim.call("put_reserved", client_id="victim-id", keys=["a", "b"], slots=[1],
                    config=PUT_CONFIG, refill=[])
    for bad in ({"keys": ["a"], "slots": ["1"], "config": PUT_CONFIG, "refill": []},
                {"keys": ["a"], "slots": [1], "config": PUT_CONFIG, "refill": [1.5]},
                {"keys": ["a"], "slots": [1], "config": PUT_CONFIG}):
        with caplog.at_level(logging.ERROR, RPC_LOG):
            with pytest.raises(RpcFailed):
                victim.call("put_reserved", client_id="victim-id", **bad)
        assert "malformed frame" in caplog.text
        caplog.clear()
    assert victim.call("stats")["reserved_slots"] == 0   # nothing was placed by any of it
