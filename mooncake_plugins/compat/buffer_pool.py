"""The original's ``BufferPool`` (``mooncake.buffer_pool``) over a MooncakeDistributedStore.

The pool is :class:`mooncake_plugins.store.buffer_pool.BufferPool` on the store's client,
its local buffer sized by ``setup(..., local_buffer_size, ...)``. As in the original, every
error is a ``RuntimeError`` (with our message), and ``RegisteredBufferPool`` is the same
class.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import MooncakeError
from ..store import buffer_pool as _core
from .store import MooncakeDistributedStore

_F = TypeVar("_F", bound=Callable[..., Any])


def _runtime_errors(fn: _F) -> _F:
    """Raise our errors as the RuntimeError the original raises."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MooncakeError as exc:
            raise RuntimeError(str(exc)) from exc
    return call  # type: ignore[return-value]


class BufferLease:
    """``size`` bytes at ``ptr`` leased from a :class:`BufferPool`; ``buffer`` views them."""

    def __init__(self, lease: _core.BufferLease) -> None:
        self._lease = lease

    @property
    @_runtime_errors
    def ptr(self) -> int:
        return self._lease.ptr

    @property
    def size(self) -> int:
        return self._lease.size

    @property
    @_runtime_errors
    def buffer(self) -> memoryview:
        return self._lease.buffer

    @_runtime_errors
    def release(self) -> None:
        self._lease.release()

    def __enter__(self) -> BufferLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return repr(self._lease)


class BufferPool:
    """Registered host buffers for zero-copy ``put_from``/``get_into`` (the original's API).

    ``store`` must be set up with a ``local_buffer_size`` > 0. ``prewarm_size`` and
    ``prewarm_count`` call :meth:`prewarm` once made.
    """

    @_runtime_errors
    def __init__(self, store: MooncakeDistributedStore, max_bytes: int = 0,
                 min_size_class: int = _core.DEFAULT_MIN_SIZE_CLASS,
                 max_size_class: int | None = None, alignment: int = _core.DEFAULT_ALIGNMENT,
                 block_on_exhaustion: bool = True, default_timeout: float | None = None,
                 max_regions: int | None = None, prewarm_size: int | None = None,
                 prewarm_count: int = 0) -> None:
        if not isinstance(store, MooncakeDistributedStore) or store._client is None:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        self._pool = _core.BufferPool(
            store.client, store._local_buffer_size, max_bytes=max_bytes,
            min_size_class=min_size_class, max_size_class=max_size_class, alignment=alignment,
            block_on_exhaustion=block_on_exhaustion, default_timeout=default_timeout,
            max_regions=max_regions)
        if prewarm_size is not None and prewarm_count > 0:
            self._pool.prewarm(prewarm_size, prewarm_count)

    @_runtime_errors
    def acquire(self, size: int, block: bool | None = None,
                timeout: float | None = None) -> BufferLease:
        """Lease ``size`` bytes; waits for room if ``block`` (default: block_on_exhaustion)."""
        if size >= 1 << 64:
            raise RuntimeError("requested buffer size overflows size_t")
        return BufferLease(self._pool.acquire(size, block, timeout))

    buffer = acquire

    @_runtime_errors
    def prewarm(self, size: int, count: int) -> None:
        self._pool.prewarm(size, count)

    @_runtime_errors
    def close(self) -> None:
        self._pool.close()


RegisteredBufferPool = BufferPool
RegisteredBufferLease = BufferLease

__all__ = ["BufferLease", "BufferPool", "RegisteredBufferLease", "RegisteredBufferPool"]
