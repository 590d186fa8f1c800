"""Redis metadata backend (redis-py).

Keys are stored exactly as given (UTF-8), values as raw bytes, in the database chosen by
the URL (``redis://host:port/db``, default 0). A prefix is listed with SCAN ... MATCH (the
prefix's glob characters escaped), then MGET in batches.
"""

from __future__ import annotations

import logging
import math
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

_log = logging.getLogger(__name__)

# Keys asked for per SCAN step and per MGET: bounds each command's reply.
_SCAN_BATCH = 1000
_GLOB_SPECIALS = frozenset("*?[]\\")


def _match_pattern(prefix: str) -> bytes:
    """A SCAN MATCH pattern for the keys starting with ``prefix``, matched literally."""
    escaped = "".join("\\" + c if c in _GLOB_SPECIALS else c for c in prefix)
    return (escaped + "*").encode("utf-8")


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

    def _put(self, key: str, value: bytes, ttl_s: float | None) -> None:
        try:
            self._client.set(key, value, px=None if ttl_s is None else math.ceil(ttl_s * 1000))
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

    def _list_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        try:
            # SCAN may return a key more than once; the set folds the repeats.
            keys = sorted(set(self._client.scan_iter(match=_match_pattern(prefix),
                                                     count=_SCAN_BATCH)))
            out = []
            for i in range(0, len(keys), _SCAN_BATCH):
                batch = keys[i:i + _SCAN_BATCH]
                for raw_key, value in zip(batch, self._client.mget(batch)):
                    if value is None:  # deleted since SCAN saw it (or not a string)
                        continue
                    try:
                        out.append((raw_key.decode("utf-8"), value))
                    except UnicodeDecodeError:
                        _log.debug("redis %s: skipping a non-UTF-8 key under %r",
                                   self.url, prefix)
        except redis.RedisError as exc:
            raise self._fail("list", prefix, exc) from exc
        return out

    def _close(self) -> None:
        self._client.close()
