"""``setup_dummy``: the standalone-store (dummy) client mode of ``MooncakeDistributedStore``.

After ``setup_dummy`` the store's client is a :class:`DummyClient`, which offers the
operations of :class:`StoreClient`; every other method works unchanged through it.
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import InvalidParams, MooncakeError
from ..store.local import DummyClient

log = logging.getLogger("mooncake_plugins.compat.store")


class _DummyMethods:
    """Mixed into :class:`mooncake_plugins.compat.store.MooncakeDistributedStore`."""

    _client: Any

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Use the ``mooncake_client`` at ``server_address`` (0 or a negative code)."""
        try:
            if self._client is not None:
                raise InvalidParams("this store is set up already")
            self._client = DummyClient(server_address, local_buffer_size=int(local_buffer_size),
                                       mem_pool_size=int(mem_pool_size))
            return 0
        except MooncakeError as exc:
            log.error("setup_dummy failed: %s", exc)
            return exc.code if exc.code < 0 else -1

    def alloc_from_mem_pool(self, size: int) -> int:
        """Address of ``size`` bytes of memory shared with the host (0 on failure)."""
        if not isinstance(self._client, DummyClient):
            log.error("alloc_from_mem_pool needs setup_dummy")
            return 0
        try:
            return self._client.alloc_from_mem_pool(int(size))
        except (MooncakeError, OSError) as exc:
            log.error("alloc_from_mem_pool(%s) failed: %s", size, exc)
            return 0
