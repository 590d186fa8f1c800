"""The dummy side: store operations over a host's RPC, with memory shared as sealed memfds."""

from __future__ import annotations

import bisect
import fcntl
import mmap
import os
import socket
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import msgpack

from ...errors import (AddressError, InvalidParams, ProtocolError, RpcFailed, StoreError,
                       store_error)
from ...transfer import memory
from ...transfer.protocol import unpack_bounded
from ..allocation import OffsetAllocator
from ..client import ReplicateConfig, DerivedForms
from ..rpc import RpcClient
from .common import CONTROL_MSG_NBYTES, flatten


_MMAP_KW = {"trackfd": False} if sys.version_info >= (3, 13) else {}
"""Our own descriptor is enough: no duplicate for the mapping where Python allows it."""


class _Segment:
    """A sealed memfd of this process and its mapping here; ``mapped``: the host maps it too.

    The mapping is held by an :class:`Export`, so views of it (``view``) keep it mapped
    past ``close``: the last one's release unmaps it.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.mapped = False
        self.fd = os.memfd_create("mooncake-dummy", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map: mmap.mmap | None = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE, **_MMAP_KW)
        except BaseException:
            os.close(self.fd)
            raise
        self._export = memory.Export(self._map, True)
        self.address: int = self._export.address

    def view(self, address: int, nbytes: int) -> memoryview:
        """A writable view of ``[address, address+nbytes)``, keeping the memory mapped.

        Raises:
            AddressError: the segment was closed.
        """
        try:
            return memory.view_of(self._export, address, nbytes)
        except BufferError:
            raise AddressError(f"0x{address:x}+{nbytes}: the memory was freed") from None

    def close(self) -> None:
        """Free the memory, or leave that to the last view's release."""
        self._export.release()
        try:
            self._map.close()
        except BufferError:
            pass  # views are alive: the last one's release frees the mmap, which unmaps
        self._map = None
        os.close(self.fd)


class DummyClient(DerivedForms):
    """The store operations of :class:`StoreClient`, served by a :class:`DummyHost`.

    Args:
        server_address: ``host:port`` of the host (it must run on this machine).
        local_buffer_size: shared staging memory for puts of values and gets of bytes
            (0: each such call maps a temporary buffer instead).
        mem_pool_size: cap on the bytes :meth:`alloc_from_mem_pool` hands out (0: no cap).

    Buffers passed to ``put_from``/``get_into`` must lie in memory from
    :meth:`alloc_from_mem_pool` registered with :meth:`register_buffer`.

    Raises:
        RpcFailed (host unreachable), InvalidParams.
    """

    def __init__(self, server_address: str, local_buffer_size: int = 0, mem_pool_size: int = 0,
                 timeout_s: float = 60.0) -> None:
        host, sep, port = server_address.rpartition(":")
        if not sep or not port.isdigit():
            raise InvalidParams(f"server address must be host:port, got {server_address!r}")
        if local_buffer_size < 0 or mem_pool_size < 0:
            raise InvalidParams("local_buffer_size and mem_pool_size must be >= 0")
        self.mem_pool_size = mem_pool_size
        self._pool_used = 0
        self._segments: dict[int, _Segment] = {}   # by address
        self._bases: list[int] = []
        self._lock = threading.Lock()               # segments, the allocator, the pool
        self._control_lock = threading.Lock()
        self._register_lock = threading.Lock()
        self._closed = False
        self._local: _Segment | None = None
        self._local_alloc: OffsetAllocator | None = None
        self._rpc = RpcClient(host.strip("[]"), int(port), timeout_s=timeout_s)
        self._control: socket.socket | None = None
        try:
            info = self._rpc.call("hello")
            self.segment_name: str = info["segment"]
            self._control = socket.socket(socket.AF_UNIX,
                                          socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            self._control.settimeout(timeout_s)
            try:
                self._control.connect(info["control"])
            except OSError as exc:
                raise RpcFailed(f"the host at {server_address} is not on this machine "
                                f"(its control socket is unreachable: {exc})") from None
            self._session = self._greeting(self._control)
            if local_buffer_size:
                self._local = self._new_segment(local_buffer_size)
                self._map(self._local)
                self._local_alloc = OffsetAllocator(local_buffer_size)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _greeting(control: socket.socket) -> str:
        """The session token in the host's first control message.

        Raises:
            RpcFailed: none came, or it is not ``{"session": <token>}``.
        """
        try:
            msg = unpack_bounded(control.recv(CONTROL_MSG_NBYTES), 1, max_map_len=1,
                                 max_str_len=64)
        except (OSError, ProtocolError) as exc:
            raise RpcFailed(f"the host sent a malformed session greeting: {exc}") from None
        token = msg.get("session") if isinstance(msg, dict) else None
        if not isinstance(token, str) or not token:
            raise RpcFailed(f"the host sent a malformed session greeting: {msg!r:.100}")
        return token

    # -- shared memory --------------------------------------------------------------------
    def _new_segment(self, nbytes: int) -> _Segment:
        seg = _Segment(max(nbytes, 1))
        with self._lock:
            self._segments[seg.address] = seg
            bisect.insort(self._bases, seg.address)
        return seg

    def _drop_segment(self, seg: _Segment) -> None:
        try:
            if seg.mapped:
                self._unmap(seg)
        finally:  # the host's mapping, if any, is its own: ours can go regardless
            with self._lock:  # whoever takes it out of the table closes it (or close() did)
                owned = self._segments.get(seg.address) is seg
                if owned:
                    del self._segments[seg.address]
                    self._bases.remove(seg.address)
            if owned:
                seg.close()

    def _control_call(self, msg: dict, fds: list[int]) -> None:
        with self._control_lock:
            if self._control is None:
                raise RpcFailed("the dummy client is closed")
            try:
                socket.send_fds(self._control, [msgpack.packb(msg)], fds)
                reply = msgpack.unpackb(self._control.recv(CONTROL_MSG_NBYTES))
            except (OSError, ValueError) as exc:
                # a late reply would answer the next request: end the session instead
                self._control.close()
                self._control = None
                raise RpcFailed(f"control channel to the host failed: {exc}") from None
        if reply["code"]:
            raise store_error(reply["code"], reply.get("error", ""))

    def _map(self, seg: _Segment) -> None:
        self._control_call({"op": "map", "base": seg.address, "nbytes": seg.nbytes}, [seg.fd])
        seg.mapped = True

    def _unmap(self, seg: _Segment) -> None:
        self._control_call({"op": "unmap", "base": seg.address}, [])
        seg.mapped = False

    def _segment_of(self, address: int, nbytes: int) -> _Segment | None:
        with self._lock:
            i = bisect.bisect_right(self._bases, address) - 1
            seg = self._segments[self._bases[i]] if i >= 0 else None
        if seg is None or address + nbytes > seg.address + seg.nbytes:
            return None
        return seg

    def alloc_from_mem_pool(self, nbytes: int) -> int:
        """Address of ``nbytes`` of fresh shared memory (usable once registered; it lives
        until :meth:`close`)."""
        if nbytes <= 0:
            raise InvalidParams("size must be > 0")
        with self._lock:
            if self.mem_pool_size and self._pool_used + nbytes > self.mem_pool_size:
                raise InvalidParams(f"mem pool of {self.mem_pool_size} bytes is exhausted "
                                    f"({self._pool_used} used)")
            self._pool_used += nbytes
        try:
            return self._new_segment(nbytes).address
        except BaseException:
            with self._lock:
                self._pool_used -= nbytes
            raise

    def register_buffer(self, address: int, nbytes: int) -> None:
        """Let the host use ``[address, address+nbytes)`` of a pool allocation."""
        seg = self._segment_of(address, nbytes)
        if seg is None or seg is self._local:
            raise InvalidParams(f"0x{address:x}+{nbytes} is not inside memory from "
                                "alloc_from_mem_pool")
        with self._register_lock:
            if not seg.mapped:
                self._map(seg)

    def unregister_buffer(self, address: int) -> None:
        with self._register_lock:
            with self._lock:
                seg = self._segments.get(address)
            if seg is None or not seg.mapped or seg is self._local:
                raise InvalidParams(f"0x{address:x} is not a registered buffer")
            self._unmap(seg)

    @contextmanager
    def _staging(self, sizes: Sequence[int]) -> Iterator[list[int]]:
        """Addresses of room for ``sizes`` in the local buffer (or a temporary one); the
        memory stays mapped until the block ends, even if :meth:`close` runs meanwhile."""
        addrs: list[int | None] = [None] * len(sizes)
        taken: list[tuple[int, int]] = []
        pins: list[memoryview] = []
        temp = None
        try:
            with self._lock:
                for i, n in enumerate(sizes):
                    if n == 0:
                        addrs[i] = 0
                    elif self._local_alloc is not None:
                        off = self._local_alloc.allocate(n)
                        if off is not None:
                            taken.append((off, n))
                            addrs[i] = self._local.address + off
            if taken:
                pins.append(self._local.view(self._local.address, self._local.nbytes))
            rest = [i for i, a in enumerate(addrs) if a is None]
            if rest:
                temp = self._new_segment(sum(sizes[i] for i in rest))
                pins.append(temp.view(temp.address, temp.nbytes))
                self._map(temp)
                off = temp.address
                for i in rest:
                    addrs[i], off = off, off + sizes[i]
            yield addrs
        finally:
            for pin in pins:
                pin.release()
            if taken:
                with self._lock:
                    for off, n in taken:
                        self._local_alloc.free(off, n)
            if temp is not None:
                self._drop_segment(temp)

    def local_view(self, address: int, nbytes: int) -> memoryview:
        """A writable view of this client's registered or pool memory (as StoreClient's).

        Raises:
            AddressError: the range is not inside one of them.
        """
        seg = self._segment_of(address, nbytes)
        if seg is None:
            raise AddressError(f"0x{address:x}+{nbytes} is not inside a registered buffer "
                               "or the memory pool")
        return seg.view(address, nbytes)

    # -- puts ---------------------------------------------------------------------------------
    def batch_put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Any]],
                        config: ReplicateConfig | None = None,
                        upsert: bool = False) -> list[StoreError | None]:
        """Each object's parts are copied once, joined, into shared memory."""
        if len(keys) != len(parts):
            raise InvalidParams("keys and parts differ in length")
        sources = [[memory.address_of(p) for p in ps] for ps in parts]
        sizes = [sum(n for _, n in src) for src in sources]
        with self._staging(sizes) as addrs:
            copies = []
            for dst, src in zip(addrs, sources):
                for address, n in src:
                    if n:
                        copies.append((dst, address, n))
                    dst += n
            memory.copy_many(copies)
            return self.batch_put_from(keys, addrs, sizes, config, upsert)

    def batch_put(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None, upsert: bool = False) -> list[StoreError | None]:
        """Values are copied into shared memory once; the host writes them from there."""
        if len(keys) != len(values):
            raise InvalidParams("keys and values differ in length")
        sources = [memory.address_of(v) for v in values]
        sizes = [n for _, n in sources]
        with self._staging(sizes) as addrs:
            memory.copy_many([(d, s, n) for d, (s, n) in zip(addrs, sources) if n])
            return self.batch_put_from(keys, addrs, sizes, config, upsert)

    def batch_put_from_parts(self, keys: Sequence[str], parts: Sequence[Sequence[tuple[int, int]]],
                             config: ReplicateConfig | None = None,
                             upsert: bool = False) -> list[StoreError | None]:
        if len(keys) != len(parts):
            raise InvalidParams("keys and parts differ in length")
        if not keys:
            return []
        cfg = config or ReplicateConfig()
        out = self._rpc.call("put", session=self._session, keys=list(keys), **flatten(parts),
                             config={"replica_num": cfg.replica_num,
                                     "preferred_segments": list(cfg.preferred_segments),
                                     "with_soft_pin": cfg.with_soft_pin}, upsert=upsert)
        return [store_error(code, msg) if code else None for code, msg in out]

    # -- gets ---------------------------------------------------------------------------------
    def batch_get(self, keys: Sequence[str]) -> list[bytes | StoreError]:
        """Objects' bytes: the host reads them into shared memory, copied out here once."""
        keys = list(keys)
        out: list[Any] = [None] * len(keys)
        found = []
        for i, r in enumerate(self.replicas(keys)):
            if isinstance(r, Exception):
                out[i] = r
            else:
                found.append((i, r[0]))
        if not found:
            return out
        with self._staging([n for _, n in found]) as addrs:
            got = self.batch_get_into([keys[i] for i, _ in found], addrs, [n for _, n in found])
            for (i, _), address, r in zip(found, addrs, got):
                if isinstance(r, Exception):
                    out[i] = r
                else:
                    with self.local_view(address, r) if r else memoryview(b"") as mv:
                        out[i] = bytes(mv)
        return out

    def batch_get_into(self, keys: Sequence[str], addresses: Sequence[int],
                       sizes: Sequence[int]) -> list[int | StoreError]:
        if not len(keys) == len(addresses) == len(sizes):
            raise InvalidParams("keys, addresses and sizes differ in length")
        return self.batch_get_into_parts(keys, [[(a, n)] for a, n in zip(addresses, sizes)])

    def batch_get_into_parts(self, keys: Sequence[str],
                             parts: Sequence[Sequence[tuple[int, int]]]) -> list[int | StoreError]:
        if len(keys) != len(parts):
            raise InvalidParams("keys and parts differ in length")
        if not keys:
            return []
        out = self._rpc.call("get_into", session=self._session, keys=list(keys), **flatten(parts))
        return [value if code == 0 else store_error(code, value) for code, value in out]

    # -- queries and removal ------------------------------------------------------------------
    def replicas(self, keys: Sequence[str]) -> list[tuple[int, list, str | None] | StoreError]:
        out = self._rpc.call("replicas", keys=list(keys)) if keys else []
        return [tuple(value) if code == 0 else store_error(code, value) for code, value in out]

    def exists(self, key: str) -> bool:
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return [bool(x) for x in self._rpc.call("exist", keys=list(keys))] if keys else []

    def size(self, key: str) -> int:
        r = self.replicas([key])[0]
        if isinstance(r, Exception):
            raise r
        return r[0]

    def remove(self, key: str, force: bool = False) -> None:
        self._raise(self.batch_remove([key], force)[0])

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[StoreError | None]:
        out = self._rpc.call("remove", keys=list(keys), force=force) if keys else []
        return [store_error(code, msg) if code else None for code, msg in out]

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        return self._rpc.call("remove_by_regex", pattern=pattern, force=force)

    def remove_all(self, force: bool = False) -> int:
        return self._rpc.call("remove_all", force=force)

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """End the session (the host lets go of our memory) and free it here."""
        if self._closed:
            return
        self._closed = True
        with self._control_lock:
            control, self._control = self._control, None
        if control is not None:
            control.close()
        self._rpc.close()
        with self._lock:
            segments = list(self._segments.values())
            self._segments.clear()
            self._bases.clear()
        for seg in segments:
            seg.close()

    def __enter__(self) -> "DummyClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
