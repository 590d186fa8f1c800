"""Raw-socket helpers of the trust-model tests: every socket has a timeout, loopback only."""

from __future__ import annotations

import socket
import time

HOST = "127.0.0.1"
TIMEOUT_S = 5.0


def connect(port: int, timeout_s: float = TIMEOUT_S) -> socket.socket:
    """A connection to ``127.0.0.1:port`` whose operations time out after ``timeout_s``."""
    return socket.create_connection((HOST, port), timeout=timeout_s)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset counts as closed)."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def exchange(port: int, data: bytes) -> bytes:
    """Send ``data``, half-close, and return the reply read until the server closes."""
    with connect(port) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server already closed on a bad prefix
            return b""
        return read_until_closed(sock)


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    """Exactly ``nbytes`` from ``sock`` (ConnectionError when it closes first)."""
    out = bytearray()
    while len(out) < nbytes:
        chunk = sock.recv(nbytes - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {nbytes} bytes")
        out += chunk
    return bytes(out)


def closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``sock`` within ``within_s`` (whatever it sent first)."""
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
    return False


def rss_nbytes() -> int:
    """Resident set size of this process now."""
    return _status_kib("VmRSS") * 1024


def reset_peak_rss() -> None:
    """Start measuring :func:`peak_rss_nbytes` from now (Linux clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_nbytes() -> int:
    """Largest resident set size since :func:`reset_peak_rss`."""
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")
