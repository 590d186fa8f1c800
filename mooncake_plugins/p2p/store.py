"""P2PStore: named objects (checkpoint shards ...) shared peer to peer over the transfer engine.

A provider registers an object made of one or more memory *parts*; any node fetches a
replica into its own buffers by reading from a current holder, then (by default) becomes a
holder itself, so later getters spread over the nodes that already have the bytes instead
of all hitting the provider's NIC. Bytes move holder -> getter through
:class:`~mooncake_plugins.transfer.TransferEngine` READs (a holder's CPU is not involved
beyond its transfer server); only small records go through the metadata service.

Metadata layout (values are msgpack; ``<id>`` is a fresh hex id per registration)::

    mooncake/p2p/objects/<name>             record: id, provider segment, total and per-part
                                            nbytes; list() lists this prefix
    mooncake/p2p/holders/<id>/<segment>     one key per holder: the address of each part

:class:`MetadataStore` has no compare-and-set, so a shared "holder list" value would lose
entries when two getters rewrite it at once. Instead every holder writes (and removes) only
its own key, and readers list the directory with :meth:`MetadataStore.list_prefix`, which
every backend offers (an HTTP metadata server must be this package's: the original
Mooncake's cannot list, and the constructor then raises MetadataError).

Semantics chosen:

* The provider owns the name. Its ``unregister`` (or ``close``) withdraws the object: the
  record and holder directory are deleted, and later getters get ObjectNotFound; replicas
  already fetched stay valid in their owners' buffers.
* A replica holder's ``unregister`` removes only its own holder entry. If no listed holder
  is left alive (the provider crashed without unregistering), it deletes the record too.
* A crashed holder stays listed until a getter trips over it: the getter reads its chunks
  from another holder and, when :meth:`TransferEngine.probe` finds the holder's engine
  gone, removes its entry so later getters do not try it again. Nothing expires by itself:
  the metadata service has no TTLs.
* Registering a name that exists raises ObjectAlreadyExists unless ``replace=True``. Two
  nodes registering the same new name at the same moment both succeed; the later record wins.

Thread model: public methods may be called from any thread and block on metadata and
transfer I/O. Lock order: ``P2PStore._lock`` is a leaf (held only around ``_held`` and
``_last_chosen``).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack

from ..errors import (InvalidArgument, MetadataError, MooncakeError, ObjectAlreadyExists,
                      ObjectNotFound, RegionBusy, TransferError)
from ..transfer import ManagedBuffer, OpCode, TransferEngine, TransferRequest
from ..transfer.batch import TransferStatus
from ..transfer.memory import address_of
from ..transfer.metadata import MetadataStore, from_url
from ..transfer.metadata.base import P2P_HANDSHAKE, check_text

log = logging.getLogger(__name__)

PREFIX = "mooncake/p2p/"
OBJECTS = PREFIX + "objects/"
HOLDERS = PREFIX + "holders/"
_PROBE = PREFIX + "probe/"  # never written: listing it checks that the service can list
MAX_NAME_NBYTES = 512
DEFAULT_CHUNK_NBYTES = 4 << 20
_RELEASE_TIMEOUT_S = 10.0

Buffer = Any  # a buffer object, a CPU tensor, a ManagedBuffer or an (address, nbytes) pair


# -- records --------------------------------------------------------------------------------

@dataclass(frozen=True)
class HolderInfo:
    """A node that serves an object: its segment and the address of each part there."""

    segment: str
    addresses: tuple[int, ...]


@dataclass(frozen=True)
class ObjectInfo:
    """An object as published: its layout, provider and current holders."""

    name: str
    object_id: str
    provider: str
    part_nbytes: tuple[int, ...]
    holders: tuple[HolderInfo, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(self.part_nbytes)


@dataclass
class ReadReport:
    """What :meth:`P2PStore.get_replica` did: bytes read per holder, holders that failed."""

    nbytes: int
    read_from: dict[str, int] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _decode_record(name: str, raw: bytes) -> ObjectInfo:
    try:
        obj = msgpack.unpackb(raw, raw=False)
        parts = obj["part_nbytes"]
        if (obj.get("v") != 1 or not isinstance(obj["id"], str)
                or not isinstance(obj["provider"], str)
                or not isinstance(parts, list) or not parts
                or not all(_is_int(n) and n > 0 for n in parts)):
            raise ValueError("unexpected fields")
        return ObjectInfo(name, obj["id"], obj["provider"], tuple(parts))
    except (ValueError, TypeError, KeyError, msgpack.ExtraData) as exc:
        raise MetadataError(f"P2P record of {name!r} is malformed ({exc}); unregister it with "
                            f"replace=True or delete {OBJECTS + name!r}") from exc


def _decode_holder(raw: bytes, nparts: int) -> HolderInfo | None:
    try:
        obj = msgpack.unpackb(raw, raw=False)
        addrs = obj["addresses"]
        if (isinstance(obj["segment"], str) and isinstance(addrs, list) and len(addrs) == nparts
                and all(_is_int(a) and a >= 0 for a in addrs)):
            return HolderInfo(obj["segment"], tuple(addrs))
    except (ValueError, TypeError, KeyError, msgpack.ExtraData):
        pass
    log.warning("ignoring a malformed P2P holder entry (%d bytes)", len(raw))
    return None


# -- holder directories ---------------------------------------------------------------------

class _Directory:
    """A set of ``member -> value`` entries under ``<base>/``, one key per member.

    Each member writes and removes only its own key ``<base>/<member>``, so concurrent adds
    of different members never lose each other; :meth:`entries` lists the prefix. Methods
    block on metadata I/O and may be called from any thread.
    """

    def __init__(self, store: MetadataStore) -> None:
        self.store = store

    def add(self, base: str, member: str, value: bytes) -> None:
        """Add or replace ``member``'s entry."""
        self.store.put(f"{base}/{member}", value)

    def remove(self, base: str, member: str) -> None:
        """Remove ``member``'s entry; a missing one is not an error."""
        self.store.delete(f"{base}/{member}")

    def entries(self, base: str) -> list[tuple[str, bytes]]:
        """Every current ``(member, value)``, sorted by member."""
        head = f"{base}/"
        return [(k[len(head):], v) for k, v in self.store.list_prefix(head)]

    def destroy(self, base: str) -> None:
        """Delete every entry (one added concurrently may survive; it is then orphaned)."""
        for member, _ in self.entries(base):
            self.remove(base, member)


# -- the store ------------------------------------------------------------------------------

@dataclass
class _Holding:
    """An object this node holds: what to unpublish and which regions to unregister."""

    info: ObjectInfo
    is_provider: bool
    regions: list[int]  # addresses of regions this store registered for it


@dataclass(frozen=True)
class _Chunk:
    part: int
    offset: int
    nbytes: int


def _check_name(name: object) -> str:
    check_text(name, "P2P object name", MAX_NAME_NBYTES)
    return name  # type: ignore[return-value]


def _part_of(buf: Buffer) -> tuple[int, int, Any]:
    """``(address, nbytes, object to register or None)`` of one caller buffer."""
    if isinstance(buf, tuple) and len(buf) == 2 and all(_is_int(v) for v in buf):
        return buf[0], buf[1], None
    if isinstance(buf, ManagedBuffer):
        return buf.address, buf.nbytes, None
    try:
        address, nbytes = address_of(buf)
    except (TypeError, ValueError, BufferError) as exc:
        raise InvalidArgument(f"cannot use {type(buf).__name__} as a P2P buffer: {exc}; pass "
                              "a contiguous buffer, a CPU tensor or an (address, nbytes) "
                              "pair") from exc
    return address, nbytes, buf


class P2PStore:
    """Register, list and fetch named objects; a fetcher serves what it fetched.

    Args:
        metadata_url: ``etcd://h:p``, ``redis://h:p`` or ``http://h:p/metadata`` (required:
            objects are listed there; ``P2PHANDSHAKE`` is rejected).
        local_hostname: host (or ``host:port``) for the engine created when ``engine`` is None.
        engine: an engine to share (it may use any metadata mode; it is not closed by us).
        chunk_nbytes: parts are read in chunks of this size, spread over the holders.

    Raises:
        InvalidArgument: a malformed or P2PHANDSHAKE URL, a bad chunk size.
        MetadataError: the metadata backend is unavailable or unreachable, or cannot list
            keys (an HTTP metadata server other than this package's).

    Called from any thread; the constructor blocks on one metadata listing (checking that
    the service can list) and while an engine is created.
    """

    def __init__(self, metadata_url: str, local_hostname: str = "127.0.0.1",
                 engine: TransferEngine | None = None, *,
                 chunk_nbytes: int = DEFAULT_CHUNK_NBYTES) -> None:
        if isinstance(metadata_url, str) and metadata_url.strip() == P2P_HANDSHAKE:
            raise InvalidArgument(f"the P2P store needs a metadata service to list objects in, "
                                  f"not {P2P_HANDSHAKE}; pass etcd://, redis:// or http:// URL")
        if not _is_int(chunk_nbytes) or chunk_nbytes < 4096:
            raise InvalidArgument(f"chunk_nbytes must be an int >= 4096, got {chunk_nbytes!r}")
        store = from_url(metadata_url)
        assert store is not None
        self._meta: MetadataStore = store
        self._dir = _Directory(store)
        self._chunk_nbytes = chunk_nbytes
        self._owns_engine = engine is None
        try:
            store.list_prefix(_PROBE)  # fail now, not at the first describe(), if it cannot list
            self.engine = engine if engine is not None else TransferEngine(local_hostname,
                                                                           metadata_url)
        except BaseException:
            store.close()
            raise
        self.segment = self.engine.segment_name
        self._lock = threading.Lock()
        self._held: dict[str, _Holding | None] = {}  # None: an operation on it is running
        self._last_chosen: dict[str, float] = {}  # holder segment -> last read from; _lock
        self._closed = False
        log.info("P2P store on segment %s, metadata %s", self.segment, metadata_url)

    # -- metadata helpers ----------------------------------------------------------------
    def describe(self, name: str) -> ObjectInfo:
        """The object's record and its current holders.

        Raises: ObjectNotFound, MetadataError. Blocks on metadata I/O.
        """
        self._check_open()
        info = self._record(_check_name(name))
        holders = []
        for _, raw in self._dir.entries(HOLDERS + info.object_id):
            h = _decode_holder(raw, len(info.part_nbytes))
            if h is not None:
                holders.append(h)
        return ObjectInfo(info.name, info.object_id, info.provider, info.part_nbytes,
                          tuple(holders))

    def _record(self, name: str) -> ObjectInfo:
        raw = self._meta.get(OBJECTS + name)
        if raw is None:
            raise ObjectNotFound(f"no P2P object named {name!r} is registered in "
                                 f"{self._meta.url} (see list())")
        return _decode_record(name, raw)

    def list(self, prefix: str = "") -> list[str]:
        """Names of the registered objects starting with ``prefix``, sorted.

        A plain string prefix: ``"ckpt/1"`` also lists ``"ckpt/10"``. Malformed records are
        skipped. Raises: InvalidArgument, MetadataError. Blocks on one metadata listing.
        """
        self._check_open()
        if not isinstance(prefix, str):
            raise InvalidArgument(f"prefix must be a str, got {type(prefix).__name__}")
        names = []
        for key, raw in self._meta.list_prefix(OBJECTS + prefix):
            name = key[len(OBJECTS):]
            try:
                _decode_record(name, raw)
            except MetadataError as exc:
                log.warning("list() skips a P2P object: %s", exc)
                continue
            names.append(name)
        return names

    # -- buffers ---------------------------------------------------------------------------
    def _prepare(self, buffers: Sequence[Buffer], writable: bool, private: bool
                 ) -> tuple[list[tuple[int, int]], list[int]]:
        """Resolve buffers to ``(address, nbytes)`` parts, registering what is not yet.

        Returns the parts and the addresses of the regions registered here (to undo).
        """
        if isinstance(buffers, (bytes, bytearray, memoryview)) or not isinstance(buffers,
                                                                                 Sequence):
            raise InvalidArgument("buffers must be a list of buffers or (address, nbytes) pairs")
        if not buffers:
            raise InvalidArgument("buffers must not be empty")
        parts, added = [], []
        try:
            for i, buf in enumerate(buffers):
                address, nbytes, obj = _part_of(buf)
                if nbytes <= 0 or address <= 0:
                    raise InvalidArgument(f"part {i} is empty or has no address "
                                          f"(address={address}, nbytes={nbytes})")
                published = next((r for r in self.engine.regions()
                                  if r.contains(address, nbytes)), None)
                if published is None:
                    # registered privately (by someone else), or not registered at all
                    covered = self.engine.is_registered(address, nbytes)
                    if covered and not private:
                        raise InvalidArgument(f"part {i} lies in a privately registered region "
                                              "that peers cannot read; register it public")
                    if not covered:
                        kw = {"private": True} if private else {}
                        region = (self.engine.register(obj, **kw) if obj is not None
                                  else self.engine.register_address(address, nbytes, **kw))
                        added.append(region.address)
                        readonly = region.readonly
                    else:
                        readonly = False
                else:
                    readonly = published.readonly
                if writable and readonly:
                    raise InvalidArgument(f"part {i} is read-only; get_replica needs writable "
                                          "buffers")
                parts.append((address, nbytes))
        except BaseException:
            self._release(added)
            raise
        return parts, added

    def _release(self, addresses: list[int]) -> None:
        """Unregister regions, waiting (bounded) for transfers peers still run on them."""
        for address in addresses:
            deadline = time.monotonic() + _RELEASE_TIMEOUT_S
            while True:
                try:
                    self.engine.unregister(address)
                    break
                except RegionBusy:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.005)  # no completion event to wait on: poll briefly
                except InvalidArgument as exc:
                    log.warning("region 0x%x was already unregistered: %s", address, exc)
                    break

    def _reserve(self, name: str) -> None:
        with self._lock:
            self._check_open()
            if name in self._held:
                raise ObjectAlreadyExists(f"this node already holds P2P object {name!r} (or is "
                                          "busy with it); unregister it first")
            self._held[name] = None

    def _settle(self, name: str, holding: _Holding | None) -> None:
        """End an operation on ``name``: record what is now held (or nothing)."""
        with self._lock:
            if holding is not None and not self._closed:
                self._held[name] = holding
                return
            self._held.pop(name, None)
        if holding is not None:  # close() ran meanwhile: do not leave it published
            self._withdraw(holding, quiet=True)

    def _holder_value(self, parts: list[tuple[int, int]]) -> bytes:
        return msgpack.packb({"segment": self.segment, "addresses": [a for a, _ in parts]},
                             use_bin_type=True)

    # -- register --------------------------------------------------------------------------
    def register(self, name: str, buffers: Sequence[Buffer], *,
                 replace: bool = False) -> ObjectInfo:
        """Publish ``buffers`` (the object's parts, in order) under ``name``; this node serves it.

        Buffers not yet registered with the engine are registered (and unregistered by
        :meth:`unregister`); keep them alive and unchanged until then.

        Raises:
            InvalidArgument: bad name or buffers. ObjectAlreadyExists: the name is published
            (``replace=True`` takes it over). MetadataError.

        Blocks on metadata I/O.
        """
        name = _check_name(name)
        self._reserve(name)
        holding = None
        try:
            if not replace and self._meta.get(OBJECTS + name) is not None:
                raise ObjectAlreadyExists(f"P2P object {name!r} is already registered; "
                                          "unregister it first or pass replace=True")
            parts, added = self._prepare(buffers, writable=False, private=False)
            info = ObjectInfo(name, uuid.uuid4().hex, self.segment, tuple(n for _, n in parts))
            holding = _Holding(info, True, added)
            try:
                self._dir.add(HOLDERS + info.object_id, self.segment, self._holder_value(parts))
                self._meta.put(OBJECTS + name, msgpack.packb(
                    {"v": 1, "id": info.object_id, "provider": self.segment,
                     "nbytes": info.nbytes, "part_nbytes": list(info.part_nbytes),
                     "created_s": time.time()}, use_bin_type=True))
            except BaseException:
                self._withdraw(holding, quiet=True)
                holding = None
                raise
            log.info("registered P2P object %s: %d bytes in %d parts", name, info.nbytes,
                     len(parts))
            return info
        finally:
            self._settle(name, holding)

    # -- get_replica -----------------------------------------------------------------------
    def get_replica(self, name: str, buffers: Sequence[Buffer], *,
                    serve: bool = True) -> ReadReport:
        """Fill ``buffers`` (same part sizes as registered) from the object's holders.

        Chunks are spread over the holders other than the provider (least recently chosen
        first), falling back to the provider only when none is left; a holder that fails is
        skipped and its chunks are read elsewhere. With ``serve`` this node then registers
        the buffers and lists itself as a holder (keep them alive until :meth:`unregister`).

        Raises:
            ObjectNotFound. InvalidArgument: part count or sizes differ from the record,
            read-only buffers. ObjectAlreadyExists: this node holds it already.
            TransferError: every holder failed. MetadataError.

        Blocks until every chunk is read (each slice bounded by the engine's timeouts).
        """
        name = _check_name(name)
        self._reserve(name)
        holding = None
        added: list[int] = []
        try:
            info = self.describe(name)
            expected = list(info.part_nbytes)
            if isinstance(buffers, Sequence) and len(buffers) != len(expected):
                raise InvalidArgument(f"P2P object {name!r} has {len(expected)} parts of "
                                      f"{expected} bytes, got {len(buffers)} buffers")
            parts, added = self._prepare(buffers, writable=True, private=not serve)
            sizes = [n for _, n in parts]
            if sizes != expected:
                raise InvalidArgument(f"P2P object {name!r} has parts of {expected} bytes, "
                                      f"the buffers have {sizes}")
            report = self._read(info, parts)
            if serve:
                self._dir.add(HOLDERS + info.object_id, self.segment, self._holder_value(parts))
                holding, added = _Holding(info, False, added), []
            log.info("fetched P2P object %s (%d bytes) from %s%s", name, report.nbytes,
                     dict(report.read_from), f", skipped {report.failed}" if report.failed else "")
            return report
        finally:
            self._settle(name, holding)
            if added:
                self._release(added)

    def _read(self, info: ObjectInfo, parts: list[tuple[int, int]]) -> ReadReport:
        """Read every chunk from the holders, moving the chunks of a failed holder elsewhere."""
        step = self._chunk_nbytes
        pending = [_Chunk(p, off, min(step, n - off))
                   for p, (_, n) in enumerate(parts) for off in range(0, n, step)]
        report = ReadReport(info.nbytes)
        dead = {self.segment}
        while pending:
            live = [h for h in info.holders if h.segment not in dead]
            if not live:
                raise TransferError(
                    f"could not read P2P object {info.name!r}: no holder left (failed: "
                    f"{report.failed or 'none'}; listed: {[h.segment for h in info.holders]})")
            tier = [h for h in live if h.segment != info.provider] or live
            random.shuffle(tier)
            with self._lock:
                last = {h.segment: self._last_chosen.get(h.segment, 0.0) for h in tier}
            tier.sort(key=lambda h: last[h.segment])
            plan: dict[HolderInfo, list[_Chunk]] = {}
            for j, chunk in enumerate(pending):
                plan.setdefault(tier[j % len(tier)], []).append(chunk)
            now = time.monotonic()
            with self._lock:
                self._last_chosen.update((holder.segment, now) for holder in plan)
            pending = []
            running = []
            for holder, chunks in plan.items():
                reqs = [TransferRequest(OpCode.READ, parts[c.part][0] + c.offset,
                                        holder.addresses[c.part] + c.offset, c.nbytes)
                        for c in chunks]
                try:
                    running.append((holder, chunks, self.engine.submit(holder.segment, reqs)))
                except MooncakeError as exc:
                    self._holder_failed(info, holder, exc, report, dead)
                    pending.extend(chunks)
            for holder, chunks, batch in running:
                try:
                    batch.wait()
                except MooncakeError as exc:
                    self._holder_failed(info, holder, exc, report, dead)
                    pending.extend(c for i, c in enumerate(chunks)
                                   if batch.request_status(i) != TransferStatus.COMPLETED)
                    chunks = [c for i, c in enumerate(chunks)
                              if batch.request_status(i) == TransferStatus.COMPLETED]
                if chunks:
                    report.read_from[holder.segment] = (report.read_from.get(holder.segment, 0)
                                                        + sum(c.nbytes for c in chunks))
        return report

    def _holder_failed(self, info: ObjectInfo, holder: HolderInfo, exc: Exception,
                       report: ReadReport, dead: set[str]) -> None:
        """Skip ``holder`` for the rest of this read; delist it when it is gone for good."""
        dead.add(holder.segment)
        report.failed.append(holder.segment)
        if self._alive(holder.segment):
            log.warning("P2P holder %s of %s failed, reading its chunks elsewhere: %s",
                        holder.segment, info.name, exc)
            return
        log.warning("P2P holder %s of %s is unreachable (%s); delisting it", holder.segment,
                    info.name, exc)
        try:
            self._dir.remove(HOLDERS + info.object_id, holder.segment)
        except MooncakeError as exc2:
            log.warning("could not delist %s: %s", holder.segment, exc2)

    def _alive(self, segment: str) -> bool:
        """Whether ``segment``'s engine answers :meth:`TransferEngine.probe` (blocks, bounded
        by the engine's connect timeout).

        SegmentNotFound (unpublished or not answering) means gone; so does any other engine
        error, such as a malformed descriptor: such a holder cannot be read from either.
        """
        try:
            self.engine.probe(segment)
            return True
        except MooncakeError:
            self.engine.close_segment(segment)
            return False

    # -- unregister / close ----------------------------------------------------------------
    def unregister(self, name: str) -> None:
        """Stop holding ``name``; the provider withdraws the object (see the module docstring).

        Raises:
            InvalidArgument: this node does not hold it. RegionBusy: peers kept reading
            for over 10 s. MetadataError.

        Blocks on metadata I/O and on transfers still reading our buffers.
        """
        name = _check_name(name)
        with self._lock:
            holding = self._held.get(name)
            if holding is None:
                raise InvalidArgument(f"this node does not hold P2P object {name!r}"
                                      + (" (an operation on it is running)" if name in self._held
                                         else ""))
            self._held[name] = None
        try:
            self._withdraw(holding)
        finally:
            self._settle(name, None)

    def _withdraw(self, holding: _Holding, quiet: bool = False) -> None:
        info = holding.info
        base = HOLDERS + info.object_id
        try:
            self._dir.remove(base, self.segment)
            last = not holding.is_provider and not any(
                self._alive(m) for m, _ in self._dir.entries(base))
            if holding.is_provider or last:
                raw = self._meta.get(OBJECTS + info.name)
                if raw is not None and _decode_record(info.name, raw).object_id == info.object_id:
                    self._meta.delete(OBJECTS + info.name)
                self._dir.destroy(base)
        except MooncakeError as exc:
            if not quiet:
                raise
            log.warning("could not unpublish P2P object %s: %s", info.name, exc)
        finally:
            self._release(holding.regions)
        log.info("%s P2P object %s", "withdrew" if holding.is_provider else "stopped serving",
                 info.name)

    def held(self) -> list[str]:
        """Names this node currently holds (registered or fetched with ``serve``)."""
        with self._lock:
            return sorted(n for n, h in self._held.items() if h is not None)

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("the P2P store is closed")

    def close(self) -> None:
        """Unregister everything held, then close the metadata client (and our own engine).

        Idempotent; errors while unpublishing are logged. Blocks.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            held, self._held = self._held, {}
        for holding in held.values():
            if holding is not None:
                try:
                    self._withdraw(holding, quiet=True)
                except MooncakeError as exc:
                    log.warning("could not release P2P object %s: %s", holding.info.name, exc)
        self._meta.close()
        if self._owns_engine:
            self.engine.close()

    def __enter__(self) -> P2PStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"P2PStore on {getattr(self, 'segment', '?')!r} was not closed",
                          ResourceWarning, stacklevel=2)


__all__ = ["HolderInfo", "ObjectInfo", "P2PStore", "ReadReport"]
