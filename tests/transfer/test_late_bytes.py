"""Bytes of a WRITE on a connection the initiator gave up on never land after its retry.

A tcp connection that failed (a deadline passed, a link went down) is not dead on its
own: the initiator's kernel keeps the unsent part of the WRITE and resends it when the
link is back, and the target, still inside that frame, copies it into the region, after
the slice was retried elsewhere and even after a newer WRITE of the same bytes (seen in
test_multipath_netns.py: a link down for ~7 s, its old frames landing during the next
write, seconds later). The test double here holds the second half of the first WRITE
frame, fails that send as a deadline would, and delivers the held bytes at the end, after
a second WRITE of new data: the target's bytes must be the new ones (they were not, 4 MiB
written over one path or two, before the initiator had the target drop such a connection).
Until the target confirmed that drop, nothing moves to it; a drop that finds no connection
closes it if it is accepted later.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from helpers import wait_until

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.errors import TransferError
from mooncake_plugins.transfer import OpCode, TransferEngine, memory, protocol
from mooncake_plugins.transfer.listener import ConnectionServer
from mooncake_plugins.transfer.transports import tcp
from mooncake_plugins.transfer.transports.tcp import PathDown

MIB = 1 << 20


class HeldWrite:
    """Replaces ``tcp.io.send_frame``: the first WRITE request sent sends its header and
    the first half of its payload, keeps the connection (a dup of its fd) and the second
    half, and fails as an expired send deadline does; every other frame goes out as usual."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real = tcp.io.send_frame
        self.sock: socket.socket | None = None
        self.rest = b""
        self._lock = threading.Lock()
        monkeypatch.setattr(tcp.io, "send_frame", self)

    def __call__(self, fd: int, header: bytes, address: int, nbytes: int) -> None:
        with self._lock:
            take = (self.sock is None and len(header) == protocol.REQUEST.size
                    and protocol.REQUEST.unpack(header)[2] == protocol.OP_WRITE and nbytes >= 2)
            if take:
                self.sock = socket.socket(fileno=os.dup(fd))
        if not take:
            self.real(fd, header, address, nbytes)
            return
        payload = bytes(memory.view(address, nbytes, readonly=True))
        self.sock.sendall(header + payload[:nbytes // 2])
        self.rest = payload[nbytes // 2:]
        raise TimeoutError("socket deadline passed")

    def deliver(self) -> None:
        """Send the held bytes at last, then wait until the target is done with the
        connection (it answered the frame and closed, or it had dropped it)."""
        assert self.sock is not None, "no WRITE was held"
        with self.sock:
            try:
                self.sock.sendall(self.rest)
                self.sock.shutdown(socket.SHUT_WR)
                self.sock.settimeout(30)
                while self.sock.recv(1 << 16):
                    pass
            except OSError:   # reset: the target had dropped the connection
                pass

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldWrite]:
    h = HeldWrite(monkeypatch)
    yield h
    h.close()


def engines(paths: list[str], **initiator: object) -> tuple[TransferEngine, TransferEngine]:
    target = TransferEngine("127.0.0.1", config=EngineConfig(transports=["tcp"],
                                                            tcp_paths=paths))
    cfg = dict(transports=["tcp"], workers=1, slice_nbytes=MIB, transfer_timeout_s=5.0,
               connect_timeout_s=2.0, retries=2, path_pause_s=30.0)
    cfg.update(initiator)
    return target, TransferEngine("127.0.0.1", config=EngineConfig(**cfg))


@pytest.mark.parametrize("paths", [[], ["127.0.0.2"]], ids=["one-path", "two-paths"])
def test_a_retried_write_is_never_overwritten_by_its_first_attempt(held, paths):
    target, initiator = engines(paths)
    with target, initiator:
        n = 4 * MIB
        src, dst = initiator.allocate(n), target.allocate(n)
        old, new = os.urandom(n), os.urandom(n)
        initiator.local_view(src.address, n)[:] = old
        initiator.write(target.segment_name, src.address, dst.address, n, timeout_s=60)
        assert bytes(target.local_view(dst.address, n)) == old
        initiator.local_view(src.address, n)[:] = new
        initiator.write(target.segment_name, src.address, dst.address, n, timeout_s=60)
        assert bytes(target.local_view(dst.address, n)) == new
        held.deliver()   # the first attempt's bytes, late
        got = bytes(target.local_view(dst.address, n))
        stale = [off for off in range(0, n, 4096) if got[off:off + 4096] != new[off:off + 4096]]
        assert not stale, (f"{len(stale)} pages written by the abandoned first attempt after "
                           f"the retry and a newer write, from offset {stale[0]}")


def test_nothing_moves_until_the_target_confirmed_the_failed_connection_ended(monkeypatch,
                                                                              held):
    """While no address of the target confirms the drop of the failed connection, its
    slices are not retried (the transfer fails, its retries at once: the drop is asked
    again only after ``path_pause_s``); the next transfer after that confirms it first,
    then moves."""
    target, initiator = engines([], retries=2, path_pause_s=0.5)
    with target, initiator:
        n = 2 * MIB
        src, dst = initiator.allocate(n), target.allocate(n)
        old, new = os.urandom(n), os.urandom(n)
        transport = next(t for t in initiator._transports if t.name == "tcp")
        real_control = transport.control
        asked: list[bool] = []   # whether each drop_connection went through

        def control(host, port, cmd, **fields):
            if cmd == "drop_connection":
                asked.append(len(asked) > 0)
                if not asked[-1]:
                    raise PathDown(f"cannot connect to {host}:{port}: (test) refused")
            return real_control(host, port, cmd, **fields)

        monkeypatch.setattr(transport, "control", control)
        initiator.local_view(src.address, n)[:] = old
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="has not confirmed"):
            initiator.write(target.segment_name, src.address, dst.address, n, timeout_s=60)
        assert asked == [False] and time.monotonic() - t0 < 0.5
        initiator.local_view(src.address, n)[:] = new
        assert wait_until(lambda: initiator.transfer_many(
            OpCode.WRITE, {target.segment_name: [(src.address, dst.address, n)]}
        )[target.segment_name] == [None], 10, interval_s=0.1)
        assert asked == [False, True]
        held.deliver()
        assert bytes(target.local_view(dst.address, n)) == new


def test_a_dropped_connection_not_yet_accepted_is_closed_when_it_is():
    """A drop that finds no such connection remembers it: the server may not have
    accepted it yet, and then closes it on accept, unread."""

    class Echo(ConnectionServer):
        def _serve(self, conn, addr):
            while data := conn.recv(4096):
                conn.sendall(data)

    server = Echo("127.0.0.1", 0, "echo")
    server.start()
    try:
        with socket.socket() as client:
            client.bind(("127.0.0.1", 0))
            src = client.getsockname()
            assert server.drop(src, ("127.0.0.1", server.port), timeout_s=5) is False
            client.connect(("127.0.0.1", server.port))
            client.settimeout(10)
            try:
                client.sendall(b"late bytes")
                assert client.recv(64) == b""
            except ConnectionResetError:
                pass
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as other:
            other.sendall(b"x")
            assert other.recv(1) == b"x"   # any other connection is served
    finally:
        server.close()
