"""Validation of every field of the wire frames."""

import msgpack
import pytest

from mooncake_plugins.errors import ProtocolError
from mooncake_plugins.transfer import protocol as p


def test_request_round_trip():
    req = p.decode_request(p.encode_request(p.OP_WRITE, 7, 4096, 100))
    assert (req.op, req.req_id, req.address, req.nbytes, req.aux_len) == (p.OP_WRITE, 7, 4096, 100, 0)
    ctl = p.decode_request(p.encode_request(p.OP_CONTROL, 1, 0, 0, 10))
    assert ctl.aux_len == 10


@pytest.mark.parametrize("fields", [
    dict(magic=0xDEADBEEF), dict(version=9), dict(op=0), dict(op=9), dict(flags=1),
    dict(nbytes=0), dict(nbytes=p.MAX_SLICE_NBYTES + 1), dict(aux_len=4),
    dict(address=(1 << 64) - 10, nbytes=20),
    dict(op=p.OP_CONTROL, nbytes=0, aux_len=0), dict(op=p.OP_CONTROL, nbytes=0,
                                                     aux_len=p.MAX_CONTROL_NBYTES + 1),
    dict(op=p.OP_CONTROL, nbytes=5, aux_len=5),
])
def test_bad_request_headers(fields):
    base = dict(magic=p.MAGIC, version=p.VERSION, op=p.OP_READ, flags=0, req_id=1,
                address=4096, nbytes=100, aux_len=0)
    base.update(fields)
    with pytest.raises(ProtocolError):
        p.decode_request(p.REQUEST.pack(*base.values()))


def test_short_header():
    with pytest.raises(ProtocolError):
        p.decode_request(b"\x00" * 10)


def test_responses():
    assert p.decode_response(p.encode_response(0, 3, 64), 3, 64) == (0, 64)
    assert p.decode_response(p.encode_response(-5, 3, 10), 3, 64) == (-5, 10)
    for hdr, rid, n in ((p.encode_response(0, 4, 64), 3, 64), (p.encode_response(0, 3, 63), 3, 64),
                        (p.encode_response(5, 3, 0), 3, 0), (p.encode_response(-1, 3, 99999), 3, 0),
                        (p.RESPONSE.pack(1, 0, 3, 64), 3, 64)):
        with pytest.raises(ProtocolError):
            p.decode_response(hdr, rid, n)


def test_control_messages():
    assert p.decode_control(p.encode_control("describe")) == {"cmd": "describe"}
    assert p.decode_control(p.encode_control("notify", name="a", msg="b"))["msg"] == "b"
    bad = [b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"cmd": 1}), msgpack.packb({"cmd": "rm -rf"}),
           msgpack.packb({"cmd": "notify", "name": "a"}), msgpack.packb({"cmd": "notify", "name": "a", "msg": 3}),
           msgpack.packb({"cmd": "describe", "extra": 1}), msgpack.packb({"cmd": "ping"}) + b"x",
           msgpack.packb({"cmd": "notify", "name": "a", "msg": "x" * 70000})]
    for payload in bad:
        with pytest.raises(ProtocolError):
            p.decode_control(payload)


def test_drop_connection_names_two_ip_endpoints():
    msg = p.decode_control(p.encode_control("drop_connection", src="10.0.0.1:40000",
                                            dst="::1:1234"))
    assert (p.parse_endpoint(msg["src"]), p.parse_endpoint(msg["dst"])) == \
        (("10.0.0.1", 40000), ("::1", 1234))
    assert p.format_endpoint(("10.0.0.1", 40000)) == "10.0.0.1:40000"
    for bad in ["10.0.0.1", "host:80", "10.0.0.1:0", "10.0.0.1:65536", "10.0.0.1:+80", ":80"]:
        with pytest.raises(ProtocolError):
            p.decode_control(p.encode_control("drop_connection", src=bad, dst="10.0.0.2:80"))
    with pytest.raises(ProtocolError):
        p.decode_control(p.encode_control("drop_connection", src="10.0.0.1:80"))
