"""A pool of registered host buffers for zero-copy ``put_from``/``get_into`` on a StoreClient.

:class:`BufferPool` leases byte ranges that the client's transfer engine can read and write
directly. Leases come first from one *local buffer* (``local_buffer_nbytes``, allocated and
registered when the pool is made, carved with a first-fit allocator on 64-byte
boundaries); when it is full, from *overflow* regions mapped on demand (aligned to
``alignment``), registered for the lease and unregistered when it is released. All leases
together stay within ``max_bytes`` and, if set, ``max_regions``: past that, ``acquire``
waits for a release, up to a timeout, or fails at once when not blocking.

A lease's ``buffer`` is a memoryview of its bytes; the lease cannot be released while such
a view (or a slice of it) is alive, so no view outlives the memory's lease. A lease that is
garbage-collected is released.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidParams, NoAvailableSpace, RegionBusy
from ..transfer.engine import ManagedBuffer
from .allocation import OffsetAllocator
from .client import StoreClient

DEFAULT_MIN_SIZE_CLASS = 64 << 10
DEFAULT_ALIGNMENT = 8 << 20
_MIN_ALIGNMENT = ctypes.sizeof(ctypes.c_void_p)


@dataclass
class _Overflow:
    """One overflow region: its mapping and the aligned address registered inside it."""

    mapping: mmap.mmap
    address: int
    nbytes: int


class BufferLease:
    """``size`` bytes at ``ptr`` held from a :class:`BufferPool` until :meth:`release`."""

    def __init__(self, pool: BufferPool, address: int, size: int, block: int,
                 overflow: _Overflow | None) -> None:
        self._pool: BufferPool | None = pool
        self._address = address
        self._size = size
        self._block = block        # bytes counted against the pool's limits
        self._overflow = overflow  # None: a block of the local buffer
        self._window: Any = None   # the ctypes array behind every view handed out

    @property
    def ptr(self) -> int:
        """Address of the first byte."""
        self._check_active()
        return self._address

    @property
    def size(self) -> int:
        """The size asked for (the block behind it may be larger)."""
        return self._size

    @property
    def active(self) -> bool:
        return self._pool is not None

    @property
    def buffer(self) -> memoryview:
        """A writable view of the leased bytes; the lease cannot be released while it lives."""
        self._check_active()
        if self._window is None:
            window = (ctypes.c_char * self._size).from_address(self._address)
            window._lease = self  # views keep the lease, hence its memory, alive
            self._window = window
        return memoryview(self._window).cast("B")

    def exported_views(self) -> int:
        """How many views from :attr:`buffer` (with their slices) are alive."""
        if self._window is None:
            return 0
        # Every live view holds the window once (slices share their parent's hold);
        # the rest are our attribute and getrefcount's argument.
        return sys.getrefcount(self._window) - 2

    def release(self) -> None:
        """Give the bytes back to the pool. Idempotent.

        Raises:
            RegionBusy: a view from :attr:`buffer` is still alive.
        """
        if self._pool is None:
            return
        views = self.exported_views()
        if views:
            raise RegionBusy(f"cannot release buffer while exported views exist ({views} "
                             "alive); release or delete them first")
        self._drop()

    def _drop(self) -> None:
        pool, self._pool = self._pool, None
        if self._window is not None:
            self._window._lease = None
            self._window = None
        if pool is not None:
            pool._give_back(self)

    def _check_active(self) -> None:
        if self._pool is None:
            raise InvalidParams("buffer lease is closed")

    def __enter__(self) -> BufferLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        # Reached only once no view is alive (views reference the lease).
        if getattr(self, "_pool", None) is not None:
            self._drop()

    def __repr__(self) -> str:
        state = "active" if self._pool is not None else "released"
        return f"BufferLease(ptr=0x{self._address:x}, size={self._size}, {state})"


class BufferPool:
    """Registered host buffers leased out for zero-copy store calls.

    Args:
        client: the store client whose transfer engine registers the memory.
        local_buffer_nbytes: size of the local buffer served first (> 0).
        max_bytes: bytes leased at once, at least the local buffer (0: twice the local
            buffer).
        min_size_class: smallest block the pool considers (> 0); smaller requests still
            lease exactly what they ask for.
        max_size_class: requests above it are counted as oversize in :meth:`stats`
            (None: ``max_bytes``).
        alignment: alignment of overflow regions (a power of two, at least the pointer
            size); local blocks are 64-byte aligned.
        block_on_exhaustion: whether ``acquire`` waits for a release by default.
        default_timeout: seconds ``acquire`` waits by default (None: forever).
        max_regions: leases held at once (None: no limit).

    Raises:
        InvalidParams: a bad argument.
    """

    def __init__(self, client: StoreClient, local_buffer_nbytes: int, *, max_bytes: int = 0,
                 min_size_class: int = DEFAULT_MIN_SIZE_CLASS,
                 max_size_class: int | None = None, alignment: int = DEFAULT_ALIGNMENT,
                 block_on_exhaustion: bool = True, default_timeout: float | None = None,
                 max_regions: int | None = None) -> None:
        if local_buffer_nbytes <= 0:
            raise InvalidParams("BufferPool requires a store configured with a local buffer")
        if min_size_class <= 0 or alignment <= 0:
            raise InvalidParams("min_size_class and alignment must be positive")
        if alignment < _MIN_ALIGNMENT or alignment & (alignment - 1):
            raise InvalidParams(f"alignment must be a power of two and at least "
                                f"{_MIN_ALIGNMENT}, got {alignment}")
        if max_bytes < 0:
            raise InvalidParams(f"max_bytes must be >= 0, got {max_bytes}")
        if default_timeout is not None and default_timeout < 0:
            raise InvalidParams("timeout must be non-negative")
        if max_regions is not None and max_regions < 0:
            raise InvalidParams(f"max_regions must be >= 0, got {max_regions}")
        self._client = client
        self.max_bytes = max(max_bytes, local_buffer_nbytes) if max_bytes \
            else 2 * local_buffer_nbytes
        self.min_size_class = min_size_class
        self.max_size_class = self.max_bytes if max_size_class is None else max_size_class
        self.alignment = alignment
        self.block_on_exhaustion = block_on_exhaustion
        self.default_timeout = default_timeout
        self.max_regions = max_regions
        self._cond = threading.Condition()
        self._used = 0       # bytes of live leases and of allocations under way
        self._leases = 0     # live leases and allocations under way
        self._closed = False
        self._counts = dict.fromkeys(("acquires", "overflows", "oversize", "waits",
                                      "releases"), 0)
        self._local: ManagedBuffer = client.engine.allocate(local_buffer_nbytes)
        self._allocator = OffsetAllocator(local_buffer_nbytes)

    @property
    def local_buffer_nbytes(self) -> int:
        return self._local.nbytes

    def acquire(self, size: int, block: bool | None = None,
                timeout: float | None = None) -> BufferLease:
        """Lease ``size`` bytes (0 is allowed).

        Args:
            block: wait for room (default: ``block_on_exhaustion``).
            timeout: seconds to wait at most (default: ``default_timeout``).

        Raises:
            InvalidParams: a negative size, one above ``max_bytes``, a negative timeout,
                or a closed pool.
            NoAvailableSpace: no room and not blocking, or none within ``timeout``.
        """
        if not isinstance(size, int) or size < 0:
            raise InvalidParams(f"size must be a non-negative int, got {size!r}")
        block = self.block_on_exhaustion if block is None else block
        timeout = self.default_timeout if timeout is None else timeout
        if timeout is not None and timeout < 0:
            raise InvalidParams("timeout must be non-negative")
        need = max(size, 1)
        if need > self.max_bytes:
            raise InvalidParams(f"requested buffer size {size} exceeds pool capacity "
                                f"({self.max_bytes} bytes)")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._check_open()
                if self._has_room(need):
                    break
                if not block:
                    raise NoAvailableSpace("buffer pool is exhausted")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise NoAvailableSpace(f"timed out after {timeout} s waiting for a "
                                           "buffer: the buffer pool is exhausted")
                self._counts["waits"] += 1
                self._cond.wait(left)
            self._used += need
            self._leases += 1
            self._counts["acquires"] += 1
            self._counts["oversize"] += size > self.max_size_class
            offset = self._allocator.allocate(need)
        if offset is not None:
            return BufferLease(self, self._local.address + offset, size, need, None)
        try:
            overflow = self._map_overflow(need)
        except BaseException:
            self._unreserve(need)
            raise
        with self._cond:
            self._counts["overflows"] += 1
        return BufferLease(self, overflow.address, size, need, overflow)

    buffer = acquire  # the original's second name for acquire

    def prewarm(self, size: int, count: int) -> None:
        """Fault in the local buffer's pages for ``count`` leases of ``size`` bytes, so the
        first leases do not pay page faults."""
        if size < 0 or count < 0:
            raise InvalidParams("size and count must be non-negative")
        nbytes = min(size * count, self._local.nbytes)
        if nbytes:
            ctypes.memset(self._local.address, 0, nbytes)

    def stats(self) -> dict[str, int]:
        """Counters: acquires, overflows, oversize, waits, releases, and bytes/leases in use."""
        with self._cond:
            return {**self._counts, "used_bytes": self._used, "active_leases": self._leases}

    def close(self) -> None:
        """Free the local buffer. Idempotent.

        Raises:
            RegionBusy: a lease is still active (release it first; the pool stays open).
        """
        with self._cond:
            if self._closed:
                return
            if self._leases:
                raise RegionBusy(f"cannot close buffer pool with active leases "
                                 f"({self._leases})")
            self._closed = True
            self._cond.notify_all()
        self._client.engine.free(self._local)

    def __enter__(self) -> BufferPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------
    def _has_room(self, need: int) -> bool:
        if self._used + need > self.max_bytes:
            return False
        return self.max_regions is None or self._leases < self.max_regions

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidParams("buffer pool is closed")

    def _unreserve(self, need: int) -> None:
        with self._cond:
            self._used -= need
            self._leases -= 1
            self._cond.notify_all()

    def _map_overflow(self, nbytes: int) -> _Overflow:
        """Map ``nbytes`` at ``alignment`` and register them with the client's engine."""
        slack = max(0, self.alignment - mmap.PAGESIZE)
        try:
            mapping = mmap.mmap(-1, nbytes + slack)
        except OSError as exc:
            raise NoAvailableSpace(f"cannot map a {nbytes}-byte overflow buffer: "
                                   f"{exc.strerror or exc}") from exc
        try:
            base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
            address = (base + self.alignment - 1) & ~(self.alignment - 1)
            self._client.register_buffer(address, nbytes)
        except BaseException:
            mapping.close()
            raise
        return _Overflow(mapping, address, nbytes)

    def _give_back(self, lease: BufferLease) -> None:
        overflow = lease._overflow
        if overflow is None:
            with self._cond:
                self._allocator.free(lease._address - self._local.address, lease._block)
        else:
            try:
                self._client.unregister_buffer(overflow.address)
            finally:
                overflow.mapping.close()
        with self._cond:
            self._counts["releases"] += 1
        self._unreserve(lease._block)
