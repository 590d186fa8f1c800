"""Registered memory regions and bounds checks: the engine's security boundary.

A process exposes only what it registered. Every remote request (tcp target side) and
every same-host copy (shm initiator side, against the published descriptor) is checked
here before an address is turned into a pointer. The memory kind of a region's
``location`` (:data:`HOST`, :data:`CUDA`) is named here too, for the engine, its peers
and every transport.

Lock order: ``RegionTable._lock`` is a leaf lock; nothing else is taken while it is held.
"""

from __future__ import annotations

import bisect
import ipaddress
import threading
from dataclasses import dataclass, field
from typing import Any

from ..config import MAX_TCP_PATHS

MAX_RDMA_NICS = 16
"""RDMA NICs one descriptor may list."""
RDMA_MTUS = (256, 512, 1024, 2048, 4096)
from ..errors import AddressError, InvalidArgument, ProtocolError, RegionBusy
from .cuda import IpcHandle

MAX_ADDRESS = (1 << 64) - 1

HOST = "host"
"""Memory the CPU addresses directly (registered with location ``*``, ``cpu`` or ``cpu:N``)."""
CUDA = "cuda"
"""GPU memory (registered with location ``cuda`` or ``cuda:N``)."""


def kind_of_location(location: str | None) -> str:
    """The memory kind of a region from its registered ``location``: ``cuda:N`` (or
    ``cuda``) is :data:`CUDA`; ``*``, ``cpu``, ``cpu:N``, empty or missing are :data:`HOST`."""
    if location and location[:4] == "cuda" and location[4:5] in ("", ":"):
        return CUDA
    return HOST


def device_of(location: str) -> int:
    """The CUDA device ordinal of a ``cuda:N`` (or ``cuda``: 0) location."""
    return int(location[5:]) if location[4:5] == ":" else 0


@dataclass(frozen=True)
class RegionInfo:
    """A region as published in a segment descriptor.

    ``memfd`` is the fd number of the memfd backing the region in its owner (-1 when the
    region is ordinary process memory); same-host peers map it through /proc. Peers may
    READ a ``readonly`` region but never WRITE it.

    GPU memory (``location`` ``cuda:N``) also carries ``generation``, drawn afresh for
    every registration by its owner (so a peer never mistakes memory registered again at
    the same address for what it mapped before), and ``ipc``, the CUDA IPC handle of the
    allocation holding it (None where CUDA cannot export one, e.g. ``expandable_segments``
    memory): same-host peers open it once and copy device to device.

    ``rkeys`` are the region's RDMA keys, one per NIC the descriptor's ``rdma`` lists
    (empty where the owner has no rdma transport or could not register it).
    """

    address: int
    nbytes: int
    location: str = "*"
    memfd: int = -1
    readonly: bool = False
    generation: int = 0
    ipc: IpcHandle | None = None
    rkeys: tuple[int, ...] = ()

    def contains(self, address: int, nbytes: int) -> bool:
        return self.address <= address and address + nbytes <= self.address + self.nbytes


@dataclass(eq=False)
class Region:
    """A locally registered region; ``inflight`` counts transfers touching it now.

    A ``private`` region is only a source or destination of this process's own transfers:
    it is not published, and peers can neither read nor write it.
    """

    info: RegionInfo
    keepalive: Any = None
    private: bool = False
    inflight: int = 0
    device: bool = False
    """GPU memory (a ``cuda`` location): never touched by the CPU (tcp server, shm copies)."""

    def __post_init__(self) -> None:
        loc = self.info.location
        if loc[:4] == "cuda":
            self.device = loc[4:5] in ("", ":")

    @property
    def address(self) -> int:
        return self.info.address

    @property
    def nbytes(self) -> int:
        return self.info.nbytes

    @property
    def readonly(self) -> bool:
        return self.info.readonly


def check_range(address: int, nbytes: int) -> None:
    """Reject negative, zero-length-overflowing or wrapping ranges (InvalidArgument)."""
    if not isinstance(address, int) or not isinstance(nbytes, int):
        raise InvalidArgument(f"address and nbytes must be int, got {type(address).__name__}, "
                              f"{type(nbytes).__name__}")
    if address < 0 or nbytes < 0 or address + nbytes > MAX_ADDRESS:
        raise InvalidArgument(f"bad range address=0x{address:x} nbytes={nbytes}")


def _check_remote(region: Region, address: int, nbytes: int, device: bool) -> None:
    if region.private:
        raise AddressError(f"range 0x{address:x}+{nbytes} is not inside a registered region")
    if region.device and not device:
        raise AddressError(f"range 0x{address:x}+{nbytes} is GPU memory ({region.info.location}): "
                           f"only the cuda_ipc transport reaches it")


class RegionTable:
    """Non-overlapping registered regions, sorted by address, with bounds lookups."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._starts: list[int] = []
        self._regions: list[Region] = []
        self.epoch = 0

    def add(self, region: Region) -> Region:
        """Insert ``region``; overlapping an existing region is an InvalidArgument."""
        addr, n = region.address, region.nbytes
        check_range(addr, n)
        if n == 0:
            raise InvalidArgument("cannot register an empty region")
        with self._lock:
            i = bisect.bisect_right(self._starts, addr)
            prev = self._regions[i - 1] if i else None
            nxt = self._regions[i] if i < len(self._regions) else None
            if (prev and prev.address + prev.nbytes > addr) or (nxt and addr + n > nxt.address):
                raise InvalidArgument(f"region 0x{addr:x}+{n} overlaps a registered region")
            self._starts.insert(i, addr)
            self._regions.insert(i, region)
            if not region.private:
                self.epoch += 1
        return region

    def remove(self, address: int, wait_s: float = 1.0) -> Region:
        """Remove the region starting at ``address``.

        Transfers still using it get ``wait_s`` seconds to finish (a peer's last reply
        can reach its initiator before the serving thread lets go of the region).

        Raises:
            InvalidArgument: nothing is registered at ``address``.
            RegionBusy: transfers still use it after ``wait_s``.
        """
        with self._lock:
            i = bisect.bisect_left(self._starts, address)
            if i == len(self._starts) or self._starts[i] != address:
                raise InvalidArgument(f"no region is registered at 0x{address:x}")
            region = self._regions[i]
            if not self._drained.wait_for(lambda: region.inflight == 0, wait_s):
                raise RegionBusy(f"region 0x{address:x} has {region.inflight} transfers in flight")
            i = self._regions.index(region)  # the table may have changed while waiting
            del self._starts[i]
            del self._regions[i]
            if not region.private:
                self.epoch += 1
        return region

    def acquire(self, address: int, nbytes: int, remote: bool = False,
                device: bool = False) -> Region:
        """Find the region holding ``[address, address+nbytes)`` and count one more user.

        Raises:
            AddressError: the range is not entirely inside one registered region (for a
                ``remote`` peer: one that is not private; and, unless ``device``, not GPU
                memory, which a peer's CPU copy must never be pointed at).
        """
        with self._lock:
            region = self._find(address, nbytes)
            if remote:
                _check_remote(region, address, nbytes, device)
            region.inflight += 1
            return region

    def release(self, region: Region) -> None:
        with self._lock:
            region.inflight -= 1
            if region.inflight == 0:
                self._drained.notify_all()

    def acquire_many(self, ranges: list[tuple[int, int]], remote: bool = False,
                     device: bool = False) -> list[Region]:
        """:meth:`acquire` for every ``(address, nbytes)``, all or none, under one lock."""
        with self._lock:
            regions = [self._find(a, n) for a, n in ranges]
            if remote:
                for (a, n), r in zip(ranges, regions):
                    _check_remote(r, a, n, device)
            for r in regions:
                r.inflight += 1
            return regions

    def release_many(self, regions: list[Region]) -> None:
        with self._lock:
            for r in regions:
                r.inflight -= 1
            self._drained.notify_all()

    def find(self, address: int, nbytes: int) -> Region:
        """Like :meth:`acquire` without counting a user."""
        with self._lock:
            return self._find(address, nbytes)

    def _find(self, address: int, nbytes: int) -> Region:
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0:
            region = self._regions[i]
            if address + nbytes <= self._starts[i] + region.info.nbytes:
                return region
        raise AddressError(f"range 0x{address:x}+{nbytes} is not inside a registered region")

    def regions(self, include_private: bool = True) -> list[Region]:
        with self._lock:
            return [r for r in self._regions if include_private or not r.private]

    def __len__(self) -> int:
        return len(self._regions)


@dataclass
class SegmentDescriptor:
    """What a peer needs to reach a segment: rpc endpoint, host identity and regions."""

    name: str
    host: str
    port: int
    pid: int
    host_id: str
    epoch: int = 0
    epoch_memfd: int = -1
    regions: list[RegionInfo] = field(default_factory=list)
    paths: tuple[str, ...] = ()
    """More addresses of the segment's host serving the same rpc port (tcp multi-path)."""
    rdma: tuple[tuple[str, str, int, int], ...] = ()
    """The segment's RDMA NICs: ``(device name, GID text, LID, active MTU in bytes)``."""

    def __post_init__(self) -> None:
        self.regions.sort(key=lambda r: r.address)
        self._starts = [r.address for r in self.regions]

    def find(self, address: int, nbytes: int, write: bool = False) -> RegionInfo:
        """The published region holding the range (writable if ``write``), else AddressError."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0:
            r = self.regions[i]
            if address + nbytes <= r.address + r.nbytes:  # and address >= r.address by bisect
                if write and r.readonly:
                    raise AddressError(f"segment {self.name!r} registered 0x{r.address:x} read-only")
                return r
        raise AddressError(f"range 0x{address:x}+{nbytes} is not inside a region registered "
                           f"by segment {self.name!r}")

    def to_wire(self) -> dict:
        wire = {"v": 1, "name": self.name, "host": self.host, "port": self.port, "pid": self.pid,
                "host_id": self.host_id, "epoch": self.epoch, "epoch_memfd": self.epoch_memfd,
                "regions": [_region_to_wire(r) for r in self.regions]}
        if self.paths:
            wire["paths"] = list(self.paths)
        if self.rdma:
            wire["rdma"] = [list(nic) for nic in self.rdma]
        return wire

    @classmethod
    def from_wire(cls, obj: Any) -> "SegmentDescriptor":
        """Validate every field of a decoded descriptor; ProtocolError on anything odd."""
        def need(key: str, typ: type) -> Any:
            if not isinstance(obj, dict) or key not in obj:
                raise ProtocolError(f"segment descriptor lacks {key!r}")
            val = obj[key]
            if not isinstance(val, typ) or isinstance(val, bool):
                raise ProtocolError(f"segment descriptor field {key!r} has type "
                                    f"{type(val).__name__}, expected {typ.__name__}")
            return val

        if need("v", int) != 1:
            raise ProtocolError(f"unsupported segment descriptor version {obj['v']}")
        port, pid = need("port", int), need("pid", int)
        if not 0 < port < 65536 or pid <= 0:
            raise ProtocolError(f"segment descriptor has bad port {port} or pid {pid}")
        regions = [_region_from_wire(item) for item in need("regions", list)]
        paths = tuple(need("paths", list)) if isinstance(obj, dict) and "paths" in obj else ()
        if len(paths) > MAX_TCP_PATHS or not all(_is_ip(p) for p in paths):
            raise ProtocolError(f"segment descriptor has bad paths {paths[:MAX_TCP_PATHS + 1]!r}: "
                                f"at most {MAX_TCP_PATHS} IP addresses")
        rdma = tuple(_nic_from_wire(n) for n in need("rdma", list)[:MAX_RDMA_NICS + 1]) \
            if isinstance(obj, dict) and "rdma" in obj else ()
        if len(rdma) > MAX_RDMA_NICS:
            raise ProtocolError(f"segment descriptor lists more than {MAX_RDMA_NICS} RDMA NICs")
        if any(r.rkeys and len(r.rkeys) != len(rdma) for r in regions):
            raise ProtocolError(f"segment descriptor has regions whose rdma keys do not match "
                                f"its {len(rdma)} RDMA NICs")
        return cls(name=need("name", str), host=need("host", str), port=port, pid=pid,
                   host_id=need("host_id", str), epoch=need("epoch", int),
                   epoch_memfd=need("epoch_memfd", int), regions=regions, paths=paths,
                   rdma=rdma)


def _is_ip(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def _nic_from_wire(item: Any) -> tuple[str, str, int, int]:
    """One RDMA NIC ``[name, gid text, lid, mtu]`` of a descriptor, checked."""
    if (not isinstance(item, list) or len(item) != 4 or not isinstance(item[0], str)
            or not 0 < len(item[0]) <= 64 or not isinstance(item[1], str)
            or not _is_int(item[2]) or not 0 <= item[2] < 1 << 16 or item[3] not in RDMA_MTUS
            or not _is_int(item[3])):
        raise ProtocolError(f"segment descriptor has a malformed RDMA NIC {item!r:.200}")
    try:
        ipaddress.IPv6Address(item[1])
    except ValueError:
        raise ProtocolError(f"segment descriptor has an RDMA NIC with a bad GID "
                            f"{item[1]!r:.64}") from None
    return (item[0], item[1], item[2], item[3])


def _region_to_wire(r: RegionInfo) -> list:
    """Host memory: ``[address, nbytes, location, memfd, readonly]`` (as before GPU memory);
    GPU memory adds ``generation`` and the IPC handle's wire form (or None); RDMA keys,
    where there are some, come eighth (after ``0, None`` for host memory)."""
    if r.generation == 0 and r.ipc is None and not r.rkeys:
        return [r.address, r.nbytes, r.location, r.memfd, r.readonly]
    wire = [r.address, r.nbytes, r.location, r.memfd, r.readonly, r.generation,
            None if r.ipc is None else r.ipc.to_wire()]
    if r.rkeys:
        wire.append(list(r.rkeys))
    return wire


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _region_from_wire(item: Any) -> RegionInfo:
    """One region of a descriptor from the wire, every field checked (ProtocolError)."""
    if (not isinstance(item, list) or len(item) not in (5, 7, 8)
            or not all(_is_int(x) for x in (item[0], item[1], item[3]))
            or not isinstance(item[2], str) or not isinstance(item[4], bool)
            or len(item[2]) > 64):
        raise ProtocolError(f"segment descriptor has a malformed region {item!r}")
    if item[0] < 0 or item[1] <= 0 or item[0] + item[1] > MAX_ADDRESS or item[3] < -1:
        raise ProtocolError(f"segment descriptor has an impossible region {item!r}")
    if len(item) == 5:
        return RegionInfo(*item)
    generation, wire = item[5], item[6]
    rkeys = _rkeys_from_wire(item[7]) if len(item) == 8 else ()
    loc = item[2]
    is_cuda = loc[:4] == "cuda" and loc[4:5] in ("", ":")
    if not is_cuda and rkeys and generation == 0 and wire is None:
        return RegionInfo(*item[:5], rkeys=rkeys)
    if not _is_int(generation) or not 0 < generation <= MAX_ADDRESS or not is_cuda:
        raise ProtocolError(f"segment descriptor has a malformed GPU region {item[:6]!r}")
    ipc = None
    if wire is not None:
        try:
            ipc = IpcHandle.from_wire(wire)
        except InvalidArgument as exc:
            raise ProtocolError(f"segment descriptor has a GPU region 0x{item[0]:x} with a "
                                f"malformed IPC handle: {exc}") from None
        if not ipc.base <= item[0] or item[0] + item[1] > ipc.base + ipc.nbytes:
            raise ProtocolError(f"segment descriptor has a GPU region 0x{item[0]:x}+{item[1]} "
                                f"outside its IPC allocation 0x{ipc.base:x}+{ipc.nbytes}")
    return RegionInfo(item[0], item[1], loc, item[3], item[4], generation, ipc, rkeys)


def _rkeys_from_wire(value: Any) -> tuple[int, ...]:
    if (not isinstance(value, list) or not 0 < len(value) <= MAX_RDMA_NICS
            or not all(_is_int(k) and 0 <= k < 1 << 32 for k in value)):
        raise ProtocolError(f"segment descriptor has malformed rdma keys {value!r:.200}")
    return tuple(value)
