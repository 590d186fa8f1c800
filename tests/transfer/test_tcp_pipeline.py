"""tcp pipelining: several slices in flight on one connection, answered in order.

Pipelined slices land byte for byte (writes, reads, and both in one batch); a refused
slice among them fails only its own request and leaves the connection in step, so it is
pooled and reused; a malformed or missing reply discards the connection (never pooled
half-read); a peer that dies mid-pipeline ends in a clean error, never a hang. The
server answers pipelined frames in order and stops at the first malformed one.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from helpers import wait_until

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.errors import AddressError, ProtocolError, TransferError
from mooncake_plugins.transfer import OpCode, TransferEngine, TransferRequest
from mooncake_plugins.transfer import protocol as p
from mooncake_plugins.transfer.transports import tcp
from mooncake_plugins.transfer.transports.base import OP_READ, OP_WRITE

KIB = 1 << 10
RPC_LOG = "mooncake_plugins.transfer.rpc_server"


def pattern(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


class Pinned:
    """A bytearray and its address (ctypes keeps it exported while this lives)."""

    def __init__(self, data: bytes | int) -> None:
        self.buf = bytearray(data)
        self._c = (ctypes.c_char * len(self.buf)).from_buffer(self.buf)
        self.address = ctypes.addressof(self._c)


def recv_exact(conn: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = conn.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return bytes(out)


def read_request(conn: socket.socket) -> tuple[p.Request, bytes]:
    req = p.decode_request(recv_exact(conn, p.REQUEST.size))
    return req, recv_exact(conn, req.nbytes) if req.op == p.OP_WRITE else b""


class FakePeer:
    """A listening socket whose first connection is handled by ``script(conn)`` on a thread."""

    def __init__(self, script: Callable[[socket.socket], None]) -> None:
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = self._srv.getsockname()[1]
        self.error: BaseException | None = None
        self.eof = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(script,), daemon=True)
        self._thread.start()

    def _run(self, script: Callable[[socket.socket], None]) -> None:
        conn, _ = self._srv.accept()
        conn.settimeout(10)
        try:
            script(conn)
            try:  # the initiator closed (or pooled and later closed) it
                closed = conn.recv(1) == b""
            except ConnectionResetError:  # it reset one it gave up on
                closed = True
            if closed:
                self.eof.set()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            conn.close()

    def close(self) -> None:
        self._srv.close()
        self._thread.join(15)


@pytest.fixture
def transport() -> Iterator[tcp.TcpTransport]:
    t = tcp.TcpTransport(1, connect_timeout_s=5, transfer_timeout_s=5)
    yield t
    t.close()


def pool_state(t: tcp.TcpTransport, port: int) -> tuple[int, int]:
    """(connections open, connections idle in the pool) to 127.0.0.1:port."""
    pool = t._pools[("127.0.0.1", port)]
    return pool._count, len(pool._idle)


# -- the initiator against scripted peers ------------------------------------------------

def test_writes_are_pipelined(transport):
    """The peer reads every request before it answers any: a client that waits for each
    reply before sending the next request would stall here until its deadline."""
    n, count = 4 * KIB, 6
    src = Pinned(pattern(1, n * count))
    got: list[tuple[int, bytes]] = []

    def script(conn: socket.socket) -> None:
        reqs = [read_request(conn) for _ in range(count)]
        for req, payload in reqs:
            got.append((req.address, payload))
            conn.sendall(p.encode_response(0, req.req_id, 0))

    peer = FakePeer(script)
    try:
        t0 = time.monotonic()
        transport.pipeline("127.0.0.1", peer.port, [(OP_WRITE, src.address + i * n,
                                                     0x10000 + i * n, n) for i in range(count)])
        assert time.monotonic() - t0 < 3
        assert pool_state(transport, peer.port) == (1, 1)  # in step: pooled
    finally:
        transport.close()
        peer.close()
    assert peer.error is None
    assert got == [(0x10000 + i * n, bytes(src.buf[i * n:(i + 1) * n])) for i in range(count)]


def test_reads_are_pipelined(transport):
    n, count = 4 * KIB, 6
    dst = Pinned(n * count)
    data = pattern(2, n * count)

    def script(conn: socket.socket) -> None:
        reqs = [read_request(conn)[0] for _ in range(count)]
        for req in reqs:
            off = req.address - 0x10000
            conn.sendall(p.encode_response(0, req.req_id, req.nbytes) + data[off:off + req.nbytes])

    peer = FakePeer(script)
    try:
        transport.pipeline("127.0.0.1", peer.port, [(OP_READ, dst.address + i * n,
                                                     0x10000 + i * n, n) for i in range(count)])
    finally:
        transport.close()
        peer.close()
    assert peer.error is None
    assert bytes(dst.buf) == data


def test_no_write_while_a_read_is_outstanding(transport):
    """Both sides could block sending a payload to each other: the peer must have
    answered the READ before the WRITE after it comes."""
    n = 64 * KIB
    buf = Pinned(pattern(3, 2 * n))
    seen: list[str] = []

    def script(conn: socket.socket) -> None:
        w1, _ = read_request(conn)
        r1, _ = read_request(conn)  # sent before w1's reply: writes then a read pipeline
        conn.settimeout(0.3)
        try:
            conn.recv(1, socket.MSG_PEEK)
            seen.append("write sent while the read was outstanding")
        except socket.timeout:
            pass
        conn.settimeout(10)
        conn.sendall(p.encode_response(0, w1.req_id, 0))
        conn.sendall(p.encode_response(0, r1.req_id, n) + b"r" * n)
        w2, payload = read_request(conn)
        seen.append(f"w2 {len(payload)}")
        conn.sendall(p.encode_response(0, w2.req_id, 0))

    peer = FakePeer(script)
    try:
        transport.pipeline("127.0.0.1", peer.port, [
            (OP_WRITE, buf.address, 0x10000, n), (OP_READ, buf.address + n, 0x20000, n),
            (OP_WRITE, buf.address, 0x30000, n)])
    finally:
        transport.close()
        peer.close()
    assert peer.error is None
    assert seen == [f"w2 {n}"]
    assert bytes(buf.buf[n:]) == b"r" * n


def test_malformed_reply_discards_the_connection(transport):
    n = 4 * KIB
    src = Pinned(pattern(4, 3 * n))

    def script(conn: socket.socket) -> None:
        reqs = [read_request(conn)[0] for _ in range(3)]
        conn.sendall(p.encode_response(0, reqs[0].req_id, 0))
        conn.sendall(p.encode_response(0, reqs[2].req_id, 0))  # out of order: malformed

    peer = FakePeer(script)
    try:
        with pytest.raises(ProtocolError) as info:
            transport.pipeline("127.0.0.1", peer.port,
                               [(OP_WRITE, src.address + i * n, 0x10000, n) for i in range(3)])
        assert info.value.completed == {0}
        assert pool_state(transport, peer.port) == (0, 0)  # closed, not pooled half-read
        assert peer.eof.wait(5)
    finally:
        transport.close()
        peer.close()
    assert peer.error is None


def test_a_connection_given_up_on_is_reset_and_sends_nothing_more():
    """A WRITE whose send deadline passes (the peer stopped reading) fails its connection,
    which is reset: the part of the payload our kernel still held is discarded, never
    sent once the peer reads again (test_late_bytes.py: what that could overwrite)."""
    n = p.MAX_SLICE_NBYTES   # more than both socket buffers hold
    src = Pinned(n)
    gave_up = threading.Event()
    got = []

    def script(conn: socket.socket) -> None:
        p.decode_request(recv_exact(conn, p.REQUEST.size))
        assert gave_up.wait(30)
        try:
            while chunk := conn.recv(1 << 20):
                got.append(len(chunk))
            got.append("end of stream")
        except ConnectionResetError:
            got.append("reset")

    peer = FakePeer(script)
    transport = tcp.TcpTransport(1, connect_timeout_s=5, transfer_timeout_s=1)
    try:
        with pytest.raises(TransferError, match="deadline"):
            transport.pipeline("127.0.0.1", peer.port, [(OP_WRITE, src.address, 0x10000, n)])
        gave_up.set()
        assert peer.eof.wait(10)
    finally:
        transport.close()
        peer.close()
    assert peer.error is None and got[-1] == "reset" and sum(got[:-1]) < n, got[-3:]


@pytest.mark.parametrize("op", [OP_WRITE, OP_READ], ids=["write", "read"])
def test_peer_gone_mid_pipeline_is_a_clean_error(transport, op):
    n = 256 * KIB
    buf = Pinned(8 * n)

    def script(conn: socket.socket) -> None:
        first, _ = read_request(conn)
        read_request(conn)
        conn.sendall(p.encode_response(0, first.req_id, 0 if op == OP_WRITE else n)
                     + (b"" if op == OP_WRITE else b"x" * n))
        conn.shutdown(socket.SHUT_WR)  # gone after one answer (a FIN: the answer arrives)
        while conn.recv(1 << 20):
            pass

    peer = FakePeer(script)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            transport.pipeline("127.0.0.1", peer.port,
                               [(op, buf.address + i * n, 0x10000, n) for i in range(8)])
        assert time.monotonic() - t0 < 4  # not the 5 s deadline
        assert info.value.completed == {0}
        assert pool_state(transport, peer.port) == (0, 0)
    finally:
        transport.close()
        peer.close()


# -- against a real target ------------------------------------------------------------------

@pytest.fixture
def target() -> Iterator[TransferEngine]:
    with TransferEngine(config=EngineConfig(transports=["tcp"])) as engine:
        yield engine


@pytest.mark.parametrize("op", [OP_WRITE, OP_READ], ids=["write", "read"])
def test_refused_slice_mid_pipeline_fails_alone(target, transport, op):
    """An out-of-bounds slice among pipelined ones: only it fails, the connection stays
    in step and is reused (still one connection, one server thread)."""
    n = 64 * KIB
    buf = target.allocate(8 * n)
    remote = target.local_view(buf.address, 8 * n)
    remote[:] = pattern(5, 8 * n)
    local = Pinned(pattern(6, 8 * n) if op == OP_WRITE else 8 * n)
    before = bytes(remote)
    positions = [0, 1, 2, 3, 4]
    items = [(op, local.address + i * n, buf.address + i * n, n) for i in positions]
    items[2] = (op, local.address + 2 * n, buf.address + 8 * n, n)  # just past the region
    for attempt in range(2):
        with pytest.raises(AddressError) as info:
            transport.pipeline("127.0.0.1", target.rpc_port, items)
        assert info.value.completed == {0, 1, 3, 4}
        assert pool_state(transport, target.rpc_port) == (1, 1)
    assert len(target._server._conns) == 1
    for i in (0, 1, 3, 4):
        want = (local.buf if op == OP_WRITE else before)[i * n:(i + 1) * n]
        assert bytes(remote[i * n:(i + 1) * n]) == want
        assert bytes(local.buf[i * n:(i + 1) * n]) == want
    assert bytes(remote[2 * n:3 * n]) == before[2 * n:3 * n]
    assert bytes(remote[5 * n:]) == before[5 * n:]
    if op == OP_READ:
        assert bytes(local.buf[2 * n:3 * n]) == bytes(n)  # the refused read wrote nothing
    transport.pipeline("127.0.0.1", target.rpc_port, items[:2])  # the same connection works
    assert len(target._server._conns) == 1
    remote.release()


def test_server_answers_in_order_and_stops_at_a_malformed_frame(target, caplog):
    n = 4 * KIB
    buf = target.allocate(4 * n)
    view = target.local_view(buf.address, 4 * n)
    view[:] = bytes(4 * n)
    frames = (p.encode_request(p.OP_WRITE, 1, buf.address, n) + b"a" * n
              + p.encode_request(p.OP_READ, 2, buf.address, n)
              + p.encode_request(p.OP_WRITE, 3, buf.address + 8 * n, n) + b"c" * n
              + struct.pack("<I", 0xDEADBEEF) + bytes(p.REQUEST.size - 4)
              + p.encode_request(p.OP_WRITE, 5, buf.address + n, n) + b"e" * n)
    with caplog.at_level(logging.WARNING, logger=RPC_LOG), \
            socket.create_connection(("127.0.0.1", target.rpc_port)) as s:
        s.settimeout(10)
        s.sendall(frames)
        magic, status, rid, nbytes = p.RESPONSE.unpack(recv_exact(s, p.RESPONSE.size))
        assert (magic, status, rid, nbytes) == (p.MAGIC, 0, 1, 0)
        assert p.decode_response(recv_exact(s, p.RESPONSE.size), 2, n) == (0, n)
        assert recv_exact(s, n) == b"a" * n
        status, nbytes = p.decode_response(recv_exact(s, p.RESPONSE.size), 3, 0)
        assert status == AddressError.code
        recv_exact(s, nbytes)
        try:
            assert s.recv(1) == b""  # the bad magic closed the connection
        except ConnectionResetError:
            pass  # closed with the last frame unread
    assert bytes(view[:n]) == b"a" * n
    assert bytes(view[n:]) == bytes(3 * n)  # the frame after the bad one was not served
    view.release()
    assert any("malformed frame" in r.getMessage() for r in caplog.records)


# -- through the engine ---------------------------------------------------------------------

@pytest.fixture
def spy(monkeypatch) -> list[int]:
    """Lengths of every pipeline the tcp transport ran."""
    lengths: list[int] = []
    original = tcp.TcpTransport.pipeline

    def pipeline(self, host, port, items):
        lengths.append(len(items))
        return original(self, host, port, items)

    monkeypatch.setattr(tcp.TcpTransport, "pipeline", pipeline)
    return lengths


def engines(slice_nbytes: int = 64 * KIB) -> tuple[TransferEngine, TransferEngine]:
    cfg = lambda: EngineConfig(transports=["tcp"], slice_nbytes=slice_nbytes, workers=2,
                               connections_per_peer=2)
    return TransferEngine(config=cfg()), TransferEngine(config=cfg())


def test_engine_pipelines_many_slices_bytes_compared(spy):
    total, block = 8 << 20, 256 * KIB
    a, b = engines()
    with a, b:
        src, dst, back = a.allocate(total), b.allocate(total), a.allocate(total)
        data = pattern(7, total)
        a.local_view(src.address, total)[:] = data
        count = total // block
        a.submit(b.segment_name, [TransferRequest(OpCode.WRITE, src.address + i * block,
                                                  dst.address + i * block, block)
                                  for i in range(count)]).wait(60)
        assert bytes(b.local_view(dst.address, total)) == data
        assert max(spy) > 1  # several slices per connection
        a.submit(b.segment_name, [TransferRequest(OpCode.READ, back.address + i * block,
                                                  dst.address + i * block, block)
                                  for i in range(count)]).wait(60)
        assert bytes(a.local_view(back.address, total)) == data
        # every slice moved once (the server counts a READ's bytes after sending them, so
        # its counter may trail the reader's last byte a moment)
        want = {"bytes_in": total, "bytes_out": total}
        assert wait_until(lambda: b.stats == want, 5), b.stats


def test_engine_mixed_reads_and_writes_in_one_batch(spy):
    """WRITE and READ requests alternate inside one pipelined task (1 MiB slices)."""
    half, block = 8 << 20, 1 << 20
    a, b = engines(slice_nbytes=1 << 20)
    with a, b:
        mine, theirs = a.allocate(2 * half), b.allocate(2 * half)
        a.local_view(mine.address, half)[:] = pattern(8, half)
        b.local_view(theirs.address + half, half)[:] = pattern(9, half)
        reqs = []
        for i in range(half // block):
            reqs.append(TransferRequest(OpCode.WRITE, mine.address + i * block,
                                        theirs.address + i * block, block))
            reqs.append(TransferRequest(OpCode.READ, mine.address + half + i * block,
                                        theirs.address + half + i * block, block))
        a.submit(b.segment_name, reqs).wait(60)
        assert max(spy) > 1
        assert bytes(b.local_view(theirs.address, half)) == pattern(8, half)
        assert bytes(a.local_view(mine.address + half, half)) == pattern(9, half)


def test_engine_stale_region_fails_its_request_only(spy):
    """The target unregistered a region after we cached its descriptor: that request's
    slices are refused mid-pipeline, the others land, and no slice moves twice."""
    block = 256 * KIB
    a, b = engines()
    with a, b:
        src = a.allocate(3 * block)
        a.local_view(src.address, 3 * block)[:] = pattern(10, 3 * block)
        keep, gone = bytearray(2 * block), bytearray(block)
        keep_addr = b.register(keep).address
        gone_addr = b.register(gone).address
        a.open_segment(b.segment_name)  # caches the descriptor listing both regions
        b.unregister(gone_addr)
        batch = a.submit(b.segment_name, [
            TransferRequest(OpCode.WRITE, src.address, keep_addr, block),
            TransferRequest(OpCode.WRITE, src.address + block, gone_addr, block),
            TransferRequest(OpCode.WRITE, src.address + 2 * block, keep_addr + block, block)])
        assert batch.wait_done(60)
        errors = batch.errors()
        assert errors[0] is None and errors[2] is None
        assert isinstance(errors[1], AddressError)
        assert max(spy) > 1
        data = pattern(10, 3 * block)
        assert bytes(keep) == data[:block] + data[2 * block:]
        assert bytes(gone) == bytes(block)
        assert b.stats["bytes_in"] == 2 * block  # the good slices were not sent again
        a.write(b.segment_name, src.address, keep_addr, block)  # the connections still work


def test_peer_killed_mid_pipelined_writes(spawn_peer):
    nbytes = 64 << 20
    peer = spawn_peer("--nbytes", str(nbytes), "--transports", "tcp")
    cfg = EngineConfig(transports=["tcp"], slice_nbytes=1 << 20, workers=2,
                       transfer_timeout_s=10, retries=1)
    with TransferEngine(config=cfg) as e:
        local = e.allocate(nbytes)
        reqs = [TransferRequest(OpCode.WRITE, local.address, peer.address, nbytes)] * 40
        batch = e.submit(peer.segment, reqs)  # ~2.5 GiB: still running when the peer dies
        os.kill(peer.proc.pid, signal.SIGKILL)
        peer.proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            batch.wait(60)
        assert time.monotonic() - t0 < 30
