"""A store client that an engine can live without.

vLLM must keep serving when the store is down: every call through :class:`StoreLink`
either reaches the store or fails fast (the caller recomputes), and a client that could
not be created is tried again at most every ``retry_s`` seconds, so a master that comes
back (or starts after the engine) is picked up without a restart.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from mooncake_plugins.errors import MooncakeError
from mooncake_plugins.store.client import StoreClient

from .config import StoreSettings

log = logging.getLogger(__name__)


class StoreLink:
    """Creates the :class:`StoreClient` on first use; ``None`` while the store is out.

    Args:
        settings: where the store is.
        segment_size: bytes this process lends to the pool (0 for a lookup-only client).
        on_connect: called with each new client (e.g. to register the KV cache memory).
        retry_s: the least time between two connection attempts.
    """

    def __init__(self, settings: StoreSettings, segment_size: int, who: str,
                 on_connect: Callable[[StoreClient], None] | None = None,
                 retry_s: float = 5.0) -> None:
        self._settings = settings
        self._segment_size = segment_size
        self._who = who
        self._on_connect = on_connect
        self._retry_s = retry_s
        self._client: StoreClient | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()
        self._closed = False

    def get(self) -> StoreClient | None:
        """The client, connecting first if due; None if the store cannot be reached."""
        client = self._client
        if client is not None or self._closed:
            return client
        with self._lock:
            if self._client is None and not self._closed and time.monotonic() >= self._next_try:
                self._connect()
            return self._client

    def _connect(self) -> None:
        s = self._settings
        try:
            client = StoreClient(
                s.master_server_address, local_hostname=s.local_hostname,
                metadata_server=s.metadata_server, global_segment_size=self._segment_size,
                protocol=s.protocol, rpc_timeout_s=s.rpc_timeout_s,
                transfer_timeout_s=s.transfer_timeout_s, failover_timeout_s=s.rpc_timeout_s)
        except (MooncakeError, OSError) as exc:
            self._next_try = time.monotonic() + self._retry_s
            log.warning("%s: store at %s unreachable (%s); serving without it, next try in "
                        "%.0f s", self._who, s.master_server_address, exc, self._retry_s)
            return
        try:
            if self._on_connect is not None:
                self._on_connect(client)
        except BaseException:
            client.close()
            raise
        log.info("%s: connected to the store at %s (segment %d bytes)", self._who,
                 s.master_server_address, self._segment_size)
        self._client = client

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()
