"""Malformed and hostile frames thrown at a live engine: it refuses them and keeps serving."""

import logging
import random
import socket

import msgpack
import pytest

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.transfer import TransferEngine
from mooncake_plugins.transfer import protocol as p


@pytest.fixture
def target():
    with TransferEngine(config=EngineConfig(transports=["tcp"])) as e:
        buf = e.allocate(1 << 16)
        buf.view()[:] = bytes(1 << 16)
        yield e, buf


def send(port, data, read=True):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the server already closed on a bad header
            return b""
        out = b""
        while read:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:  # closed by the server with our bytes unread
                break
            if not chunk:
                break
            out += chunk
        return out


def alive(engine, buf):
    with TransferEngine(config=EngineConfig(transports=["tcp"])) as probe:
        mine = probe.allocate(4096)
        mine.view()[:] = b"\x5a" * 4096
        probe.write(engine.segment_name, mine.address, buf.address, 4096)
    return bytes(buf.view()[:4096]) == b"\x5a" * 4096


def header(**kw):
    f = dict(magic=p.MAGIC, version=p.VERSION, op=p.OP_READ, flags=0, req_id=1, address=0,
             nbytes=16, aux_len=0)
    f.update(kw)
    return p.REQUEST.pack(*f.values())


def test_random_garbage(target):
    engine, buf = target
    rng = random.Random(1234)
    for _ in range(200):
        send(engine.rpc_port, rng.randbytes(rng.randrange(1, 300)), read=False)
    assert alive(engine, buf)


def test_mutated_valid_frames(target, caplog):
    engine, buf = target
    rng = random.Random(99)
    valid = [header(address=buf.address, nbytes=64),
             header(op=p.OP_WRITE, address=buf.address, nbytes=8) + b"x" * 8,
             header(op=p.OP_CONTROL, nbytes=0, aux_len=len(c := p.encode_control("describe"))) + c]
    with caplog.at_level(logging.ERROR):
        for _ in range(300):
            frame = bytearray(rng.choice(valid))
            for _ in range(rng.randrange(1, 4)):
                frame[rng.randrange(len(frame))] = rng.randrange(256)
            send(engine.rpc_port, bytes(frame))
    assert alive(engine, buf)


@pytest.mark.parametrize("frame", [
    header(magic=1), header(version=7), header(op=77), header(flags=3),
    header(nbytes=p.MAX_SLICE_NBYTES + 1), header(op=p.OP_WRITE, nbytes=1 << 40),
    header(op=p.OP_CONTROL, nbytes=0, aux_len=1 << 30),
    header(op=p.OP_CONTROL, nbytes=0, aux_len=5) + b"\xc1\xc1\xc1\xc1\xc1",
    header(op=p.OP_CONTROL, nbytes=0, aux_len=9) + msgpack.packb({"cmd": "exec"}),
    b"\x00" * 10,
], ids=["magic", "version", "op", "flags", "huge-read", "huge-write", "huge-control",
        "bad-msgpack", "unknown-cmd", "short"])
def test_malformed_frame_closes_only_that_connection(target, frame, caplog):
    engine, buf = target
    with caplog.at_level(logging.ERROR, logger="mooncake_plugins.transfer.rpc_server"):
        reply = send(engine.rpc_port, frame)
    assert reply == b""  # no data, just a closed connection
    if frame != b"\x00" * 10:
        assert "malformed frame" in caplog.text
    assert alive(engine, buf)


def test_out_of_bounds_raw_frames_get_errors(target):
    engine, buf = target
    secret = bytearray(b"secret" * 100)
    secret_addr = engine.register(secret).address
    engine.unregister(secret_addr)  # was registered once, not any more
    for addr in (0, 4096, buf.address - 16, buf.address + (1 << 16) - 8, secret_addr,
                 id(engine)):
        reply = send(engine.rpc_port, header(address=addr, nbytes=16))
        magic, status, rid, n = p.RESPONSE.unpack(reply[:p.RESPONSE.size])
        assert status < 0 and b"not inside a registered region" in reply[p.RESPONSE.size:]
        assert b"secret" not in reply
    # a refused write is drained, and the connection stays usable for the next frame
    frames = (header(op=p.OP_WRITE, address=4096, nbytes=32) + b"y" * 32
              + header(req_id=2, address=buf.address, nbytes=8))
    reply = send(engine.rpc_port, frames)
    first = p.RESPONSE.unpack(reply[:p.RESPONSE.size])
    rest = reply[p.RESPONSE.size + first[3]:]
    second = p.RESPONSE.unpack(rest[:p.RESPONSE.size])
    assert first[1] < 0 and second[1] == 0 and second[2] == 2 and len(rest) == p.RESPONSE.size + 8
    assert alive(engine, buf)
