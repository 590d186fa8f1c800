"""The P/D side channel: a decode worker asks a prefill worker to write KV blocks.

One msgpack map per frame, each frame preceded by its length (4 bytes, big endian).
A decode worker opens a connection, sends a ``pull`` (write these blocks of that
transfer into my registered memory) or a ``release`` (I will not need them) and reads
one reply ``{"ok": bool, "error": str, "nbytes": int}``.

Everything that arrives is checked before it is used: the frame size, the msgpack
sizes, every field's type and range, unknown fields. A bad frame closes its connection
with a logged error; the server goes on serving the others.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

log = logging.getLogger(__name__)

VERSION = 1
MAX_FRAME = 64 << 20
"""Largest frame either side accepts (a pull of ~100k blocks of 80 layers)."""
MAX_NAME = 256
MAX_PIECES = 4096
"""Pieces of one block (layers x contiguous runs per layer)."""
MAX_BLOCKS = 1 << 16
MAX_CONNECTIONS = 64
_LEN = struct.Struct(">I")
_U64 = (1 << 64) - 1


class ProtocolError(ValueError):
    """A frame that breaks the protocol; the message names the field."""


@dataclass(frozen=True)
class Pull:
    """A decode worker's request about one transfer.

    ``blocks`` empty: a release (the prefill may free the blocks, nothing is written).
    Otherwise block ``first_block + i`` of the prefill's request goes to the
    ``blocks[i]`` addresses of ``segment``, piece by piece (``piece_sizes`` bytes each).
    """

    transfer_id: str
    engine_id: str
    tp_rank: int
    tp_size: int
    segment: str = ""
    first_block: int = 0
    piece_sizes: tuple[int, ...] = ()
    blocks: tuple[tuple[int, ...], ...] = ()

    def to_wire(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"v": VERSION, "op": "pull" if self.blocks else "release",
                               "transfer_id": self.transfer_id, "engine_id": self.engine_id,
                               "tp_rank": self.tp_rank, "tp_size": self.tp_size}
        if self.blocks:
            msg.update(segment=self.segment, first_block=self.first_block,
                       piece_sizes=list(self.piece_sizes), blocks=[list(b) for b in self.blocks])
        return msg


def _str(msg: dict, key: str, empty: bool = False) -> str:
    value = msg.get(key)
    if not isinstance(value, str) or len(value) > MAX_NAME or (not value and not empty):
        raise ProtocolError(f"{key!r} must be a string of 1..{MAX_NAME} characters")
    return value


def _int(msg: dict, key: str, low: int, high: int) -> int:
    value = msg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProtocolError(f"{key!r} must be an integer in {low}..{high}")
    return value


def _ints(values: Any, key: str, count: int, low: int) -> tuple[int, ...]:
    if not isinstance(values, list) or len(values) != count:
        raise ProtocolError(f"{key!r} must be a list of {count} integers")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= _U64:
            raise ProtocolError(f"{key!r} holds {v!r}: not an integer in {low}..2^64-1")
    return tuple(values)


_PULL_KEYS = {"v", "op", "transfer_id", "engine_id", "tp_rank", "tp_size", "segment",
              "first_block", "piece_sizes", "blocks"}
_RELEASE_KEYS = {"v", "op", "transfer_id", "engine_id", "tp_rank", "tp_size"}


def parse_pull(msg: Any) -> Pull:
    """A :class:`Pull` from a decoded frame. Raises ProtocolError."""
    if not isinstance(msg, dict):
        raise ProtocolError("a frame must be a map")
    if msg.get("v") != VERSION:
        raise ProtocolError(f"'v' must be {VERSION}, got {msg.get('v')!r}")
    op = msg.get("op")
    if op not in ("pull", "release"):
        raise ProtocolError(f"'op' must be 'pull' or 'release', got {op!r}")
    unknown = set(msg) - (_PULL_KEYS if op == "pull" else _RELEASE_KEYS)
    if unknown:
        raise ProtocolError(f"unknown field(s) {sorted(map(str, unknown))}")
    tp_size = _int(msg, "tp_size", 1, 1 << 16)
    head = dict(transfer_id=_str(msg, "transfer_id"), engine_id=_str(msg, "engine_id"),
                tp_rank=_int(msg, "tp_rank", 0, tp_size - 1), tp_size=tp_size)
    if op == "release":
        return Pull(**head)
    sizes_raw = msg.get("piece_sizes")
    if not isinstance(sizes_raw, list) or not 1 <= len(sizes_raw) <= MAX_PIECES:
        raise ProtocolError(f"'piece_sizes' must be a list of 1..{MAX_PIECES} sizes")
    sizes = _ints(sizes_raw, "piece_sizes", len(sizes_raw), 1)
    blocks_raw = msg.get("blocks")
    if not isinstance(blocks_raw, list) or not 1 <= len(blocks_raw) <= MAX_BLOCKS:
        raise ProtocolError(f"'blocks' must be a list of 1..{MAX_BLOCKS} blocks")
    blocks = tuple(_ints(b, "blocks", len(sizes), 1) for b in blocks_raw)
    return Pull(**head, segment=_str(msg, "segment"),
                first_block=_int(msg, "first_block", 0, 1 << 32), piece_sizes=sizes,
                blocks=blocks)


def parse_reply(msg: Any) -> tuple[bool, str, int]:
    """``(ok, error, nbytes)`` from a decoded reply frame. Raises ProtocolError."""
    if not isinstance(msg, dict) or set(msg) != {"v", "ok", "error", "nbytes"} \
            or msg["v"] != VERSION or not isinstance(msg["ok"], bool):
        raise ProtocolError(f"malformed reply {str(msg)[:200]}")
    return msg["ok"], _str(msg, "error", empty=True)[:MAX_NAME], \
        _int(msg, "nbytes", 0, _U64)


def reply(ok: bool, error: str = "", nbytes: int = 0) -> dict[str, Any]:
    return {"v": VERSION, "ok": ok, "error": error[:MAX_NAME], "nbytes": nbytes}


# -- framing -------------------------------------------------------------------------------
def send_frame(sock: socket.socket, msg: dict[str, Any]) -> None:
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None at a clean end of stream before the first byte."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            if buf:
                raise ProtocolError(f"connection closed inside a frame ({len(buf)}/{n} bytes)")
            return None
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> Any:
    """The next decoded frame; None when the peer closed between frames."""
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if not 0 < n <= MAX_FRAME:
        raise ProtocolError(f"frame length {n} outside 1..{MAX_FRAME}")
    body = _recv_exact(sock, n)
    if body is None:
        raise ProtocolError("connection closed after a frame header")
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=0,
                               max_ext_len=0, max_str_len=MAX_NAME,
                               max_array_len=max(MAX_BLOCKS, MAX_PIECES), max_map_len=32)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as exc:
        raise ProtocolError(f"undecodable frame ({type(exc).__name__}: {exc})") from None


def ask(host: str, port: int, msg: dict[str, Any], connect_timeout_s: float,
        reply_timeout_s: float) -> tuple[bool, str, int]:
    """Send one request and wait for its reply: ``(ok, error, nbytes)``.

    Raises:
        OSError: the peer is unreachable or timed out.
        ProtocolError: the peer answered something malformed.
    """
    with socket.create_connection((host, port), timeout=connect_timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(reply_timeout_s)
        send_frame(sock, msg)
        answer = recv_frame(sock)
    if answer is None:
        raise ProtocolError("the peer closed the connection without a reply")
    return parse_reply(answer)


class SideChannelServer:
    """Serves pulls on ``host:port`` (port 0: a free one; see :attr:`port`).

    Each connection gets a thread (at most :data:`MAX_CONNECTIONS`); ``handle`` turns a
    :class:`Pull` into a reply and may block (e.g. until the prefill is done).

    Args:
        idle_timeout_s: a connection silent for this long is closed.
    """

    def __init__(self, host: str, port: int, handle: Callable[[Pull], dict[str, Any]],
                 idle_timeout_s: float) -> None:
        self._handle = handle
        self._idle = idle_timeout_s
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="mc-pd-accept",
                                          daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return   # closed
            with self._lock:
                if self._closed or len(self._conns) >= MAX_CONNECTIONS:
                    log.error("P/D side channel %s:%d: refusing %s (%d connections open)",
                              self.host, self.port, peer, len(self._conns))
                    conn.close()
                    continue
                t = threading.Thread(target=self._serve, args=(conn, peer),
                                     name="mc-pd-conn", daemon=True)
                self._conns[conn] = t
            t.start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        try:
            conn.settimeout(self._idle)
            while True:
                msg = recv_frame(conn)
                if msg is None:
                    return
                send_frame(conn, self._handle(parse_pull(msg)))
        except ProtocolError as exc:
            log.error("P/D side channel %s:%d: bad frame from %s, closing it: %s",
                      self.host, self.port, peer, exc)
        except OSError as exc:
            if not self._closed:
                log.warning("P/D side channel %s:%d: connection from %s: %s",
                            self.host, self.port, peer, exc)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def close(self) -> None:
        """Stop accepting, end open connections and wait for their threads."""
        with self._lock:
            self._closed = True
            conns = dict(self._conns)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._acceptor.join()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in conns.values():
            t.join()
