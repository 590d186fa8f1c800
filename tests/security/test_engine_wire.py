"""The engine's tcp port against a hostile peer: raw frames that test_fuzz.py does not send.

test_fuzz.py covers garbage, mutated frames, bad header fields and ranges outside every
region; here: read-only and private regions, ranges across adjacent regions and at a
region's edges (with the memory around them checked byte for byte), msgpack bombs in
control frames, frames that stall, peers that never read, and too many connections.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
from helpers import terminate_group, wait_until
from rawnet import closed_by_peer, connect, exchange, recv_exact

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.errors import AddressError, TransportUnavailable
from mooncake_plugins.transfer import TransferEngine
from mooncake_plugins.transfer import protocol as p
from mooncake_plugins.transfer.rpc_server import TcpServer
from mooncake_plugins.transfer.segment import Region, RegionInfo, RegionTable, SegmentDescriptor
from mooncake_plugins.transfer.topology import host_id

PAGE = 4096
RPC_LOG = "mooncake_plugins.transfer.rpc_server"
LISTENER_LOG = "mooncake_plugins.transfer.listener"
SHM_LOG = "mooncake_plugins.transfer.transports.shm"


@dataclass
class Target:
    """A live engine with a writable buffer, a read-only, a private and two adjacent regions.

    ``arena`` is one bytearray: page 0 is not registered (a guard), pages 1 and 2 are
    two adjacent registered regions, page 3 is not registered either.
    """

    engine: TransferEngine
    buf_address: int
    readonly: bytes
    readonly_address: int
    private: bytearray
    private_address: int
    arena: bytearray
    arena_address: int


@pytest.fixture
def target() -> Iterator[Target]:
    with TransferEngine(config=EngineConfig(transports=["tcp"])) as engine:
        buf = engine.allocate(1 << 16)
        readonly = b"R" * PAGE
        private = bytearray(b"P" * PAGE)
        arena = bytearray(b"G" * PAGE + b"A" * PAGE + b"B" * PAGE + b"H" * PAGE)
        view = memoryview(arena)
        a = engine.register(view[PAGE:2 * PAGE])
        engine.register(view[2 * PAGE:3 * PAGE])
        yield Target(engine, buf.address, readonly, engine.register(readonly).address, private,
                     engine.register(private, private=True).address, arena, a.address - PAGE)


def header(op: int, address: int, nbytes: int, req_id: int = 1, aux_len: int = 0) -> bytes:
    return p.REQUEST.pack(p.MAGIC, p.VERSION, op, 0, req_id, address, nbytes, aux_len)


def control(payload: bytes) -> bytes:
    return header(p.OP_CONTROL, 0, 0, aux_len=len(payload)) + payload


def replies(data: bytes) -> list[tuple[int, int, bytes]]:
    """Split a stream of responses into ``(status, req_id, body)``."""
    out = []
    while data:
        magic, status, rid, n = p.RESPONSE.unpack_from(data)
        assert magic == p.MAGIC
        out.append((status, rid, data[p.RESPONSE.size:p.RESPONSE.size + n]))
        data = data[p.RESPONSE.size + n:]
    return out


def serves_a_well_behaved_peer(t: Target) -> bool:
    """A fresh engine writes and reads back through the target's port."""
    with TransferEngine(config=EngineConfig(transports=["tcp"])) as peer:
        mine = peer.allocate(PAGE)
        mine.view()[:] = b"\x5a" * PAGE
        peer.write(t.engine.segment_name, mine.address, t.buf_address, PAGE, timeout_s=10)
        mine.view()[:] = bytes(PAGE)
        peer.read(t.engine.segment_name, mine.address, t.buf_address, PAGE, timeout_s=10)
        return bytes(mine.view()) == b"\x5a" * PAGE


def test_write_to_a_read_only_region_is_refused(target: Target,
                                                caplog: pytest.LogCaptureFixture) -> None:
    t = target
    frames = (header(p.OP_WRITE, t.readonly_address, 64) + b"w" * 64
              + header(p.OP_READ, t.readonly_address, 8, req_id=2))
    with caplog.at_level(logging.WARNING, logger=RPC_LOG):
        (status, _, body), read = replies(exchange(t.engine.rpc_port, frames))
    assert status == AddressError.code and b"read-only" in body
    assert read == (0, 2, b"R" * 8)  # the payload was drained: the stream stayed in step
    assert t.readonly == b"R" * PAGE
    assert "read-only" in caplog.text
    assert serves_a_well_behaved_peer(t)


@pytest.mark.parametrize("op", [p.OP_READ, p.OP_WRITE], ids=["read", "write"])
def test_a_private_region_is_invisible_to_peers(target: Target, op: int,
                                                caplog: pytest.LogCaptureFixture) -> None:
    t = target
    frame = header(op, t.private_address, 64) + (b"w" * 64 if op == p.OP_WRITE else b"")
    with caplog.at_level(logging.WARNING, logger=RPC_LOG):
        [(status, _, body)] = replies(exchange(t.engine.rpc_port, frame))
    assert status == AddressError.code and b"not inside a registered region" in body
    assert b"P" * 8 not in body
    assert t.private == bytearray(b"P" * PAGE)
    assert "refused" in caplog.text
    assert t.private_address not in [r.address for r in t.engine.regions()]  # not published
    assert serves_a_well_behaved_peer(t)


@pytest.mark.parametrize("offset, nbytes, accepted", [
    (PAGE, PAGE, True),                  # all of region A
    (2 * PAGE - 16, 16, True),           # the last bytes of A
    (2 * PAGE - 16, 32, False),          # across the A|B boundary: two regions, not one
    (PAGE - 1, 2, False),                # starts in the guard page before A
    (3 * PAGE - 8, 16, False),           # runs off B into the guard page after it
    (PAGE, 3 * PAGE, False),             # A, B and the page after
], ids=["whole", "tail", "across-regions", "before", "after", "spill"])
def test_writes_touch_exactly_the_range_inside_one_region(target: Target, offset: int, nbytes: int,
                                                          accepted: bool) -> None:
    t = target
    before = bytes(t.arena)
    frame = header(p.OP_WRITE, t.arena_address + offset, nbytes) + b"x" * nbytes
    [(status, _, body)] = replies(exchange(t.engine.rpc_port, frame))
    expected = bytearray(before)
    if accepted:
        assert status == 0
        expected[offset:offset + nbytes] = b"x" * nbytes
    else:
        assert status == AddressError.code and b"not inside a registered region" in body
    assert bytes(t.arena) == bytes(expected)  # not one byte outside the accepted range


@pytest.mark.parametrize("payload", [
    b"\x91" * 100_000,                                                   # deep nesting
    b"\xde\x00\x10" + b"".join(msgpack.packb(f"k{i}") + b"\x8f" + b"\xa1a\x80" * 15
                               for i in range(16)),                     # hundreds of maps
    msgpack.packb({"cmd": "notify", "name": ["a"] * 16, "msg": "m"}),   # an array
    msgpack.packb({"cmd": "notify", "name": b"a", "msg": "m"}),         # bin, not str
    msgpack.packb({f"k{i}": i for i in range(17)}),                     # a map too long
], ids=["deep", "many-maps", "array", "bin", "long-map"])
def test_control_payload_bombs_close_the_connection(target: Target, payload: bytes,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger=RPC_LOG):
        assert exchange(target.engine.rpc_port, control(payload)) == b""
    assert "malformed frame" in caplog.text
    assert serves_a_well_behaved_peer(target)


# -- a bare TcpServer with short deadlines and a small connection limit --------------------

@dataclass
class Bare:
    server: TcpServer
    regions: RegionTable
    memory: bytearray
    address: int


@pytest.fixture
def bare() -> Iterator[Bare]:
    """A TcpServer serving one 16 MiB region, 0.3 s frame deadline, at most 3 connections."""
    from mooncake_plugins.transfer import memory

    mem = bytearray(16 << 20)
    export = memory.Export(mem, True)
    regions = RegionTable()
    regions.add(Region(RegionInfo(export.address, len(mem)), keepalive=export))
    server = TcpServer("127.0.0.1", 0, regions, lambda msg: b"pong", max_connections=3,
                       frame_timeout_s=0.3)
    try:
        yield Bare(server, regions, mem, export.address)
    finally:
        server.close()
        export.release()


def ping(sock: socket.socket, req_id: int = 1) -> bool:
    """One control round trip on ``sock``: whether the server answered it."""
    payload = p.encode_control("ping")
    sock.sendall(header(p.OP_CONTROL, 0, 0, req_id, len(payload)) + payload)
    return replies(recv_exact(sock, p.RESPONSE.size + 4)) == [(0, req_id, b"pong")]


def test_a_stalled_write_is_closed_and_lets_go_of_its_region(
        bare: Bare, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=RPC_LOG), connect(bare.server.port) as sock:
        sock.sendall(header(p.OP_WRITE, bare.address, PAGE) + b"s" * 100)  # then nothing
        assert closed_by_peer(sock, within_s=5)
    assert "made no progress" in caplog.text
    bare.regions.remove(bare.address, wait_s=0)  # no transfer holds it any more


def test_a_stalled_header_is_closed(bare: Bare, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=RPC_LOG), connect(bare.server.port) as sock:
        sock.sendall(header(p.OP_READ, bare.address, 8)[:10])
        assert closed_by_peer(sock, within_s=5)
    assert "made no progress" in caplog.text


def test_an_idle_connection_between_frames_stays_open(bare: Bare) -> None:
    with connect(bare.server.port) as sock:
        assert ping(sock)
        time.sleep(3 * bare.server.frame_timeout_s)  # pooled connections idle like this
        assert ping(sock, req_id=2)


def test_a_peer_that_never_reads_is_dropped(bare: Bare, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=RPC_LOG):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(5)
        with sock:
            sock.connect(("127.0.0.1", bare.server.port))
            sock.sendall(header(p.OP_READ, bare.address, len(bare.memory)))  # and never read
            assert wait_until(lambda: "made no progress" in caplog.text, 10)
    bare.regions.remove(bare.address, wait_s=5)  # the stuck send let go of the region


def test_connections_over_the_limit_are_closed(bare: Bare,
                                               caplog: pytest.LogCaptureFixture) -> None:
    socks = [connect(bare.server.port) for _ in range(bare.server.max_connections)]
    try:
        assert all(ping(s) for s in socks)
        with caplog.at_level(logging.WARNING, logger=LISTENER_LOG), \
                connect(bare.server.port) as extra:
            assert closed_by_peer(extra, within_s=5)
        assert "connections are open (the limit)" in caplog.text
        socks.pop().close()

        def served() -> bool:
            with connect(bare.server.port) as again:
                try:
                    return ping(again)
                except (ConnectionError, TimeoutError):
                    return False

        assert wait_until(served, 5, interval_s=0.05)
        assert all(ping(s, req_id=2) for s in socks)  # the others never noticed
    finally:
        for s in socks:
            s.close()


# -- a peer that lies in its descriptor ------------------------------------------------------

_HOLD_FILE = ("import sys; f = open(sys.argv[1], 'r+b'); print(f.fileno(), flush=True); "
              "sys.stdin.read()")


def test_a_forged_descriptor_cannot_aim_shm_at_another_process(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A network peer claims this host's host_id and names another local process's file."""
    victim_file = tmp_path / "victim.db"
    victim_file.write_bytes(b"F" * 2 * PAGE)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_FILE, str(victim_file)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    try:
        fd = int(holder.stdout.readline())
        forged: dict = {}
        asked: list[bytes] = []

        def answer(msg: bytes) -> bytes:
            asked.append(msg)
            return msgpack.packb(forged, use_bin_type=True)

        liar = TcpServer("127.0.0.1", 0, RegionTable(), answer)
        try:
            forged.update(SegmentDescriptor(
                "liar", "127.0.0.1", liar.port, holder.pid, host_id(),
                epoch=int.from_bytes(b"F" * 8, "little"), epoch_memfd=fd,
                regions=[RegionInfo(1 << 40, PAGE, memfd=fd)]).to_wire())
            with TransferEngine(config=EngineConfig(transports=["shm"])) as initiator, \
                    TransferEngine(config=EngineConfig(transports=["shm"])) as genuine:
                mine = initiator.allocate(PAGE)
                mine.view()[:] = b"X" * PAGE
                with caplog.at_level(logging.WARNING, logger=SHM_LOG), \
                        pytest.raises(TransportUnavailable, match="no transport reaches"):
                    initiator.write(f"127.0.0.1:{liar.port}", mine.address, 1 << 40, PAGE,
                                    timeout_s=10)
                assert asked, "the liar's descriptor was fetched and looked at"
                # refused by the pid check, before any of the holder's files was opened
                assert f"claims pid {holder.pid} on this host, which does not serve" in caplog.text
                # the initiator still works over shm with a process that is who it says
                theirs = genuine.allocate(PAGE)
                initiator.write(genuine.segment_name, mine.address, theirs.address, PAGE,
                                timeout_s=10)
                assert bytes(theirs.view()) == b"X" * PAGE
        finally:
            liar.close()
        assert holder.poll() is None, "the holder process was not disturbed"
    finally:
        holder.stdin.close()
        terminate_group(holder)
    assert victim_file.read_bytes() == b"F" * 2 * PAGE
