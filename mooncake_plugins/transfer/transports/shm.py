"""The shm transport: same-host copies without sockets.

Regions the target allocated through the engine are memfd-backed: we map them once
through ``/proc/<pid>/fd/<n>`` and copy with memcpy (one copy, no syscall per slice).
Other registered memory is reached with process_vm_readv/writev (one copy in the kernel).

Bounds are checked against the target's published descriptor. The target bumps an epoch
counter in a small shared memfd page on every (un)registration; a changed epoch makes us
re-fetch the descriptor before the copy. What remains is the window between that check
and the copy itself: a region unregistered exactly then may still be written. memfd
regions are safe even so (our mapping keeps the pages alive); for process_vm regions the
owner must not unregister memory it is still exposing to peers, as with RDMA.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
from typing import TYPE_CHECKING, Any

from ...config import PURE_PYTHON
from ...errors import TransferError
from .. import memory
from ..topology import host_id
from .base import OP_WRITE, Transport

if TYPE_CHECKING:
    from ..engine import Peer

log = logging.getLogger(__name__)
EPOCH = struct.Struct("<Q")


class _PyShm:
    """Fallback of ``_native.shm`` through ctypes (same names and semantics)."""

    def __init__(self) -> None:
        import ctypes

        class IoVec(ctypes.Structure):
            _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

        self._ct = ctypes
        self._iovec = IoVec
        libc = ctypes.CDLL(None, use_errno=True)
        self._readv, self._writev = libc.process_vm_readv, libc.process_vm_writev
        for fn in (self._readv, self._writev):
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                           ctypes.c_ulong, ctypes.c_ulong]

    def vm_copy(self, pid: int, local_address: int, remote_address: int, nbytes: int,
                write: bool) -> None:
        ct, fn = self._ct, (self._writev if write else self._readv)
        done = 0
        while done < nbytes:
            local = self._iovec(local_address + done, nbytes - done)
            remote = self._iovec(remote_address + done, nbytes - done)
            rc = fn(pid, ct.byref(local), 1, ct.byref(remote), 1, 0)
            if rc < 0:
                err = ct.get_errno()
                if err == 4:  # EINTR
                    continue
                raise OSError(err, os.strerror(err))
            if rc == 0:
                raise OSError(f"process_vm transfer made no progress (pid {pid})")
            done += rc

    @staticmethod
    def memfd_create(name: str) -> int:
        return os.memfd_create(name, os.MFD_CLOEXEC)


def _pick_impl() -> Any:
    if not PURE_PYTHON:
        try:
            from ..._native import shm as native_shm

            return native_shm
        except ImportError as exc:  # pragma: no cover - depends on the build
            log.warning("native shm unavailable (%s); using the ctypes fallback", exc)
    return _PyShm()


impl: Any = _pick_impl()
IMPLEMENTATION = "python" if isinstance(impl, _PyShm) else "native"


class _Mapping:
    """One memfd of a peer mapped into this process."""

    def __init__(self, pid: int, fd: int, nbytes: int, writable: bool = True) -> None:
        path = f"/proc/{pid}/fd/{fd}"
        flags = os.O_RDWR if writable else os.O_RDONLY
        ofd = os.open(path, flags | os.O_CLOEXEC)
        try:
            self.map = mmap.mmap(ofd, nbytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                 mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        finally:
            os.close(ofd)
        self._export = memory.Export(self.map, writable) if writable else None
        self.address = self._export.address if self._export else 0

    def close(self) -> None:
        if self._export is not None:
            self._export.release()
        self.map.close()


class ShmTransport(Transport):
    """Initiator side of shm; the target does nothing but publish its descriptor."""

    name = "shm"

    def __init__(self) -> None:
        self._host_id = host_id()
        self._maps: dict[tuple[int, int, int], _Mapping] = {}
        self._epochs: dict[tuple[int, int], _Mapping] = {}
        self._lock = threading.Lock()

    def supports(self, peer: "Peer") -> bool:
        return peer.descriptor.host_id == self._host_id

    def _epoch_page(self, pid: int, fd: int) -> _Mapping:
        with self._lock:
            page = self._epochs.get((pid, fd))
            if page is None:
                page = self._epochs[(pid, fd)] = _Mapping(pid, fd, mmap.PAGESIZE, writable=False)
            return page

    def _region_map(self, pid: int, fd: int, nbytes: int) -> _Mapping:
        with self._lock:
            m = self._maps.get((pid, fd, nbytes))
            if m is None:
                m = self._maps[(pid, fd, nbytes)] = _Mapping(pid, fd, nbytes)
            return m

    def _current(self, peer: "Peer") -> Any:
        """The peer's descriptor, re-fetched if its epoch page says regions changed."""
        desc = peer.descriptor
        if desc.epoch_memfd >= 0:
            try:
                epoch = EPOCH.unpack_from(self._epoch_page(desc.pid, desc.epoch_memfd).map, 0)[0]
            except OSError as exc:
                raise TransferError(f"segment {desc.name!r} (pid {desc.pid}) is gone: {exc}") from exc
            if epoch != desc.epoch:
                desc = peer.refresh()
        return desc

    def execute(self, peer: "Peer", op: int, local_address: int, remote_address: int,
                nbytes: int) -> None:
        self.execute_many(peer, [(0, op, local_address, remote_address, nbytes)])

    def execute_many(self, peer: "Peer", slices: list[tuple[int, int, int, int, int]]) -> None:
        """Check every slice against the live descriptor, then copy them all in one call."""
        desc = self._current(peer)
        same_process = desc.pid == os.getpid()
        copies: list[tuple[int, int, int]] = []
        bases: dict[int, int] = {}  # memfd -> where it is mapped here
        for _, op, local, remote, n in slices:
            write = op == OP_WRITE
            region = desc.find(remote, n, write)
            if same_process:
                peer_address = remote
            elif region.memfd >= 0:
                base = bases.get(region.memfd)
                if base is None:
                    base = bases[region.memfd] = self._region_map(desc.pid, region.memfd,
                                                                  region.nbytes).address
                peer_address = base + (remote - region.address)
            else:
                impl.vm_copy(desc.pid, local, remote, n, write)
                continue
            copies.append((peer_address, local, n) if write else (local, peer_address, n))
        memory.copy_many(copies)

    def forget(self, peer: "Peer") -> None:
        pid = peer.descriptor.pid
        with self._lock:
            drop = [k for k in self._maps if k[0] == pid]
            maps = [self._maps.pop(k) for k in drop]
            drop = [k for k in self._epochs if k[0] == pid]
            maps += [self._epochs.pop(k) for k in drop]
        for m in maps:
            m.close()

    def close(self) -> None:
        with self._lock:
            maps = list(self._maps.values()) + list(self._epochs.values())
            self._maps.clear()
            self._epochs.clear()
        for m in maps:
            m.close()
