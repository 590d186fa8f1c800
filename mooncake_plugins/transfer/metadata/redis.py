"""Redis metadata backend (redis-py).

Keys are stored exactly as given (UTF-8), values as raw bytes, in the database chosen by
the URL (``redis://host:port/db``, default 0).
"""

from __future__ import annotations

from typing import cast

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from mooncake_plugins.errors import MetadataError
from mooncake_plugins.transfer.metadata.base import (
    DEFAULT_TIMEOUT_S,
    MetadataStore,
    MetadataTarget,
)


class RedisMetadataStore(MetadataStore):
    """Metadata store in a Redis server.

    redis-py's connection pool makes the store safe to share between threads. A call
    that loses its connection is retried once at once (a pooled connection may have
    gone stale), so it blocks for at most about ``2 * timeout_s``.
    """

    def __init__(self, host: str, port: int, db: int = 0,
                 timeout_s: float = DEFAULT_TIMEOUT_S, url: str | None = None) -> None:
        """Args: host, port, db: the Redis server and database; url: the name used in messages."""
        super().__init__(url or f"redis://{host}:{port}/{db}")
        self._client = redis.Redis(host=host, port=port, db=db, socket_timeout=timeout_s,
                                   socket_connect_timeout=timeout_s,
                                   retry=Retry(NoBackoff(), retries=1))

    @classmethod
    def from_target(cls, target: MetadataTarget, timeout_s: float) -> RedisMetadataStore:
        """Build a client for a parsed ``redis://`` URL."""
        return cls(target.host, target.port, target.db, timeout_s, url=target.url)

    def _fail(self, op: str, key: str, exc: redis.RedisError) -> MetadataError:
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            return MetadataError(
                f"redis {self.url} unreachable during {op} {key!r}; check that "
                f"redis-server runs and the URL is right ({exc})")
        return MetadataError(f"redis {self.url}: {op} {key!r} failed: {exc}")

    def _put(self, key: str, value: bytes) -> None:
        try:
            self._client.set(key, value)
        except redis.RedisError as exc:
            raise self._fail("put", key, exc) from exc

    def _get(self, key: str) -> bytes | None:
        try:
            value = self._client.get(key)
        except redis.RedisError as exc:
            raise self._fail("get", key, exc) from exc
        return cast("bytes | None", value)  # the client does not decode replies

    def _delete(self, key: str) -> None:
        try:
            self._client.delete(key)
        except redis.RedisError as exc:
            raise self._fail("delete", key, exc) from exc

    def _close(self) -> None:
        self._client.close()
