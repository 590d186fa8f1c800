"""``mooncake.async_store``: ``MooncakeDistributedStoreAsync``, awaitable store calls.

Every method ``m`` of :class:`~mooncake.store.MooncakeDistributedStore` is also reachable
as ``await store.async_m(...)``: the call runs in the event loop's default executor, so
the loop keeps serving other tasks while the store works (its calls release the GIL on
I/O). Results and return codes are those of ``m``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from mooncake.store import MooncakeDistributedStore

_PREFIX = "async_"


class MooncakeDistributedStoreAsync(MooncakeDistributedStore):
    """The store client with an ``async_<name>`` coroutine for each method ``<name>``."""

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        # only reached for names the class does not define
        if not name.startswith(_PREFIX):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        sync_name = name[len(_PREFIX):]
        method = getattr(self, sync_name, None)
        if method is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}' "
                                 f"(nor '{sync_name}')")
        if not callable(method):
            raise AttributeError(f"'{sync_name}' is not callable")

        @functools.wraps(method)
        async def call(*args: Any, **kwargs: Any) -> Any:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, functools.partial(method, *args, **kwargs))

        setattr(self, name, call)  # built once per name and instance
        return call


__all__ = ["MooncakeDistributedStoreAsync"]
