"""etcd v3 metadata backend over etcd's HTTP/JSON gateway (the ``etcd3gw`` package).

Keys are stored exactly as given (UTF-8), values as raw bytes; a prefix is listed with one
range request (a snapshot at one revision). etcd refuses requests larger than its
``--max-request-bytes`` (1.5 MiB by default); serving values up to the store's 16 MiB limit
needs that flag raised on the etcd server.
"""

from __future__ import annotations

import logging
import math
import threading

import etcd3gw
import requests
from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception

from mooncake_plugins.errors import MetadataError
from mooncake_plugins.transfer.metadata.base import (
    DEFAULT_TIMEOUT_S,
    MetadataStore,
    MetadataTarget,
)

_log = logging.getLogger(__name__)


def _prefix_range_end(prefix: bytes) -> bytes:
    """The smallest key above every key starting with ``prefix`` (etcd's range end).

    etcd3gw's own ``get_prefix`` builds it through str and latin-1, which breaks on
    non-ASCII prefixes, so it is computed here on bytes. b"\\0" means "to the end".
    """
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


class EtcdMetadataStore(MetadataStore):
    """Metadata store in an etcd v3 cluster member.

    Calls are serialized by one lock (the underlying ``requests.Session`` is not
    documented as thread-safe); each blocks for at most ``timeout_s`` per HTTP request.
    """

    def __init__(self, host: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                 url: str | None = None) -> None:
        """Args: host, port: an etcd client endpoint; url: the name used in messages."""
        super().__init__(url or f"etcd://{host}:{port}")
        session = requests.Session()
        session.trust_env = False  # the metadata service is reached directly, not via proxies
        self._client = etcd3gw.Etcd3Client(host=host, port=port, timeout=timeout_s,
                                           session=session)
        self._lock = threading.Lock()

    @classmethod
    def from_target(cls, target: MetadataTarget, timeout_s: float) -> EtcdMetadataStore:
        """Build a client for a parsed ``etcd://`` or bare ``host:port`` URL."""
        return cls(target.host, target.port, timeout_s, url=target.url)

    def _fail(self, op: str, key: str, exc: Exception) -> MetadataError:
        detail = str(getattr(exc, "detail_text", None) or exc)[:300]
        if isinstance(exc, (ConnectionFailedError, ConnectionTimeoutError)):
            return MetadataError(
                f"etcd {self.url} unreachable during {op} {key!r}; check that etcd runs "
                f"and the URL is right ({type(exc).__name__}: {detail})")
        hint = ""
        if "request is too large" in detail or "larger than max" in detail:
            hint = "; raise the etcd server's --max-request-bytes"
        return MetadataError(f"etcd {self.url}: {op} {key!r} failed: {detail}{hint}")

    def _put(self, key: str, value: bytes, ttl_s: float | None) -> None:
        try:
            with self._lock:
                # a renewal grants a fresh lease; the previous one expires unused
                lease = None if ttl_s is None else self._client.lease(math.ceil(ttl_s))
                self._client.put(key.encode("utf-8"), value, lease=lease)
        except (Etcd3Exception, requests.RequestException, ValueError) as exc:
            raise self._fail("put", key, exc) from exc

    def _get(self, key: str) -> bytes | None:
        try:
            with self._lock:
                values = self._client.get(key.encode("utf-8"))
        except (Etcd3Exception, requests.RequestException, ValueError) as exc:
            raise self._fail("get", key, exc) from exc
        return values[0] if values else None

    def _delete(self, key: str) -> None:
        try:
            with self._lock:
                self._client.delete(key.encode("utf-8"))
        except (Etcd3Exception, requests.RequestException, ValueError) as exc:
            raise self._fail("delete", key, exc) from exc

    def _list_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        start = prefix.encode("utf-8")
        # etcd3gw base64-encodes bytes as they are; its ``str`` annotation is too narrow.
        end: str = _prefix_range_end(start)  # type: ignore[assignment]
        try:
            with self._lock:
                items = self._client.get(start, metadata=True, range_end=end,
                                         sort_order="ascend", sort_target="key")
        except (Etcd3Exception, requests.RequestException, ValueError) as exc:
            raise self._fail("list", prefix, exc) from exc
        out = []
        for value, meta in items:
            try:
                out.append((meta["key"].decode("utf-8"), value))
            except UnicodeDecodeError:
                _log.debug("etcd %s: skipping a non-UTF-8 key under %r", self.url, prefix)
        return out

    def _close(self) -> None:
        with self._lock:
            self._client.session.close()
