"""The cuda_ipc transport: GPU memory of a peer on the same host, through CUDA IPC.

A peer's GPU region is published with the CUDA IPC handle of its allocation and a
generation (``RegionInfo.ipc``, ``RegionInfo.generation``). The initiator opens each
handle once (:class:`~..cuda.IpcCache`, keyed by peer, pid, allocation base and
generation) and copies with ``cuMemcpyAsync`` on a stream of its worker thread, device to
device or host to device (one side may be host memory: ours, or a peer's memfd buffer,
mapped as the shm transport maps it), synchronising once per batch. A peer in this very
process is copied directly (CUDA cannot open a handle in the process that exported it),
holding its regions as its tcp server would.

Lifetimes follow the shm transport's rules: a copy reads the peer's epoch page before and
after; a changed epoch means its regions changed, and the descriptor is fetched again.
A mapping whose (base, generation) the fresh descriptor no longer publishes is closed (once
no copy uses it), so memory registered again at the same address is opened afresh and
never reached through the old mapping; a batch that ran while the regions changed is
repeated or, after a few tries, fails. ``forget`` (the peer freed, unregistered or went
away: the engine's ``close_segment``) closes every handle of the peer; a new pid (a
restart) is a new peer key.

Reaches: peers of this host whose pid really serves their segment (the shm transport's
check); moves: slices with GPU memory on at least one side (host to host stays with
shm/tcp). Building it where CUDA does not work is ``TransportUnavailable`` with the
reason.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ...errors import AddressError, MooncakeError, TransferError, TransportUnavailable
from .. import cuda
from ..peer import Peer
from ..same_host import local_table
from ..segment import CUDA, HOST, RegionInfo, kind_of_location
from .base import OP_WRITE, PRIORITY_CUDA_IPC, Transport
from .shm import ShmTransport

log = logging.getLogger(__name__)


class CudaIpcTransport(Transport):
    """Initiator side of cuda_ipc; the target only publishes its handles."""

    name = "cuda_ipc"
    priority = PRIORITY_CUDA_IPC
    memory_kinds = frozenset({CUDA, HOST})
    task_nbytes = 64 << 20  # one batch per stream synchronisation

    def __init__(self) -> None:
        if not cuda.available():
            raise TransportUnavailable(f"transport 'cuda_ipc' is unavailable here: "
                                       f"{cuda.why_unavailable()}")
        self._host = ShmTransport()  # same-host check, epoch pages, peers' memfd mappings
        self._cache = cuda.IpcCache()
        self._own_pid = os.getpid()
        self._local = threading.local()
        self._streams: list[cuda.Stream] = []
        self._lock = threading.Lock()
        self._seen: dict[str, Any] = {}  # peer key -> the descriptor last checked
        self._closed = False

    def moves(self, local_kind: str, remote_kind: str) -> bool:
        """GPU memory on at least one side (host to host is shm's and tcp's)."""
        return CUDA in (local_kind, remote_kind) and local_kind in self.memory_kinds \
            and remote_kind in self.memory_kinds

    def supports(self, peer: Peer) -> bool:
        """Same host (same host id), and the pid the descriptor names serves the segment."""
        return self._host.supports(peer)

    # -- streams -------------------------------------------------------------------------
    def _stream(self, device: int) -> cuda.Stream:
        """This worker thread's stream on ``device`` (made on first use)."""
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        stream = streams.get(device)
        if stream is None:
            stream = streams[device] = cuda.Stream(device)
            with self._lock:
                self._streams.append(stream)
        return stream

    @staticmethod
    def _device_of(address: int) -> int:
        info = cuda.pointer_info(address)
        return info.device if info.kind == CUDA and info.device >= 0 else 0

    def _run(self, copies: list[tuple[int, int, int, int]]) -> None:
        """Queue ``(dst, src, nbytes, device)`` copies on this thread's streams; wait once."""
        used: dict[int, cuda.Stream] = {}
        for dst, src, n, device in copies:
            stream = used.get(device)
            if stream is None:
                stream = used[device] = self._stream(device)
            cuda.copy_async(dst, src, n, stream)
        for stream in used.values():
            stream.synchronize()

    # -- slices --------------------------------------------------------------------------
    def execute(self, peer: Peer, op: int, local_address: int, remote_address: int,
                nbytes: int) -> None:
        self.execute_many(peer, [(0, op, local_address, remote_address, nbytes)])

    def execute_many(self, peer: Peer, slices: list[tuple[int, int, int, int, int]]) -> None:
        """Check every slice against the live descriptor, queue all copies, wait once."""
        if self._closed:
            raise TransferError("the cuda_ipc transport is closed")
        desc = peer.descriptor
        if desc.pid == self._own_pid:
            self._copy_in_process(desc, slices)
            return
        if desc.epoch_memfd < 0:
            raise TransferError(f"segment {desc.name!r} publishes no epoch page: cuda_ipc "
                                f"cannot tell when its regions change")
        def copy_once(desc: Any) -> set[tuple[int, int]]:
            self._drop_stale(peer, desc)
            return self._copy(peer, desc, slices)

        def unchanged(peer: Peer, used: set[tuple[int, int]]) -> bool:
            fresh = peer.refresh()  # changed meanwhile: were ours the same registrations?
            self._drop_stale(peer, fresh)
            return used <= {(r.address, r.generation) for r in fresh.regions}

        self._host.seqlocked(peer, desc, copy_once, unchanged)

    @staticmethod
    def _key(desc: Any) -> str:
        return f"{desc.name}@{desc.pid}"

    def _drop_stale(self, peer: Peer, desc: Any) -> None:
        """Close mappings ``desc`` no longer publishes (freed, unregistered, registered
        again: a new generation), and every mapping of an earlier pid of the peer."""
        key = self._key(desc)
        if self._seen.get(key) is desc:
            return
        keep = {(r.ipc.base, r.generation) for r in desc.regions if r.ipc is not None}
        self._cache.forget(key, keep)
        for other in self._cache.peers():
            if other != key and other.rpartition("@")[0] == desc.name:
                self._cache.forget(other)  # the peer restarted: its old pid's handles
        with self._lock:
            self._seen = {k: v for k, v in self._seen.items()
                          if k.rpartition("@")[0] != desc.name}
            self._seen[key] = desc

    def _copy(self, peer: Peer, desc: Any, slices: list[tuple[int, int, int, int, int]]
              ) -> set[tuple[int, int]]:
        """Copy the slices once; returns the (address, generation) of the regions used."""
        key = self._key(desc)
        gpu: dict[tuple[int, int], Any] = {}  # (base, generation) -> IPC mapping here
        host: dict[int, Any] = {}  # memfd -> the shm transport's mapping of it
        used: set[tuple[int, int]] = set()
        copies: list[tuple[int, int, int, int]] = []
        try:
            for _, op, local, remote, n in slices:
                write = op == OP_WRITE
                region = desc.find(remote, n, write)
                used.add((region.address, region.generation))
                if kind_of_location(region.location) == CUDA:
                    mapping = self._open(key, desc, region, gpu)
                    peer_address = mapping.address + (remote - mapping_base(region))
                    device = mapping.device
                else:
                    peer_address = self._host_address(desc, region, remote, n, write, host)
                    device = self._device_of(local)
                copies.append((peer_address, local, n, device) if write
                              else (local, peer_address, n, device))
            self._run(copies)
        finally:
            self._cache.release(gpu.values())
            self._host._release_maps(list(host.values()))
        return used

    def _open(self, key: str, desc: Any, region: RegionInfo, gpu: dict) -> Any:
        if region.ipc is None:
            raise TransferError(f"segment {desc.name!r} registered GPU memory 0x"
                                f"{region.address:x} without a CUDA IPC handle (not from "
                                f"cudaMalloc, e.g. expandable_segments): cuda_ipc cannot "
                                f"reach it")
        tag = (region.ipc.base, region.generation)
        mapping = gpu.get(tag)
        if mapping is None:
            mapping = gpu[tag] = self._cache.acquire(key, region.ipc, tag=region.generation)
        return mapping

    def _host_address(self, desc: Any, region: RegionInfo, remote: int, n: int, write: bool,
                      host: dict) -> int:
        """Our address of a peer's host memory: only memfd buffers (``allocate``) can be
        mapped; other host memory of another process is no address here."""
        if region.memfd < 0:
            raise TransferError(f"segment {desc.name!r} registered host memory 0x"
                                f"{region.address:x} without a memfd: cuda_ipc reaches a "
                                f"peer's host memory only in buffers from allocate()")
        m = host.get(region.memfd)
        if m is None:
            m = host[region.memfd] = self._host._acquire_map(desc, region)
        return m.address + (remote - region.address)

    def _copy_in_process(self, desc: Any, slices: list[tuple[int, int, int, int, int]]) -> None:
        """Copy to an engine of this process directly (one address space), holding its
        regions like its tcp server does."""
        table = local_table(desc.port)
        if table is None:
            raise TransferError(f"segment {desc.name!r} in this process is closed")
        held = table.acquire_many([(s[3], s[4]) for s in slices], remote=True, device=True)
        try:
            copies = []
            for (_, op, local, remote, n), region in zip(slices, held):
                if region.device:
                    device = int(region.info.location.partition(":")[2] or 0)
                else:
                    device = self._device_of(local)
                if op == OP_WRITE:
                    if region.readonly:
                        raise AddressError(f"segment {desc.name!r} registered "
                                           f"0x{region.address:x} read-only")
                    copies.append((remote, local, n, device))
                else:
                    copies.append((local, remote, n, device))
            self._run(copies)
        finally:
            table.release_many(held)

    def forget(self, peer: Peer) -> None:
        """Close every handle of ``peer`` (any pid) and its shm mappings."""
        name = peer.descriptor.name
        for key in self._cache.peers():
            if key.rpartition("@")[0] == name:
                self._cache.forget(key)
        with self._lock:
            self._seen = {k: v for k, v in self._seen.items() if k.rpartition("@")[0] != name}
        self._host.forget(peer)

    def close(self) -> None:
        self._closed = True
        self._cache.close()
        self._host.close()
        with self._lock:
            streams, self._streams = self._streams, []
        for stream in streams:
            try:
                stream.close()
            except MooncakeError as exc:  # the driver is gone at exit: nothing to free
                log.debug("closing a cuda_ipc stream failed: %s", exc)


def mapping_base(region: RegionInfo) -> int:
    """The allocation base the peer's IPC handle maps (what the mapping's address is)."""
    assert region.ipc is not None
    return region.ipc.base
