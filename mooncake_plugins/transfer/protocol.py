"""Wire frames of the engine's rpc port, and their validation.

Data frames have a fixed binary header (little endian) so the hot path needs one
``struct`` call; control frames carry a msgpack map. Every field is checked here; a
frame that fails raises :class:`ProtocolError`, and the server closes that connection.

Request:  magic u32 | version u8 | op u8 | flags u16 | req_id u64 | address u64 | nbytes u64 | aux_len u32
Response: magic u32 | status i32 | req_id u64 | nbytes u64   (then nbytes of payload or error text)
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import ProtocolError

MAGIC = 0x4D43544E  # "MCTN"
VERSION = 1
REQUEST = struct.Struct("<IBBHQQQI")
RESPONSE = struct.Struct("<IiQQ")

OP_READ = 1
OP_WRITE = 2
OP_CONTROL = 3
OPS = (OP_READ, OP_WRITE, OP_CONTROL)

MAX_SLICE_NBYTES = 64 << 20
"""Largest data payload in one frame; larger requests are sliced by the initiator."""
MAX_CONTROL_NBYTES = 1 << 20
MAX_ERROR_NBYTES = 4096

CONTROL_COMMANDS = {
    "describe": {},
    "ping": {},
    "notify": {"name": str, "msg": str},
    "rdma_connect": {"segment": str, "qps": list},
    "drop_connection": {"src": str, "dst": str},
}
MAX_CONNECT_QPS = 64
"""Queue pairs one ``rdma_connect`` may ask for."""
_RDMA_MTUS = (256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class Request:
    op: int
    req_id: int
    address: int
    nbytes: int
    aux_len: int


def encode_request(op: int, req_id: int, address: int, nbytes: int, aux_len: int = 0) -> bytes:
    return REQUEST.pack(MAGIC, VERSION, op, 0, req_id, address, nbytes, aux_len)


def decode_request(header: bytes) -> Request:
    """Parse and validate a request header."""
    if len(header) != REQUEST.size:
        raise ProtocolError(f"request header has {len(header)} bytes, expected {REQUEST.size}")
    magic, version, op, flags, req_id, address, nbytes, aux_len = REQUEST.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic 0x{magic:08x}")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version}")
    if op not in OPS:
        raise ProtocolError(f"unknown op {op}")
    if flags != 0:
        raise ProtocolError(f"unknown flags 0x{flags:x}")
    if op == OP_CONTROL:
        if address or nbytes or not 0 < aux_len <= MAX_CONTROL_NBYTES:
            raise ProtocolError(f"bad control frame (address={address}, nbytes={nbytes}, "
                                f"aux_len={aux_len})")
    else:
        if aux_len:
            raise ProtocolError("data frames carry no aux payload")
        if not 0 < nbytes <= MAX_SLICE_NBYTES:
            raise ProtocolError(f"data frame nbytes={nbytes} outside (0, {MAX_SLICE_NBYTES}]")
        if address + nbytes > (1 << 64) - 1:
            raise ProtocolError("data frame range wraps around the address space")
    return Request(op, req_id, address, nbytes, aux_len)


def encode_response(status: int, req_id: int, nbytes: int) -> bytes:
    return RESPONSE.pack(MAGIC, status, req_id, nbytes)


def decode_response(header: bytes, req_id: int, expect_nbytes: int) -> tuple[int, int]:
    """Validate a response to request ``req_id``; return ``(status, nbytes)``."""
    magic, status, rid, nbytes = RESPONSE.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad response magic 0x{magic:08x}")
    if rid != req_id:
        raise ProtocolError(f"response for request {rid}, expected {req_id}")
    if status == 0:
        if nbytes != expect_nbytes:
            raise ProtocolError(f"response carries {nbytes} bytes, expected {expect_nbytes}")
    elif status > 0 or nbytes > MAX_ERROR_NBYTES:
        raise ProtocolError(f"bad error response (status={status}, nbytes={nbytes})")
    return status, nbytes


def encode_control(cmd: str, **fields: Any) -> bytes:
    return msgpack.packb({"cmd": cmd, **fields}, use_bin_type=True)


def unpack_bounded(payload: bytes, max_containers: int, **limits: int) -> Any:
    """``msgpack.unpackb`` (str keys, no raw) that refuses more than ``max_containers``
    maps and arrays in all, besides ``limits`` (``max_array_len=...``).

    Decoding costs memory per object, up to about 64 bytes per payload byte for a run of
    empty maps; the count is checked as each container completes, so such a payload is
    refused after ``max_containers`` objects instead of being built whole.

    Raises:
        ProtocolError: not one valid msgpack object, or over a limit.
    """
    left = max_containers

    def count(obj: Any) -> Any:
        nonlocal left
        left -= 1
        if left < 0:
            raise ProtocolError(f"more than {max_containers} maps and arrays")
        return obj

    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True, list_hook=count,
                               object_hook=count, **limits)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack's errors (ValueError, StackError, ExtraData, ...)
        raise ProtocolError(f"payload is not valid msgpack: {exc}") from None


def decode_control(payload: bytes) -> dict[str, Any]:
    """Unpack and validate a control message against :data:`CONTROL_COMMANDS`."""
    msg = unpack_bounded(payload, 2 + MAX_CONNECT_QPS, max_bin_len=0,
                         max_array_len=MAX_CONNECT_QPS, max_map_len=16)
    if not isinstance(msg, dict) or not isinstance(msg.get("cmd"), str):
        raise ProtocolError("control payload must be a map with a string 'cmd'")
    schema = CONTROL_COMMANDS.get(msg["cmd"])
    if schema is None:
        raise ProtocolError(f"unknown control command {msg['cmd']!r}")
    extra = set(msg) - set(schema) - {"cmd"}
    if extra:
        raise ProtocolError(f"control command {msg['cmd']!r} has unknown fields {sorted(extra)}")
    for key, typ in schema.items():
        if not isinstance(msg.get(key), typ) or len(msg[key]) > 65536:
            raise ProtocolError(f"control command {msg['cmd']!r} needs {key}: {typ.__name__}")
    if msg["cmd"] == "rdma_connect":
        _check_qps(msg["qps"])
    elif msg["cmd"] == "drop_connection":
        parse_endpoint(msg["src"])
        parse_endpoint(msg["dst"])
    elif any(isinstance(v, list) for v in msg.values()):
        raise ProtocolError(f"control command {msg['cmd']!r} takes no lists")
    return msg


def format_endpoint(end: tuple) -> str:
    """``(host, port)`` as ``drop_connection`` carries it: ``host:port``."""
    return f"{end[0]}:{end[1]}"


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host:port`` (the host an IP address, v4 or v6) back to ``(host, port)``."""
    host, _, port = text.rpartition(":")
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise ProtocolError(f"bad endpoint {text[:80]!r} (want ip:port)") from None
    if not 0 < number < 65536 or not port.isdigit():
        raise ProtocolError(f"bad endpoint {text[:80]!r} (port out of range)")
    return host, number


def _check_qps(qps: list) -> None:
    """``rdma_connect``'s queue pairs: ``[peer NIC index, qpn, psn, GID text, LID, MTU]``."""
    def u(x: Any, bits: int) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << bits

    if not 0 < len(qps) <= MAX_CONNECT_QPS:
        raise ProtocolError(f"rdma_connect asks for {len(qps)} queue pairs (1 to "
                            f"{MAX_CONNECT_QPS})")
    for qp in qps:
        if (not isinstance(qp, list) or len(qp) != 6 or not u(qp[0], 4) or not u(qp[1], 24)
                or not qp[1] or not u(qp[2], 24) or not isinstance(qp[3], str)
                or len(qp[3]) > 64 or not u(qp[4], 16) or qp[5] not in _RDMA_MTUS
                or not u(qp[5], 16)):
            raise ProtocolError(f"rdma_connect has a malformed queue pair {qp!r:.200}")
        try:
            ipaddress.IPv6Address(qp[3])
        except ValueError:
            raise ProtocolError(f"rdma_connect has a bad GID {qp[3]!r}") from None
