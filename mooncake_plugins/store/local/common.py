"""What the host and its dummies share: limits, message schemas, and memfd mapping."""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
from typing import Sequence

from ...errors import InvalidParams, MooncakeError
from ..rpc import ListOf

log = logging.getLogger(__name__)

DEFAULT_PORT = 50052
MAX_SESSIONS = 1024
MAX_MAPPINGS = 4096
"""Mappings one session may hold at once."""
MAX_MAPPING_NBYTES = 1 << 44
CONTROL_MSG_NBYTES = 512
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK
CONFIG_SCHEMA = {"replica_num": int, "preferred_segments": ListOf(str), "with_soft_pin": bool}
PARTS_SCHEMA = {"keys": ListOf(str), "counts": ListOf(int), "addrs": ListOf(int), "sizes": ListOf(int)}
"""Pieces of memory per key, flat (a request may hold only a few lists)."""

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_fd(fd: int, nbytes: int) -> int:
    """Map ``fd`` shared and writable; unlike ``mmap.mmap`` this keeps no descriptor open."""
    address = libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {nbytes} bytes failed: {os.strerror(err)}")
    return address


def unmap(address: int, nbytes: int) -> bool:
    """Undo :func:`map_fd`; a failure is logged (the mapping then stays), False returned."""
    if libc.munmap(address, nbytes) == 0:
        return True
    err = ctypes.get_errno()
    log.error("munmap of %d bytes at 0x%x failed: %s", nbytes, address, os.strerror(err))
    return False


def wire_error(err: BaseException | None) -> list:
    """``[code, message]`` of a per-key outcome (``[0, ""]``: success)."""
    if err is None:
        return [0, ""]
    code = err.code if isinstance(err, MooncakeError) and err.code < 0 else -1
    return [code, str(err)]


def flatten(parts: Sequence[Sequence[tuple[int, int]]]) -> dict[str, list[int]]:
    """``(address, nbytes)`` pieces per key -> the ``counts``/``addrs``/``sizes`` arguments."""
    addrs = [int(a) for p in parts for a, _ in p]
    sizes = [int(n) for p in parts for _, n in p]
    if any(not 0 <= x < 1 << 64 for x in (*addrs, *sizes)):
        raise InvalidParams("addresses and sizes must be in [0, 2**64)")
    return {"counts": [len(p) for p in parts], "addrs": addrs, "sizes": sizes}


def unflatten(keys: list[str], counts: list[int], addrs: list[int],
              sizes: list[int]) -> list[list[tuple[int, int]]]:
    """The inverse of :func:`flatten`, checked (InvalidParams when the lists disagree)."""
    if len(counts) != len(keys) or len(addrs) != len(sizes) or sum(counts) != len(addrs):
        raise InvalidParams("keys, counts, addrs and sizes do not line up")
    if any(c < 1 for c in counts) or any(n < 0 for n in sizes):
        raise InvalidParams("every key needs at least one piece, of a size >= 0")
    out, i = [], 0
    for c in counts:
        out.append(list(zip(addrs[i:i + c], sizes[i:i + c])))
        i += c
    return out
