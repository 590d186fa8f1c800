"""TransferEngine: registered memory, segments, batches, and the choice of transport per peer.

Transports are built from ``EngineConfig.transports`` through the transport registry
(``transports/registry.py``) and chosen per slice by what each declares: the peers it
reaches (``supports``), the memory kinds it moves (``memory_kinds``/``moves``, from the
``location`` of the local region and of the peer's published region) and its rank
(``priority``), best first; see :meth:`TransferEngine._paths`. This module imports no
transport class for data. The target side every engine serves whatever its own transports
has modules of its own: the rpc port (``rpc_server.py``: tcp data and control messages),
and what same-host peers read (``same_host.py``: memfds, the epoch page, the in-process
table).

Thread model: public methods may be called from any thread. Slices run on the engine's
worker pool; the tcp server has its own threads. Lock order: ``TransferEngine._lock``
before ``Peer._lock``; RegionTable and Batch locks are leaves.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import mmap
import os
import socket
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import msgpack

from ..config import DEFAULT_TRANSPORTS, EngineConfig
from ..errors import (AddressError, InvalidArgument, MetadataError, MooncakeError, RegionBusy,
                      SegmentNotFound, TransferError, TransferTimeout, TransportUnavailable)
from . import cuda, memory, protocol
from .batch import Batch, OpCode, TransferRequest, validate_range, validate_request
from .metadata import MetadataStore, from_url
from .peer import Peer
from .rpc_server import TcpServer
from .same_host import EPOCH, memfd_create, publish_local
from .segment import (CUDA, HOST, Region, RegionInfo, RegionTable, SegmentDescriptor, check_range,
                      kind_of_location)
from .topology import host_id
from .transports import registry
from .transports.base import HOST_KINDS, OP_READ, OP_WRITE, Transport
from .transports.staging import Staged  # local GPU memory over host-only transports

log = logging.getLogger(__name__)

METADATA_PREFIX = "mooncake/segments/"
DESCRIPTOR_TTL_S = 10.0
"""A published descriptor outlives its engine by at most this long (renewed every third)."""
P2P = "P2PHANDSHAKE"
_HOST_ONLY = frozenset({HOST})
_GENERATIONS = itertools.count(1)
"""Generations of GPU registrations (process-wide: a peer keys its mappings by our pid too)."""
MAX_PENDING_NOTIFIES = 65536
"""Notifications kept until ``take_notifies``; a peer sending more is refused (bounded memory)."""


@dataclass(eq=False)
class ManagedBuffer:
    """Memory allocated (memfd-backed) and registered by the engine; same-host peers map it."""

    address: int
    nbytes: int
    region: Region

    def view(self) -> memoryview:
        """A writable memoryview of the whole buffer.

        The view keeps the memory mapped: after ``free`` it still reads and writes the old
        pages (which no peer reaches any more), and the pages go with the last view.

        Raises:
            BufferError: the buffer was freed.
        """
        return memory.view_of(self.region.keepalive, self.address, self.nbytes)


_PREFAULT_CHUNK = 8 << 20


class _Memfd:
    """An anonymous shared-memory file mapped in this process.

    Its pages are faulted in ahead of use: up to one chunk at once, the rest by a background
    thread, chunk by chunk (``close`` stops it). Creating a 64 GiB segment returns at once,
    and the first writes, this process's or a peer's, find the pages already there instead
    of paying for zeroing them.
    """

    def __init__(self, name: str, nbytes: int) -> None:
        self.fd = memfd_create(name)
        try:
            os.ftruncate(self.fd, nbytes)
            # No fallocate or MAP_POPULATE here: they would make the caller wait for every
            # page (seconds for a large segment). A memfd lives on the kernel's internal
            # tmpfs, which has no size limit of its own, so reserving pages up front would
            # only move an out-of-memory earlier.
            self.map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(self.fd)
            raise MemoryError(f"cannot reserve {nbytes} bytes of shared memory ({exc}); "
                              f"free memory or lower the segment size") from exc
        self.export = memory.Export(self.map, True)
        self._stop_prefault = threading.Event()
        self._prefault_thread: threading.Thread | None = None
        if nbytes <= _PREFAULT_CHUNK:
            self._prefault(0, nbytes)
        else:
            self._prefault_thread = threading.Thread(
                target=self._prefault_all, args=(nbytes,), name=f"mc-prefault-{self.fd}",
                daemon=True)
            self._prefault_thread.start()

    def _prefault(self, offset: int, nbytes: int) -> bool:
        """Fault ``nbytes`` at ``offset`` in, writable (contents untouched); False if the
        kernel cannot: too old (EINVAL, silently), or out of memory (logged: those pages
        then fault on first use, where an out-of-memory kill may hit whoever writes)."""
        err = memory.populate(self.export.address + offset, nbytes, write=True)
        if err == 0:
            return True
        if err != errno.EINVAL:
            log.warning("shared memory of %d bytes could not be prefaulted past offset %d "
                        "(%s): the host may not have the memory this segment promises",
                        self.map.size(), offset, os.strerror(err))
        return False

    def _prefault_all(self, nbytes: int) -> None:
        try:  # lowest priority: real copies on a busy host come first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        for offset in range(0, nbytes, _PREFAULT_CHUNK):
            if self._stop_prefault.is_set() or \
                    not self._prefault(offset, min(_PREFAULT_CHUNK, nbytes - offset)):
                return

    def close(self) -> None:
        """Unmap, or leave the mapping to the last user view of it (see ManagedBuffer.view)."""
        self._stop_prefault.set()
        if self._prefault_thread is not None:
            self._prefault_thread.join()  # at most one chunk's madvise away
        self.export.release()
        try:
            self.map.close()
        except BufferError:
            pass  # views are alive: the mmap unmaps itself when the last one is released
        os.close(self.fd)


def _split_hostname(local_hostname: str) -> tuple[str, int]:
    host, sep, port = local_hostname.rpartition(":")
    if not sep:
        return local_hostname, 0
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidArgument(f"bad port in local_hostname {local_hostname!r}")
    return host.strip("[]"), int(port)


def _rdma_alone(exc: TransportUnavailable) -> str:
    """The sentence for an engine configured with rdma alone where rdma is unusable."""
    reason = str(exc)
    if not reason.startswith("no RDMA device"):
        reason = f"no RDMA device: {reason}"
    return (f"{reason} (rdma is the only transport configured, MC_TRANSPORTS=rdma: add tcp "
            f"to fall back to it)")


class TransferEngine:
    """Moves bytes between this process's registered memory and other segments.

    Args:
        local_hostname: ``host`` or ``host:port`` to serve this segment on (port 0/absent
            picks a free one).
        metadata_server: ``P2PHANDSHAKE`` (default, no server), ``http://h:p/metadata``,
            ``etcd://h:p`` or ``redis://h:p``.
        config: tunables (default: :meth:`EngineConfig.from_env`).
        segment_name: name to publish under (default: ``host:port`` of the rpc server,
            which is what peers must use in P2PHANDSHAKE mode).

    Raises:
        InvalidArgument, MetadataError, OSError (port in use), TransportUnavailable (rdma
        is the only configured transport and is unusable here: "no RDMA device: ...").
    """

    def __init__(self, local_hostname: str = "127.0.0.1", metadata_server: str = P2P, *,
                 config: EngineConfig | None = None, segment_name: str | None = None) -> None:
        self.config = config or EngineConfig.from_env()
        self.config.validate()
        host, port = _split_hostname(local_hostname)
        bind_host = socket.gethostbyname(host) if host else "0.0.0.0"
        self._metadata: MetadataStore | None = None
        self._regions = RegionTable()
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}
        self._managed: dict[int, tuple[ManagedBuffer, _Memfd]] = {}
        self._notifies: list[tuple[str, str]] = []
        self._batch_ids = itertools.count(1)
        self._transports: list[Transport] = []
        self._closed = True  # until started: a failed start leaves nothing behind
        try:
            self._start(metadata_server, bind_host, host, port, local_hostname, segment_name)
        except BaseException:
            self._stop_serving(unpublish=False)
            if hasattr(self, "_epoch"):
                self._epoch.close()
            raise
        self._closed = False
        log.info("engine %s serving on %s:%d (transports %s, %s data path)", self.segment_name,
                 self.host, self.rpc_port, [t.name for t in self._transports], memory.IMPLEMENTATION)

    def _start(self, metadata_server: str, bind_host: str, host: str, port: int,
               local_hostname: str, segment_name: str | None) -> None:
        self._metadata = from_url(metadata_server)
        self._epoch = _Memfd("mooncake-epoch", mmap.PAGESIZE)
        self._server = TcpServer(bind_host, port, self._regions, self._on_control)
        self.host = bind_host if bind_host != "0.0.0.0" else socket.gethostbyname(socket.gethostname())
        self.rpc_port = self._server.port
        # tcp multi-path: the same rpc port on each further address of this host
        self.paths = tuple(a for a in dict.fromkeys(self.config.tcp_paths) if a != self.host)
        self._servers = [self._server]
        for address in self.paths if bind_host != "0.0.0.0" else ():
            self._servers.append(TcpServer(address, self.rpc_port, self._regions,
                                           self._on_control))
        if segment_name is None:
            segment_name = f"{self.host}:{self.rpc_port}" if self._metadata is None or not host \
                or port == 0 else local_hostname
        self.segment_name = segment_name
        # the control client (describe, notify to peers' rpc ports); it moves data only
        # when its transport is also in config.transports
        self._control = registry.build_transport(registry.CONTROL, self.config)
        # the default list, or the original API's "tcp" form of it (apply_protocol)
        implicit = list(self.config.transports) in (
            list(DEFAULT_TRANSPORTS), [t for t in DEFAULT_TRANSPORTS if t != "rdma"])
        named = list(dict.fromkeys(self.config.transports))
        for name in named:
            if name == registry.CONTROL:
                self._transports.append(self._control)
                continue
            if implicit and name in registry.OPT_IN and not cuda.driver_in_process():
                # by default, never the one to load (and initialise) CUDA in a process
                # that does not use it: a fork after that would leave children without it
                log.debug("transport %s off: no CUDA driver is loaded in this process "
                          "(name it in MC_TRANSPORTS to load one)", name)
                continue
            try:
                self._transports.append(registry.build_transport(name, self.config))
            except TransportUnavailable as exc:
                if named == ["rdma"]:  # without it, this engine could reach no peer
                    raise TransportUnavailable(_rdma_alone(exc)) from exc
                (log.debug if implicit and name in registry.QUIET else log.warning)(
                    "transport %s disabled: %s", name, exc)
        self._transports = registry.rank(self._transports)  # best first: see _paths
        for t in self._transports:
            t.attach(self._control, segment_name)
        # transports that publish something (rdma: its NICs) also key every registration
        self._keyed = [t for t in self._transports if t.published()]
        # local GPU memory over the host-only ones, through pinned memory: offered for
        # slices from GPU memory where a CUDA driver is loaded, after every direct path
        # (see _moving; a host-memory slice never pays for the check)
        self._staged = [Staged(t) for t in self._transports if CUDA not in t.memory_kinds]
        self._pool = ThreadPoolExecutor(self.config.workers, thread_name_prefix="mc-worker")
        publish_local(self.rpc_port, self._regions)
        self._publish()

    def _stop_serving(self, unpublish: bool) -> None:
        """Stop the server, workers and transports, as far as ``_start`` got (and, when
        ``unpublish``, delete our descriptor: a failed start published none to delete)."""
        if self._metadata is not None:
            if unpublish:
                try:
                    self._metadata.delete(METADATA_PREFIX + self.segment_name)
                except MetadataError as exc:
                    log.warning("could not unpublish %s: %s", self.segment_name, exc)
            self._metadata.close()
        if hasattr(self, "rpc_port"):
            publish_local(self.rpc_port, None)
        for server in getattr(self, "_servers", [getattr(self, "_server", None)]):
            if server is not None:
                server.close()
        if hasattr(self, "_pool"):
            self._pool.shutdown(wait=True)
        for t in getattr(self, "_staged", ()):
            t.close()  # their pinned buffers (the transports they wrap are closed next)
        for t in {id(t): t for t in [*self._transports, getattr(self, "_control", None)] if t}.values():
            t.close()  # the control client is closed even when it moves no data

    # -- registration ----------------------------------------------------------------
    def register(self, buffer: Any, location: str = "*", private: bool = False) -> Region:
        """Register a buffer object (bytearray, numpy array, mmap, CPU or CUDA tensor,
        bytes read-only).

        The object is kept alive, and cannot be resized, until ``unregister``. A
        ``private`` region is only usable as the local side of our own transfers: it is not
        published (cheap to add and remove) and peers cannot touch it. A CUDA tensor is
        registered as ``cuda:N`` (see :meth:`register_address`); where CUDA does not
        work, it is an InvalidArgument saying why.
        """
        if callable(getattr(buffer, "data_ptr", None)):
            address, nbytes = memory.address_of(buffer, allow_cuda=True)
            if location in ("*", "", None):
                location = memory.tensor_location(buffer)
            return self._add(address, nbytes, location, keepalive=buffer, private=private)
        try:
            exp = memory.Export(buffer, False)
        except (TypeError, BufferError) as exc:
            raise InvalidArgument(f"cannot register {type(buffer).__name__}: {exc}") from exc
        try:
            return self._add(exp.address, exp.nbytes, location, readonly=bool(exp.readonly),
                             keepalive=exp, private=private)
        except BaseException:
            exp.release()
            raise

    def register_address(self, address: int, nbytes: int, location: str = "*",
                         private: bool = False) -> Region:
        """Register raw memory; the caller keeps it valid until ``unregister``.

        ``location`` as the original's ``register_memory``: ``"*"`` (found from the
        pointer: ``"cpu"`` or ``"cuda:N"``), ``"cpu"``, ``"cpu:N"`` or ``"cuda:N"``. Host
        memory is taken at the caller's word (no probe); GPU memory must lie in one CUDA
        allocation and is published with that allocation's IPC handle, for same-host
        peers (the cuda_ipc transport). The bounds and overlap rules are host memory's.
        """
        return self._add(address, nbytes, location, private=private)

    def _add(self, address: int, nbytes: int, location: Any, readonly: bool = False,
             keepalive: Any = None, private: bool = False) -> Region:
        if self._closed:
            self._check_open()
        if location == "*" and not cuda.driver_in_process():
            location = "cpu"  # host memory's fast path: no GPU memory can exist here
        else:
            location = memory.registration_location(address, nbytes, location)
        if location[:4] == "cuda":
            info = self._cuda_region(address, nbytes, location, readonly)
        else:
            info = RegionInfo(address, nbytes, location, readonly=readonly)
        region = self._regions.add(Region(info, keepalive=keepalive, private=private))
        self._key(region)
        if not private:
            self._changed()
        return region

    def _key(self, region: Region) -> None:
        """Register a region just added with the transports that key registrations (before
        it is published); on failure it is removed again."""
        try:
            for t in self._keyed:
                keys = t.register_region(region.address, region.nbytes, region.info.location,
                                         region.readonly, region.private)
                if keys:
                    region.info = dataclasses.replace(region.info, rkeys=keys)
        except BaseException:
            self._unkey(region.address)
            self._regions.remove(region.address, 0)
            raise

    def _unkey(self, address: int) -> None:
        """After a region is unpublished, before its memory goes: its keys stop working."""
        for t in self._keyed:
            t.unregister_region(address)

    def _cuda_region(self, address: int, nbytes: int, location: str,
                     readonly: bool) -> RegionInfo:
        """A GPU region's info: a fresh generation, and its allocation's IPC handle when
        CUDA can export one (else None: only this process's own transfers reach it)."""
        check_range(address, nbytes)
        ipc = None
        try:
            if cuda.driver_in_process() and cuda.available():  # else: the caller's word
                ipc = cuda.export_ipc(address)
        except cuda.CudaError as exc:
            log.info("GPU memory 0x%x+%d has no CUDA IPC handle (%s): peers of this host "
                     "cannot reach it", address, nbytes, exc)
        return RegionInfo(address, nbytes, location, readonly=readonly,
                          generation=next(_GENERATIONS), ipc=ipc)

    def unregister(self, address: int | Region, wait_s: float = 1.0) -> None:
        """Unregister the region starting at ``address``.

        Transfers using it get ``wait_s`` seconds to end; RegionBusy after that.
        """
        self._check_open()
        addr = address.address if isinstance(address, Region) else address
        with self._lock:
            if addr in self._managed:
                raise InvalidArgument(f"0x{addr:x} is a managed buffer: use free()")
        region = self._regions.remove(addr, wait_s)
        if not region.private:
            self._changed()  # peers learn first; the memory is let go last
        self._unkey(addr)
        if hasattr(region.keepalive, "release"):
            region.keepalive.release()

    def allocate(self, nbytes: int, location: str = "*") -> ManagedBuffer:
        """Allocate and register ``nbytes`` of memfd-backed memory (shm peers map it directly)."""
        self._check_open()
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgument(f"nbytes must be a positive int, got {nbytes!r}")
        if location in ("*", "", None):
            location = "cpu"
        elif not (location == "cpu" or location[:4] == "cpu:" and location[4:].isdigit()):
            raise InvalidArgument(f"allocate makes host memory: location {location!r} must be "
                                  f"'*', 'cpu' or 'cpu:N' (register GPU memory a framework "
                                  f"allocated instead)")
        mf = _Memfd("mooncake-buffer", nbytes)
        try:
            region = self._regions.add(Region(RegionInfo(mf.export.address, nbytes, location, mf.fd),
                                              keepalive=mf.export))
            self._key(region)
        except BaseException:
            mf.close()
            raise
        buf = ManagedBuffer(mf.export.address, nbytes, region)
        with self._lock:
            self._managed[buf.address] = (buf, mf)
        self._changed()
        return buf

    def free(self, address: int | ManagedBuffer, wait_s: float = 1.0) -> None:
        """Unregister and release a buffer from :meth:`allocate` (see ``unregister``)."""
        self._check_open()
        addr = address.address if isinstance(address, ManagedBuffer) else address
        with self._lock:
            if addr not in self._managed:
                raise InvalidArgument(f"0x{addr:x} was not allocated by this engine")
        self._regions.remove(addr, wait_s)  # waits for in-flight slices, not under our lock
        with self._lock:
            _, mf = self._managed.pop(addr)
        self._changed()  # peers learn first; the memory is let go last
        self._unkey(addr)
        mf.close()

    def is_registered(self, address: int, nbytes: int) -> bool:
        """Whether ``[address, address+nbytes)`` lies in one local region (private ones too)."""
        try:
            self._regions.find(address, nbytes)
            return True
        except AddressError:
            return False

    def local_view(self, address: int, nbytes: int) -> memoryview:
        """A memoryview of locally registered memory (read-only for read-only regions).

        The view keeps the memory valid while it lives: ``unregister``/``free`` succeed, and
        the registration's hold on the buffer (or the mapping) is let go with the last view.
        Memory from ``register_address`` is the caller's to keep valid, as registered.

        Raises:
            AddressError: the range is not inside one registered region.
        """
        region = self._regions.find(address, nbytes)
        if region.device and not memory.is_export(region.keepalive):  # a buffer is the CPU's
            raise InvalidArgument(f"0x{address:x} is GPU memory ({region.info.location}): "
                                  f"the CPU has no view of it")
        return memory.view_of(region.keepalive, address, nbytes, readonly=region.readonly)

    def regions(self) -> list[RegionInfo]:
        """The published (non-private) regions."""
        return [r.info for r in self._regions.regions(include_private=False)]

    def _changed(self) -> None:
        epoch = self._regions.epoch
        self._publish()
        EPOCH.pack_into(self._epoch.map, 0, epoch)

    def descriptor(self) -> SegmentDescriptor:
        """This engine's own descriptor, as peers see it."""
        extra: dict[str, Any] = {}
        for t in self._keyed:
            extra.update(t.published())
        return SegmentDescriptor(self.segment_name, self.host, self.rpc_port, os.getpid(),
                                 host_id(), self._regions.epoch, self._epoch.fd, self.regions(),
                                 self.paths, **extra)

    def _publish(self) -> None:
        if self._metadata is not None:
            # leased: a crashed engine's descriptor leaves the service on its own
            self._metadata.put(METADATA_PREFIX + self.segment_name,
                               msgpack.packb(self.descriptor().to_wire(), use_bin_type=True),
                               ttl_s=DESCRIPTOR_TTL_S)

    # -- control port ----------------------------------------------------------------
    def _on_control(self, msg: dict) -> bytes:
        cmd = msg["cmd"]
        if cmd == "describe":
            return msgpack.packb(self.descriptor().to_wire(), use_bin_type=True)
        if cmd == "notify":
            with self._lock:
                if len(self._notifies) >= MAX_PENDING_NOTIFIES:
                    raise TransferError(f"{len(self._notifies)} notifications are waiting to be "
                                     f"taken (take_notifies); refusing more")
                self._notifies.append((msg["name"], msg["msg"]))
            return b""
        if cmd == "drop_connection":
            return self._drop_connection(msg)
        for t in getattr(self, "_transports", ()):
            if cmd in t.control_commands:
                return t.serve_control(msg)
        if cmd != "ping":
            raise TransferError(f"this segment has no transport serving {cmd!r}")
        return b"pong"

    def _drop_connection(self, msg: dict) -> bytes:
        """A peer gave up on one of its connections to our rpc port with WRITEs on it
        unanswered, and retries them: end that connection (on whichever of our addresses
        it came in) before answering, so nothing it still carries lands after the retry.
        ``gone``: there was none (it ended already, or is dropped when accepted)."""
        src, dst = protocol.parse_endpoint(msg["src"]), protocol.parse_endpoint(msg["dst"])
        found = False
        for server in getattr(self, "_servers", ()):
            try:
                found = server.drop(src, dst, server.frame_timeout_s) or found
            except TimeoutError as exc:
                raise TransferError(str(exc)) from None
        return b"dropped" if found else b"gone"

    def notify(self, segment: str, name: str, msg: str) -> None:
        """Deliver a (name, msg) notification to ``segment`` (read there with ``take_notifies``)."""
        d = self.open_segment(segment).descriptor
        self._control.control(d.host, d.port, "notify", name=name, msg=msg)

    def take_notifies(self) -> list[tuple[str, str]]:
        """Return and clear the notifications received so far."""
        with self._lock:
            out, self._notifies = self._notifies, []
        return out

    # -- segments --------------------------------------------------------------------
    def _fetch_from_peer(self, host: str, port: int) -> SegmentDescriptor:
        try:
            raw = self._control.control(host, port, "describe")
            return SegmentDescriptor.from_wire(msgpack.unpackb(raw, raw=False))
        except TransferError as exc:
            raise SegmentNotFound(f"segment at {host}:{port} is unreachable: {exc}") from exc
        except (ValueError, msgpack.ExtraData) as exc:
            raise MetadataError(f"segment at {host}:{port} sent a bad descriptor: {exc}") from exc

    def _lookup(self, segment: str) -> SegmentDescriptor:
        if self._metadata is None:
            host, port = _split_hostname(segment)
            if not port:
                raise InvalidArgument(f"in {P2P} mode a segment is named host:port, got {segment!r}")
            return self._fetch_from_peer(host, port)
        raw = self._metadata.get(METADATA_PREFIX + segment)
        if raw is None:
            raise SegmentNotFound(f"no segment {segment!r} is published in the metadata service")
        try:
            return SegmentDescriptor.from_wire(msgpack.unpackb(raw, raw=False))
        except ValueError as exc:
            raise MetadataError(f"descriptor of {segment!r} is malformed: {exc}") from exc

    def open_segment(self, segment: str) -> Peer:
        """Resolve (and cache) a segment by name. Raises SegmentNotFound."""
        self._check_open()
        with self._lock:
            peer = self._peers.get(segment)
        if peer is None:
            peer = Peer(segment, self._lookup(segment), self._fetch_from_peer)
            with self._lock:
                peer = self._peers.setdefault(segment, peer)
        return peer

    def probe(self, segment: str) -> SegmentDescriptor:
        """Ask the segment itself for its descriptor now (a liveness check).

        Raises:
            SegmentNotFound: the segment is not published or does not answer.
        """
        return self.open_segment(segment).refresh()

    def close_segment(self, segment: str) -> None:
        """Forget a cached segment (its connections and mappings)."""
        with self._lock:
            peer = self._peers.pop(segment, None)
        if peer:
            for t in self._transports:
                t.forget(peer)

    # -- transfers -------------------------------------------------------------------
    def submit(self, segment: str, requests: Sequence[TransferRequest],
               transport: str | None = None) -> Batch:
        """Start a batch of requests to one segment and return (small batches are done by then).

        Every local range must lie in one region registered here: that is checked now.
        Remote ranges are checked when each slice runs, by the target itself over tcp and
        against its live descriptor over shm, so errors about them arrive on the batch.
        ``transport`` restricts the paths tried (e.g. "tcp").

        Raises:
            InvalidArgument, AddressError (local memory), SegmentNotFound,
            TransportUnavailable (no transport reaches the segment, or none moves the
            memory kinds of a request).
        """
        self._check_open()
        peer = self.open_segment(segment)
        reach = self._reaching(peer, transport)
        reqs = list(requests)
        step = self.config.slice_nbytes
        slices: list[tuple[int, int, int, int, int]] = []
        for r in reqs:
            validate_request(r)
        refused, remote_kinds = self._check_remote(
            peer, [(r.op, r.remote_address, r.nbytes) for r in reqs])
        for index, r in enumerate(reqs):
            if index in refused:
                continue
            op = OP_WRITE if r.op is OpCode.WRITE else OP_READ
            for off in range(0, r.nbytes, step):
                slices.append((index, op, r.local_address + off, r.remote_address + off,
                               min(step, r.nbytes - off)))
        regions = self._hold(slices)
        try:
            routes = self._routes(peer, reach, transport, slices, regions, remote_kinds)
        except BaseException:
            self._regions.release_many(regions)
            raise
        batch = Batch(next(self._batch_ids), segment, reqs)
        for s in slices:
            batch.add_slices(s[0], 1)
        for index in refused:
            batch.add_slices(index, 1)
        batch.seal()
        if refused:
            batch.slices_done(list(refused.items()))
        # one task's slices share one path list and go to one execute_many; tcp pipelines
        # them on one connection (task_nbytes), up to an equal share of the batch per worker
        share = -(-batch.nbytes // self.config.workers)
        tasks = []
        first, budget = 0, 0
        mixed = bool(routes) and routes.count(routes[0]) != len(routes)  # several kinds
        paths = routes[0] if routes else []
        group = max(step, min(paths[0].task_nbytes, share)) if paths else step
        for i, s in enumerate(slices):
            budget += s[4]
            if budget >= group or i + 1 - first >= 64 or i + 1 == len(slices) \
                    or mixed and routes[i + 1] is not paths:
                tasks.append((paths, slices[first:i + 1], regions[first:i + 1]))
                first, budget = i + 1, 0
                if mixed and i + 1 < len(slices) and routes[i + 1] is not paths:
                    paths = routes[i + 1]
                    group = max(step, min(paths[0].task_nbytes, share))
        if batch.nbytes <= self.config.inline_nbytes:
            for paths, task, held in tasks:  # small: the handoff to a worker would cost more
                self._run_task(peer, paths, batch, task, held)
        else:
            for paths, task, held in tasks:
                self._pool.submit(self._run_task, peer, paths, batch, task, held)
        return batch

    @staticmethod
    def _check_remote(peer: Peer, items: Sequence[tuple[OpCode, int, int]]
                      ) -> tuple[dict[int, MooncakeError], list[str] | None]:
        """Requests whose remote range no published region holds, by index, and the
        memory kind of every request's remote region (from its published ``location``;
        None when the segment publishes host memory only).

        Refused whole before any slice moves, so a failed request never leaves part of its
        bytes behind (the target still checks every slice itself). A range the cached
        descriptor refuses is checked again against a fresh one.
        """
        kinds: list[str] | None = None  # stays None while every region seen is host memory

        def check(desc: SegmentDescriptor, indices: Iterable[int]) -> dict[int, MooncakeError]:
            nonlocal kinds
            mixed = not peer.published_kinds(desc) <= _HOST_ONLY
            if mixed and kinds is None:
                kinds = [HOST] * len(items)
            bad: dict[int, MooncakeError] = {}
            for i in indices:
                op, remote, n = items[i]
                if n:
                    try:
                        region = desc.find(remote, n, op is OpCode.WRITE)
                    except AddressError as exc:
                        bad[i] = exc
                        continue
                    if mixed:
                        kinds[i] = kind_of_location(region.location)  # type: ignore[index]
            return bad

        bad = check(peer.descriptor, range(len(items)))
        if bad:
            try:
                bad = check(peer.refresh(), bad)
            except MooncakeError:
                pass  # unreachable: keep what the cached descriptor said
        return bad, kinds

    def _hold(self, slices: list[tuple[int, int, int, int, int]]) -> list[Region]:
        """Acquire the local region of every ``(index, op, local, remote, nbytes)`` slice.

        Raises:
            AddressError: a local range is not registered, or a READ would write into a
                read-only region (nothing stays acquired then).
        """
        regions = self._regions.acquire_many([(s[2], s[4]) for s in slices])
        if any(region.readonly and s[1] == OP_READ for s, region in zip(slices, regions)):
            self._regions.release_many(regions)
            raise AddressError("cannot READ into a region registered read-only")
        return regions

    # -- path choice -----------------------------------------------------------------
    def _paths(self, peer: Peer, transport: str | None = None,
               kinds: tuple[str, str] = HOST_KINDS) -> list[Transport]:
        """The transports that reach ``peer`` and move slices between ``kinds`` =
        ``(local memory kind, remote memory kind)``, best first (see ``_reaching``,
        ``_moving``); only ``transport`` when that names one.

        Raises:
            TransportUnavailable: none qualifies (the message says which test failed).
        """
        return self._moving(peer, self._reaching(peer, transport), transport, kinds)

    def _reaching(self, peer: Peer, transport: str | None) -> list[Transport]:
        """The configured transports that reach ``peer``, best first (they are kept ranked
        by priority), restricted to the one named ``transport`` if given."""
        paths = [t for t in self._transports if (transport in (None, "", t.name)) and t.supports(peer)]
        if not paths:
            raise TransportUnavailable(f"no transport reaches segment {peer.name!r}"
                                       + (f" with hint {transport!r}" if transport else ""))
        return paths

    def _moving(self, peer: Peer, reach: list[Transport], transport: str | None,
                kinds: tuple[str, str]) -> list[Transport]:
        """Those of ``reach`` that move ``(local kind, remote kind)`` memory, in order; for
        local GPU memory where a CUDA driver is loaded (staging copies with it), then the
        staged forms of the host-only ones in ``reach``."""
        paths = [t for t in reach if t.moves(*kinds)]
        if kinds[0] == CUDA and cuda.driver_in_process():
            paths += [s for s in self._staged if s.inner in reach and s.moves(*kinds)]
        if not paths:
            tried = ", ".join(f"{t.name} (moves {'/'.join(sorted(t.memory_kinds))})" for t in reach)
            raise TransportUnavailable(
                f"no transport moves {kinds[0]} memory here to or from {kinds[1]} memory of "
                f"segment {peer.name!r}" + (f" with hint {transport!r}" if transport else "")
                + f"; tried {tried}")
        return paths

    def _routes(self, peer: Peer, reach: list[Transport], transport: str | None,
                slices: Sequence[tuple[int, int, int, int, int]], regions: Sequence[Region],
                remote_kinds: Sequence[str] | None) -> list[list[Transport]]:
        """The paths of every slice, by the kinds of its local region (``regions``, its
        registered ``location``) and its request's remote region (``remote_kinds``, None:
        all host).
        Slices of the same kinds share one list object."""
        if not slices:
            return []
        if remote_kinds is None and all(kind_of_location(location) == HOST for location
                                        in {region.info.location for region in regions}):
            return [self._moving(peer, reach, transport, HOST_KINDS)] * len(slices)
        by_kinds: dict[tuple[str, str], list[Transport]] = {}
        out: list[list[Transport]] = []
        for s, region in zip(slices, regions):
            kinds = (kind_of_location(region.info.location),
                     HOST if remote_kinds is None else remote_kinds[s[0]])
            paths = by_kinds.get(kinds)
            if paths is None:
                paths = by_kinds[kinds] = self._moving(peer, reach, transport, kinds)
            out.append(paths)
        return out

    def _run_task(self, peer: Peer, paths: list[Transport], batch: Batch,
                  task: list[tuple[int, int, int, int, int]], held: list[Region]) -> None:
        """Run a task's slices and report them on ``batch``.

        ``held`` are the local regions ``submit`` acquired for these slices; released here.
        """
        try:
            results = self._execute(peer, paths, task)
        finally:
            self._regions.release_many(held)
        batch.slices_done(results)

    def _execute(self, peer: Peer, paths: list[Transport],
                 task: list[tuple[int, int, int, int, int]]) -> list[tuple[int, MooncakeError | None]]:
        """Run slices on the best path at once; on failure, slice by slice over every path."""
        try:
            paths[0].execute_many(peer, task)
            return [(s[0], None) for s in task]
        except (MooncakeError, OSError) as exc:
            done = getattr(exc, "completed", ())  # positions the transport did move
            results: list[tuple[int, MooncakeError | None]] = []
            for pos, (index, op, local, remote, n) in enumerate(task):
                if pos in done:
                    results.append((index, None))
                    continue
                try:
                    self._run_slice(peer, paths, op, local, remote, n)
                    results.append((index, None))
                except MooncakeError as exc:
                    results.append((index, exc))
                except Exception as exc:  # keep the worker alive; report on the batch
                    log.exception("slice to %s failed unexpectedly", peer.name)
                    results.append((index, TransferError(f"slice to {peer.name!r} failed: {exc!r}")))
            return results
        except Exception as exc:  # keep the worker alive; report on the batch
            log.exception("slices to %s failed unexpectedly", peer.name)
            return [(s[0], TransferError(f"slice to {peer.name!r} failed: {exc!r}")) for s in task]

    def transfer_many(self, op: OpCode, plan: Mapping[str, Sequence[tuple[int, int, int]]],
                      timeout_s: float | None = None,
                      transport: str | None = None) -> dict[str, list[MooncakeError | None]]:
        """Move ``(local_address, remote_address, nbytes)`` items to/from several segments; block.

        Returns, per segment, each item's error or None. Large batches start first, on
        the worker pool; small ones (up to ``inline_nbytes``, no item over a slice) then
        run in the calling thread with no Batch bookkeeping: the store's path for many
        small objects.
        """
        out: dict[str, list[MooncakeError | None]] = {}
        pending: list[tuple[str, Batch]] = []
        step, inline = self.config.slice_nbytes, self.config.inline_nbytes
        small = {seg: items for seg, items in plan.items()
                 if sum(n for _, _, n in items) <= inline and all(n <= step for _, _, n in items)}
        for seg, items in plan.items():
            try:
                if seg not in small:
                    pending.append((seg, self.submit(seg, [TransferRequest(op, *it) for it in items],
                                                     transport)))
            except MooncakeError as exc:
                out[seg] = [exc] * len(items)
        for seg, items in small.items():
            try:
                out[seg] = self._run_inline(seg, op, items, transport)
            except MooncakeError as exc:
                out[seg] = [exc] * len(items)
        for seg, batch in pending:
            if batch.wait_done(timeout_s):
                out[seg] = batch.errors()
            else:
                out[seg] = [TransferTimeout(f"transfer to {seg!r} did not complete within "
                                            f"{timeout_s} s")] * len(batch.requests)
        return out

    def _run_inline(self, segment: str, op: OpCode, items: Sequence[tuple[int, int, int]],
                    transport: str | None) -> list[MooncakeError | None]:
        self._check_open()
        peer = self.open_segment(segment)
        reach = self._reaching(peer, transport)
        code = OP_WRITE if op is OpCode.WRITE else OP_READ
        for local, remote, n in items:
            validate_range(local, remote, n)
        refused, remote_kinds = self._check_remote(peer, [(op, remote, n) for _, remote, n in items])
        task = [(i, code, local, remote, n) for i, (local, remote, n) in enumerate(items)
                if n and i not in refused]
        held = self._hold(task)
        try:
            routes = self._routes(peer, reach, transport, task, held, remote_kinds)
            errors: list[MooncakeError | None] = [refused.get(i) for i in range(len(items))]
            for paths, run in self._runs(routes, task):
                for index, err in self._execute(peer, paths, run):
                    errors[index] = err
            return errors
        finally:
            self._regions.release_many(held)

    @staticmethod
    def _runs(routes: list[list[Transport]], task: list[tuple[int, int, int, int, int]]
              ) -> list[tuple[list[Transport], list[tuple[int, int, int, int, int]]]]:
        """``task`` cut into runs of consecutive slices with the same paths (``routes``)."""
        if not routes:
            return []
        if routes.count(routes[0]) == len(routes):
            return [(routes[0], task)]
        runs, first = [], 0
        for i, paths in enumerate(routes):
            if i + 1 == len(routes) or routes[i + 1] is not paths:
                runs.append((paths, task[first:i + 1]))
                first = i + 1
        return runs

    def _run_slice(self, peer: Peer, paths: list[Transport], op: int, local: int, remote: int,
                   n: int) -> None:
        attempts = 0
        last: Exception | None = None
        for transport in itertools.chain(paths, itertools.repeat(paths[-1], self.config.retries)):
            try:
                transport.execute(peer, op, local, remote, n)
                return
            except AddressError:
                raise  # the target refused the range: another path will not help
            except (MooncakeError, OSError) as exc:
                attempts += 1
                last = exc
                log.info("slice %s 0x%x+%d to %s failed on %s (attempt %d): %s",
                         "WRITE" if op == OP_WRITE else "READ", remote, n, peer.name,
                         transport.name, attempts, exc)
        raise TransferError(f"transfer to segment {peer.name!r} failed after {attempts} "
                            f"attempts: {last}") from last

    def transfer(self, segment: str, op: OpCode, local_address: int, remote_address: int,
                 nbytes: int, timeout_s: float | None = None, transport: str | None = None) -> None:
        """One request, blocking until done. Raises the request's error."""
        self.submit(segment, [TransferRequest(op, local_address, remote_address, nbytes)],
                    transport).wait(timeout_s)

    def read(self, segment: str, local_address: int, remote_address: int, nbytes: int,
             timeout_s: float | None = None) -> None:
        """Copy ``nbytes`` from the segment into local registered memory (blocking)."""
        self.transfer(segment, OpCode.READ, local_address, remote_address, nbytes, timeout_s)

    def write(self, segment: str, local_address: int, remote_address: int, nbytes: int,
              timeout_s: float | None = None) -> None:
        """Copy ``nbytes`` of local registered memory into the segment (blocking)."""
        self.transfer(segment, OpCode.WRITE, local_address, remote_address, nbytes, timeout_s)

    # -- lifecycle -------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, int]:
        """Bytes served to peers by the tcp server (in = written to us, out = read from us),
        on every address it listens on."""
        return {"bytes_in": sum(s.bytes_in for s in self._servers),
                "bytes_out": sum(s.bytes_out for s in self._servers)}

    def path_stats(self) -> dict[str, dict[str, Any]]:
        """Per tcp path (``host:port`` of a peer) used by this engine: bytes moved, the
        rate it delivered (GB/s, smoothed) and whether it is paused after a failure."""
        out: dict[str, dict[str, Any]] = {}
        for t in self._transports:
            stats = getattr(t, "path_stats", None)
            if stats is not None:
                out.update(stats())
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("the transfer engine is closed")

    def close(self, wait_s: float = 5.0) -> None:
        """Stop serving, unpublish, wait for running transfers and release all memory.

        Transfers still touching a region after ``wait_s`` (another thread's, or a peer's)
        keep that region's memory: it stays mapped, with an error logged, never unmapped
        under a copy. Calling ``close`` again later releases what is free by then.
        """
        with self._lock:
            first, self._closed = not self._closed, True
        if first:
            self._stop_serving(unpublish=True)
        if self._epoch.map.closed:
            return  # everything was released before
        released = []
        for region in self._regions.regions():
            try:
                released.append(self._regions.remove(region.address, wait_s))
            except RegionBusy as exc:
                log.error("engine %s closing: %s; its memory is left mapped (close() again "
                          "releases it once free)", self.segment_name, exc)
            except InvalidArgument:
                pass  # freed by another thread meanwhile
        EPOCH.pack_into(self._epoch.map, 0, self._regions.epoch + 1)  # same-host peers re-check
        with self._lock:
            gone = {id(r) for r in released}
            managed = {id(buf.region): mf for buf, mf in self._managed.values()
                       if id(buf.region) in gone}
            self._managed = {a: e for a, e in self._managed.items() if id(e[0].region) not in gone}
        for region in released:
            mf = managed.get(id(region))
            if mf is not None:
                mf.close()
            elif hasattr(region.keepalive, "release"):
                region.keepalive.release()
        if not len(self._regions):
            self._epoch.close()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"TransferEngine {self.segment_name!r} was not closed", ResourceWarning,
                          stacklevel=2)
