"""The shm transport: same-host copies without sockets.

Regions the target allocated through the engine are memfd-backed: we map them once
through ``/proc/<pid>/fd/<n>`` and copy with memcpy (one copy, no syscall per slice).
Other registered memory is reached with process_vm_readv/writev (one copy in the kernel).
A target in this very process is reached through its live region table, holding the
target's regions (its in-flight count) during the copy, as its tcp server would.

Bounds are checked against the target's published descriptor. The target bumps an epoch
counter in a small shared memfd page (its epoch page, ``same_host.py``) on every
(un)registration, before it releases any memory. A copy reads that epoch before and after
(a seqlock): a changed epoch means the regions changed meanwhile, and the copy is
repeated against the fresh descriptor unless every memfd it touched is still the same
file (its inode). So a copy reported done landed
in memory that was registered when it finished: a buffer freed and reallocated at the same
address and fd number is never written through the old mapping. The window that remains
is for process_vm regions only: memory unregistered during the copy may have been written
(the owner must not unregister memory it is still exposing to peers, as with RDMA).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import socket
import struct
import threading
from typing import Any, Callable

from ...errors import AddressError, MooncakeError, TransferError
from .. import memory
from ..peer import Peer
from ..same_host import EPOCH, MEMFD_PREFIX, local_table
from ..segment import HOST, RegionInfo
from ..topology import host_id
from .base import OP_WRITE, PRIORITY_SHM, Transport, use_default

log = logging.getLogger(__name__)


class _PyShm:
    """Fallback of ``_native.shm`` through ctypes (same names and semantics)."""

    def __init__(self) -> None:
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

    def vm_copy_many(self, pid: int, copies: list[tuple[int, int, int]], write: bool) -> None:
        for local, remote, nbytes in copies:
            self.vm_copy(pid, local, remote, nbytes, write)


class _Impl:
    """The copy functions in use: ``_native.shm``'s or ``_PyShm``'s, rebound by :func:`use`."""


impl: Any = _Impl()
IMPLEMENTATION = ""


def use(native: bool) -> None:
    """Bind ``impl`` to the native module or to the ctypes fallback."""
    global IMPLEMENTATION
    src: Any = None
    if native:
        from ..._native import shm as src
    else:
        src = _PyShm()
    impl.vm_copy, impl.vm_copy_many = src.vm_copy, src.vm_copy_many
    IMPLEMENTATION = "native" if native else "python"


use_default(use, "shm")


class _Mapping:
    """One memfd of a peer mapped into this process; ``users`` copies are using it now."""

    def __init__(self, pid: int, fd: int, nbytes: int, writable: bool = True) -> None:
        path = f"/proc/{pid}/fd/{fd}"
        flags = os.O_RDWR if writable else os.O_RDONLY
        ofd = os.open(path, flags | os.O_CLOEXEC)
        try:
            name = os.readlink(f"/proc/self/fd/{ofd}")
            if not name.startswith(MEMFD_PREFIX):  # only an engine's own memfds, no other file
                raise TransferError(f"fd {fd} of pid {pid} is {name!r}, not an engine's memfd")
            self.inode = os.fstat(ofd).st_ino
            # no MAP_POPULATE: first contact with a 64 GiB segment must not build page
            # tables for all of it; pages fault in as copies touch them
            self.map = mmap.mmap(ofd, nbytes, mmap.MAP_SHARED,
                                 mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        finally:
            os.close(ofd)
        self.fd, self.nbytes = fd, nbytes
        self.checked_epoch = -1  # the peer's epoch at which ``inode`` was last confirmed
        self.users = 0
        self.retired = False
        self._export = memory.Export(self.map, writable) if writable else None
        self.address = self._export.address if self._export else 0
        # per granule: 1 populated readable, 3 writable (a page stays mapped once it is,
        # short of reclaim, which only costs a fault again)
        self._populated = bytearray(-(-nbytes // _GRANULE))

    def populate(self, offset: int, nbytes: int, write: bool) -> None:
        """Map the pages of bytes ``offset..offset + nbytes`` before a large copy, unless
        an earlier copy did: a second madvise over mapped pages still walks them all (5 ms
        of a 64 MiB read)."""
        if nbytes < _POPULATE_MIN:
            return
        marks, need = self._populated, 3 if write else 1
        first, end = offset // _GRANULE, -(-(offset + nbytes) // _GRANULE)
        if min(marks[first:end]) >= need:
            return
        _populate(self.address + offset, nbytes, write)
        inner, inner_end = -(-offset // _GRANULE), (offset + nbytes) // _GRANULE
        if inner < inner_end:   # granules wholly inside the range are mapped now
            marks[inner:inner_end] = bytes(max(m, need) for m in marks[inner:inner_end])

    def close(self) -> None:
        if self._export is not None:
            self._export.release()
        self.map.close()


_POPULATE_MIN = 256 << 10
_GRANULE = 64 << 10   # what a mapping remembers as populated
_populate_works = True


def _populate(address: int, nbytes: int, write: bool) -> None:
    """Map ``nbytes`` of a peer's memfd at ``address`` in one call before a large copy:
    mappings are made without MAP_POPULATE (first contact with a 64 GiB segment must not
    build page tables for all of it), and one madvise costs far less than a page fault for
    each 4 KiB the copy touches. Best effort: a kernel without it just faults."""
    global _populate_works
    if _populate_works and memory.populate(address, nbytes, write) == errno.EINVAL:
        _populate_works = False


_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_DUMP_REQUEST = 0x1 | 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_TCP_LISTEN = 10
_DIAG_REQ = struct.Struct("=IHHII BBBxI HH16s16sI8s")  # nlmsghdr + inet_diag_req_v2
_DIAG_MSG = struct.Struct("=IHHII BBBB HH16s16sI8s IIIII")  # nlmsghdr + inet_diag_msg


def _listener_inodes_netlink(host: bytes, port: int) -> set[int]:
    """Listening TCP sockets on ``port`` bound to ``host`` (4 bytes) or a wildcard, from
    the kernel's sock_diag: it walks only the listening table, where reading
    /proc/net/tcp walks every connection bucket (milliseconds on a first contact)."""
    inodes = set()
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4) as nl:  # NETLINK_SOCK_DIAG
        nl.settimeout(1.0)
        for family in (socket.AF_INET, socket.AF_INET6):
            nl.send(_DIAG_REQ.pack(_DIAG_REQ.size, _SOCK_DIAG_BY_FAMILY, _NLM_F_DUMP_REQUEST,
                                   1, 0, family, socket.IPPROTO_TCP, 0, 1 << _TCP_LISTEN,
                                   0, 0, bytes(16), bytes(16), 0, bytes(8)))
            done = False
            while not done:
                data = nl.recv(65536)
                off = 0
                while off + 16 <= len(data):
                    length, kind = struct.unpack_from("=IH", data, off)
                    if kind == _NLMSG_ERROR:
                        raise OSError("sock_diag refused the request")
                    if kind == _NLMSG_DONE or length < 16:
                        done = True
                        break
                    if length >= _DIAG_MSG.size:
                        msg = _DIAG_MSG.unpack_from(data, off)
                        sport, src, inode = socket.ntohs(msg[9]), msg[11], msg[19]
                        addr = src[:4] if family == socket.AF_INET else src
                        wildcard = not any(addr) or (family == socket.AF_INET6
                                                     and addr == bytes(10) + b"\xff\xff" + host)
                        if sport == port and (addr[:4] == host and family == socket.AF_INET
                                              or wildcard):
                            inodes.add(inode)
                    off += (length + 3) & ~3
    return inodes


def _listener_inodes(host: str, port: int) -> set[int]:
    """Inodes of the TCP sockets listening on ``host:port`` (or the wildcard) here."""
    try:
        packed = socket.inet_aton(host)
    except OSError:
        return set()
    try:
        return _listener_inodes_netlink(packed, port)
    except OSError:  # no sock_diag here (old kernel, seccomp): the /proc tables
        pass
    want = {packed[::-1].hex().upper(), "00000000"}
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    address, _, hexport = fields[1].partition(":")
                    if fields[3] == "0A" and int(hexport, 16) == port and (
                            address in want or address[-8:] in want or set(address) == {"0"}):
                        inodes.add(int(fields[9]))
        except OSError:
            continue
    return inodes


def serves(pid: int, host: str, port: int) -> bool:
    """Whether process ``pid`` of this host is the one listening on ``host:port``.

    Descriptors come from the network (metadata, peers): before mapping a process's memory
    on a descriptor's word, the shm transport checks that the pid it names owns the
    socket the descriptor was fetched from, so a remote peer claiming this host's
    identity cannot aim our copies at another local process.
    """
    inodes = _listener_inodes(host, port)
    if not inodes:
        return False
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and int(link[8:-1]) in inodes:
                return True
    except OSError:
        pass
    return False


def _inode(pid: int, fd: int) -> int | None:
    """The inode of the file behind a peer's fd now (None: closed, or the peer is gone)."""
    try:
        return os.stat(f"/proc/{pid}/fd/{fd}").st_ino
    except OSError:
        return None


class ShmTransport(Transport):
    """Initiator side of shm; the target does nothing but publish its descriptor."""

    name = "shm"
    priority = PRIORITY_SHM
    memory_kinds = frozenset({HOST})
    ATTEMPTS = 4  # copies repeated because the target's regions changed under them

    def __init__(self) -> None:
        self._host_id = host_id()
        self._maps: dict[tuple[int, int], _Mapping] = {}
        self._epochs: dict[tuple[int, int], _Mapping] = {}
        self._verified: dict[tuple[int, str, int], bool] = {}
        self._lock = threading.Lock()

    def supports(self, peer: Peer) -> bool:
        """Same host, and the process the descriptor names really serves that segment.

        The check runs once per (pid, host, port): the descriptor is fetched afresh from
        the segment's own port, whose listening socket must belong to that pid. Later
        refreshes come from the same port.
        """
        desc = peer.descriptor
        if desc.host_id != self._host_id:
            return False
        key = (desc.pid, desc.host, desc.port)
        with self._lock:
            known = self._verified.get(key)
        if known is None:
            try:
                fresh = peer.refresh()
            except MooncakeError:
                return False  # unreachable now: not cached, tried again next time
            known = (fresh.pid, fresh.host, fresh.port) == key and (
                fresh.pid == os.getpid() or serves(fresh.pid, fresh.host, fresh.port))
            if not known:
                log.warning("segment %r claims pid %d on this host, which does not serve "
                            "%s:%d: shm disabled for it", desc.name, desc.pid, desc.host, desc.port)
            with self._lock:
                self._verified[key] = known
        return known

    def _epoch_page(self, pid: int, fd: int) -> _Mapping:
        with self._lock:
            page = self._epochs.get((pid, fd))
            if page is None:
                page = self._epochs[(pid, fd)] = _Mapping(pid, fd, mmap.PAGESIZE, writable=False)
            return page

    def _acquire_map(self, desc: Any, region: RegionInfo) -> _Mapping:
        """The mapping of ``region``'s memfd, checked to be the same file at ``desc.epoch``."""
        key = (desc.pid, region.memfd)
        with self._lock:
            m = self._maps.get(key)
            if m is not None and m.checked_epoch != desc.epoch:
                if m.nbytes == region.nbytes and _inode(desc.pid, region.memfd) == m.inode:
                    m.checked_epoch = desc.epoch
                else:  # freed, and maybe reallocated under the same fd: a different file
                    self._retire(self._maps.pop(key))
                    m = None
            if m is None:
                m = self._maps[key] = _Mapping(desc.pid, region.memfd, region.nbytes)
                m.checked_epoch = desc.epoch
            m.users += 1
            return m

    def _release_maps(self, maps: list[_Mapping]) -> None:
        with self._lock:
            for m in maps:
                m.users -= 1
                if m.retired and m.users == 0:
                    m.close()

    @staticmethod
    def _retire(m: _Mapping) -> None:
        """Close ``m`` now, or when its last user lets go (caller holds ``_lock``)."""
        m.retired = True
        if m.users == 0:
            m.close()

    def _epoch_now(self, desc: Any) -> int:
        try:
            return EPOCH.unpack_from(self._epoch_page(desc.pid, desc.epoch_memfd).map, 0)[0]
        except OSError as exc:
            raise TransferError(f"segment {desc.name!r} (pid {desc.pid}) is gone: {exc}") from exc

    def execute(self, peer: Peer, op: int, local_address: int, remote_address: int,
                nbytes: int) -> None:
        self.execute_many(peer, [(0, op, local_address, remote_address, nbytes)])

    def execute_many(self, peer: Peer, slices: list[tuple[int, int, int, int, int]]) -> None:
        """Check every slice against the live descriptor, then copy them all in one call."""
        desc = peer.descriptor
        if desc.pid == os.getpid():
            self._copy_in_process(desc, slices)
            return
        if desc.epoch_memfd < 0:
            raise TransferError(f"segment {desc.name!r} publishes no epoch page: shm cannot "
                                f"tell when its regions change")
        self.seqlocked(peer, desc, lambda d: self._copy(d, slices), self._unchanged)

    def seqlocked(self, peer: Peer, desc: Any, copy_once: Callable[[Any], Any],
                  unchanged: Callable[[Peer, Any], bool]) -> None:
        """Run ``copy_once(descriptor)`` under the peer's epoch (a seqlock): done when the
        epoch stayed put around it, or when ``unchanged(peer, what it returned)`` finds the
        regions it used still the same registrations; else repeated against a fresh
        descriptor, at most ``ATTEMPTS`` times. The cuda_ipc transport runs its copies
        under the same rule."""
        for _ in range(self.ATTEMPTS):
            before = self._epoch_now(desc)
            if before != desc.epoch:
                desc = peer.refresh()
            used = copy_once(desc)
            if self._epoch_now(desc) == before or unchanged(peer, used):
                return
        raise TransferError(f"segment {desc.name!r} kept changing its regions during the copy "
                            f"({self.ATTEMPTS} attempts)")

    def _copy(self, desc: Any, slices: list[tuple[int, int, int, int, int]]) -> list[_Mapping]:
        """Copy the slices once; returns the memfd mappings used (to re-check afterwards)."""
        copies: list[tuple[int, int, int]] = []
        vm: tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]] = ([], [])  # read, write
        maps: dict[int, _Mapping] = {}  # memfd -> its mapping here
        try:
            for _, op, local, remote, n in slices:
                write = op == OP_WRITE
                region = desc.find(remote, n, write)
                if region.memfd < 0:  # process_vm: batched, up to 1024 per system call
                    vm[write].append((local, remote, n))
                    continue
                m = maps.get(region.memfd)
                if m is None:
                    m = maps[region.memfd] = self._acquire_map(desc, region)
                peer_address = m.address + (remote - region.address)
                m.populate(remote - region.address, n, write)
                copies.append((peer_address, local, n) if write else (local, peer_address, n))
            memory.copy_many(copies)
            for write, batch in enumerate(vm):
                impl.vm_copy_many(desc.pid, batch, bool(write))
        finally:
            self._release_maps(list(maps.values()))
        return list(maps.values())

    def _unchanged(self, peer: Peer, touched: list[_Mapping]) -> bool:
        """After an epoch change: is every memfd we copied through still the peer's file?"""
        desc = peer.refresh()
        live = {r.memfd: r for r in desc.regions if r.memfd >= 0}
        for m in touched:
            region = live.get(m.fd)
            if region is None or region.nbytes != m.nbytes or _inode(desc.pid, m.fd) != m.inode:
                return False
        return True

    @staticmethod
    def _copy_in_process(desc: Any, slices: list[tuple[int, int, int, int, int]]) -> None:
        """Copy to an engine of this process, holding its regions like its tcp server does."""
        table = local_table(desc.port)
        if table is None:
            raise TransferError(f"segment {desc.name!r} in this process is closed")
        held = table.acquire_many([(s[3], s[4]) for s in slices], remote=True)
        try:
            copies = []
            for (_, op, local, remote, n), region in zip(slices, held):
                if op == OP_WRITE:
                    if region.readonly:
                        raise AddressError(f"segment {desc.name!r} registered "
                                           f"0x{region.address:x} read-only")
                    copies.append((remote, local, n))
                else:
                    copies.append((local, remote, n))
            memory.copy_many(copies)
        finally:
            table.release_many(held)

    def forget(self, peer: Peer) -> None:
        pid = peer.descriptor.pid
        with self._lock:
            for key in [k for k in self._verified if k[0] == pid]:
                del self._verified[key]
            for key in [k for k in self._maps if k[0] == pid]:
                self._retire(self._maps.pop(key))
            pages = [self._epochs.pop(k) for k in list(self._epochs) if k[0] == pid]
        for page in pages:
            page.close()

    def close(self) -> None:
        with self._lock:
            for m in self._maps.values():
                self._retire(m)
            self._maps.clear()
            pages = list(self._epochs.values())
            self._epochs.clear()
        for page in pages:
            page.close()
