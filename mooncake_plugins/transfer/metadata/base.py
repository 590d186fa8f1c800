"""The metadata store interface and the URL -> backend dispatch.

A :class:`MetadataStore` maps string keys to opaque byte values (segment descriptors)
and lists the keys under a prefix.
:func:`from_url` picks a backend from a connection string in the original Mooncake's
forms; each backend module is imported only when its scheme is first used, so redis-py
is an optional dependency (``mooncake_plugins[redis]``; etcd3gw comes with the base install).
"""

from __future__ import annotations

import importlib
import logging
import math
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import urlsplit

from mooncake_plugins.errors import InvalidArgument, MetadataError

_log = logging.getLogger(__name__)

MAX_KEY_NBYTES = 1024
MAX_VALUE_NBYTES = 16 * 1024 * 1024
DEFAULT_TIMEOUT_S = 5.0
P2P_HANDSHAKE = "P2PHANDSHAKE"

ACCEPTED_FORMS = (
    "http://host:port/metadata (HTTP metadata server), "
    "etcd://host:port or host:port (etcd v3), "
    "redis://host:port[/db] (Redis), "
    "P2PHANDSHAKE (no server: descriptors exchanged peer to peer)"
)

_DEFAULT_PORTS = {"http": 80, "https": 443, "etcd": 2379, "redis": 6379}


@dataclass(frozen=True)
class MetadataTarget:
    """A parsed metadata connection string.

    Attributes:
        url: the connection string as the user gave it (used in error messages).
        scheme: backend name: ``http``, ``https``, ``etcd`` or ``redis``.
        host: server host name or address (IPv6 without brackets).
        port: server TCP port.
        path: the URL path (``http``/``https`` only, e.g. ``/metadata``), else ``""``.
        db: Redis database index (``redis`` only), else 0.
    """

    url: str
    scheme: str
    host: str
    port: int
    path: str = ""
    db: int = 0


def check_text(text: object, what: str, max_nbytes: int = MAX_KEY_NBYTES) -> None:
    """Raise InvalidArgument unless ``text`` is a non-empty str without NUL whose UTF-8
    form has at most ``max_nbytes`` bytes (``what`` names it in the message)."""
    if not isinstance(text, str):
        raise InvalidArgument(f"{what} must be a str, got {type(text).__name__}")
    if not text:
        raise InvalidArgument(f"{what} must not be empty")
    if "\0" in text:
        raise InvalidArgument(f"{what} must not contain NUL: {text!r}")
    try:
        nbytes = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{what} is not valid UTF-8: {text!r}") from exc
    if nbytes > max_nbytes:
        raise InvalidArgument(
            f"{what} is {nbytes} bytes in UTF-8, the limit is {max_nbytes}")


def check_key(key: object) -> None:
    """Check that ``key`` is a valid metadata key.

    Raises:
        InvalidArgument: not a non-empty str, longer than 1024 bytes in UTF-8,
            not encodable as UTF-8, or containing NUL.
    """
    check_text(key, "metadata key")


def check_prefix(prefix: object) -> None:
    """Check that ``prefix`` is a valid key prefix for :meth:`MetadataStore.list_prefix`.

    The rules are the key rules: listing the whole store (an empty prefix) is not offered.

    Raises:
        InvalidArgument: not a non-empty str, longer than 1024 bytes in UTF-8,
            not encodable as UTF-8, or containing NUL.
    """
    check_text(prefix, "metadata key prefix")


def check_value(value: object) -> None:
    """Check that ``value`` is a valid metadata value.

    Raises:
        InvalidArgument: not ``bytes`` or larger than 16 MiB.
    """
    if not isinstance(value, bytes):
        raise InvalidArgument(f"metadata value must be bytes, got {type(value).__name__}")
    if len(value) > MAX_VALUE_NBYTES:
        raise InvalidArgument(
            f"metadata value is {len(value)} bytes, the limit is {MAX_VALUE_NBYTES}")


class MetadataStore(ABC):
    """A key -> bytes store shared by every engine of a cluster.

    The public methods validate their arguments and then call the backend's ``_put``,
    ``_get``, ``_delete``, ``_list_prefix`` and ``_close``. All methods block on network
    I/O, bounded by the backend's ``timeout_s`` (per request), and may be called from any
    thread; a store is usable as a context manager that closes it.

    Raises (every method):
        InvalidArgument: a bad key, prefix or value (checked before any I/O).
        MetadataError: the server could not be reached, answered with an error, or
            the store was closed. The message names the store's URL.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._closed = False
        self._closed_lock = threading.Lock()
        self._kept: dict[str, tuple[bytes, float]] = {}   # leased keys: value, ttl (s)
        self._keepalive: threading.Thread | None = None
        self._stop = threading.Event()

    @classmethod
    @abstractmethod
    def from_target(cls, target: MetadataTarget, timeout_s: float) -> MetadataStore:
        """Build a store for a URL already parsed by :func:`from_url`."""

    def put(self, key: str, value: bytes, ttl_s: float | None = None) -> None:
        """Store ``value`` under ``key``, replacing any previous value.

        With ``ttl_s`` the key is leased: the service drops it ``ttl_s`` seconds after
        this store last renewed it (an etcd lease, a Redis expiry, a TTL on our HTTP
        server). This store renews it from a background thread every ``ttl_s / 3`` (and
        writes it again if it was dropped meanwhile) until :meth:`delete` or
        :meth:`close`, so the key outlives its writer by at most ``ttl_s``.
        """
        check_key(key)
        check_value(value)
        if ttl_s is not None and not (isinstance(ttl_s, (int, float)) and math.isfinite(ttl_s)
                                      and ttl_s >= 1):
            raise InvalidArgument(f"ttl_s must be a number of seconds >= 1, got {ttl_s!r}")
        self._check_open()
        self._put(key, value, ttl_s)
        with self._closed_lock:
            if ttl_s is None:
                self._kept.pop(key, None)
                return
            self._kept[key] = (value, float(ttl_s))
            if self._keepalive is None and not self._closed:
                self._keepalive = threading.Thread(target=self._renew_loop, daemon=True,
                                                   name="mc-metadata-keepalive")
                self._keepalive.start()

    def _renew_loop(self) -> None:
        """Write every leased key again, each ``ttl / 3``; a failed renewal is retried
        at the next turn (the key lives ``ttl`` in all)."""
        while True:
            with self._closed_lock:
                kept = dict(self._kept)
            interval = min((ttl for _, ttl in kept.values()), default=3.0) / 3
            if self._stop.wait(interval):
                return
            for key, (value, ttl) in kept.items():
                with self._closed_lock:
                    if self._kept.get(key) != (value, ttl):
                        continue  # deleted or replaced meanwhile
                try:
                    self._put(key, value, ttl)
                except MetadataError as exc:
                    _log.warning("could not renew metadata key %r: %s", key, exc)

    def get(self, key: str) -> bytes | None:
        """Return the value stored under ``key``, or None when there is none."""
        check_key(key)
        self._check_open()
        return self._get(key)

    def delete(self, key: str) -> None:
        """Remove ``key``; removing a key that does not exist is not an error."""
        check_key(key)
        self._check_open()
        with self._closed_lock:
            self._kept.pop(key, None)
        self._delete(key)

    def list_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        """Every key starting with ``prefix``, with its value, sorted by key.

        ``prefix`` is a plain string prefix, not a path: ``"a/b"`` matches ``"a/b"``,
        ``"a/b/c"`` and ``"a/bc"``. To list one "directory", end the prefix with the
        separator (``"a/b/"``).

        The listing is a consistent snapshot on etcd and on the HTTP server. On Redis it
        is built from SCAN and MGET: a key present for the whole call is listed, one added
        or deleted meanwhile may or may not be, and a key deleted between the two steps is
        left out. Keys that are not valid UTF-8 (written by other clients) are skipped.

        Returns:
            ``[(key, value), ...]`` in ascending key order; empty when nothing matches.

        Raises:
            InvalidArgument: ``prefix`` is not a valid key (an empty prefix included).
            MetadataError: as for the other methods; also when the backend cannot list
                (an HTTP metadata server without the listing route, such as the
                original Mooncake's) or the listing is too large for the HTTP server
                (over 64 MiB).
        """
        check_prefix(prefix)
        self._check_open()
        return sorted(self._list_prefix(prefix))

    def close(self) -> None:
        """Release the connection; later calls raise MetadataError. Idempotent."""
        with self._closed_lock:
            if self._closed:
                return
            self._closed = True
            keepalive, self._keepalive = self._keepalive, None
        self._stop.set()
        if keepalive is not None and keepalive is not threading.current_thread():
            keepalive.join()
        self._close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def __enter__(self) -> MetadataStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _check_open(self) -> None:
        if self._closed:
            raise MetadataError(f"metadata store {self.url} is closed")

    # Backend hooks: arguments are already validated and the store is open; failures
    # are raised as MetadataError naming ``self.url``.

    @abstractmethod
    def _put(self, key: str, value: bytes, ttl_s: float | None) -> None:
        """Store the value; with ``ttl_s``, dropped after that many seconds (whole
        seconds, rounded up) unless written again."""

    @abstractmethod
    def _get(self, key: str) -> bytes | None:
        """Return the value, or None when the key does not exist."""

    @abstractmethod
    def _delete(self, key: str) -> None:
        """Remove the key; a missing key is not an error."""

    @abstractmethod
    def _list_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        """Return every ``(key, value)`` whose key starts with ``prefix``, in any order."""

    @abstractmethod
    def _close(self) -> None:
        """Release connections; called once."""


# scheme -> (module path, class name); modules are imported on first use.
_BACKENDS: dict[str, tuple[str, str]] = {}


def register_backend(scheme: str, module_path: str, class_name: str) -> None:
    """Make ``scheme://`` URLs load ``module_path.class_name`` (imported on first use)."""
    _BACKENDS[scheme] = (module_path, class_name)


def _load_backend(scheme: str) -> type[MetadataStore]:
    module_path, class_name = _BACKENDS[scheme]
    cls: type[MetadataStore] = getattr(importlib.import_module(module_path), class_name)
    return cls


register_backend("http", "mooncake_plugins.transfer.metadata.http", "HttpMetadataStore")
register_backend("https", "mooncake_plugins.transfer.metadata.http", "HttpMetadataStore")
register_backend("etcd", "mooncake_plugins.transfer.metadata.etcd", "EtcdMetadataStore")
register_backend("redis", "mooncake_plugins.transfer.metadata.redis", "RedisMetadataStore")


def _bad_url(url: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"bad metadata URL {url!r}: {why}; accepted forms: {ACCEPTED_FORMS}")


def parse_url(url: str) -> MetadataTarget | None:
    """Parse a metadata connection string; None means P2PHANDSHAKE.

    Raises:
        InvalidArgument: the string is not one of the accepted forms.
    """
    if not isinstance(url, str):
        raise InvalidArgument(f"metadata URL must be a str, got {type(url).__name__}; "
                              f"accepted forms: {ACCEPTED_FORMS}")
    text = url.strip()
    if text == P2P_HANDSHAKE:
        return None
    if not text:
        raise _bad_url(url, "empty")
    # A bare host:port means etcd, the original's default metadata type.
    try:
        parts = urlsplit(text if "://" in text else f"etcd://{text}")
    except ValueError as exc:
        raise _bad_url(url, str(exc)) from exc
    scheme = parts.scheme.lower()
    if scheme not in _BACKENDS:
        raise _bad_url(url, f"unknown scheme {parts.scheme!r}")
    if parts.username is not None or parts.password is not None:
        raise _bad_url(url, "credentials in the URL are not supported")
    if parts.query or parts.fragment:
        raise _bad_url(url, "a query or fragment is not allowed")
    try:
        port = parts.port
    except ValueError as exc:
        raise _bad_url(url, "the port is not a number in 1..65535") from exc
    host = parts.hostname
    if not host:
        raise _bad_url(url, "no host")
    if port is None:
        if "://" not in text:
            raise _bad_url(url, "a bare address needs host:port")
        port = _DEFAULT_PORTS[scheme]
    if port == 0:
        raise _bad_url(url, "port 0")
    if scheme in ("http", "https"):
        return MetadataTarget(url=text, scheme=scheme, host=host, port=port,
                              path=parts.path or "/")
    if scheme == "redis":
        db_text = parts.path.strip("/")
        if db_text and not db_text.isdigit():
            raise _bad_url(url, f"the Redis database {db_text!r} is not a number")
        return MetadataTarget(url=text, scheme=scheme, host=host, port=port,
                              db=int(db_text or 0))
    if parts.path not in ("", "/"):
        raise _bad_url(url, "an etcd URL takes no path")
    return MetadataTarget(url=text, scheme=scheme, host=host, port=port)


def from_url(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> MetadataStore | None:
    """Open the metadata store named by a connection string.

    Args:
        url: ``http://host:port/metadata``, ``etcd://host:port``, a bare ``host:port``
            (etcd), ``redis://host:port[/db]`` or ``P2PHANDSHAKE``.
        timeout_s: bound on each network operation of the store.

    Returns:
        The store, or None for ``P2PHANDSHAKE`` (the engine then exchanges segment
        descriptors with its peers directly). No connection is made here; the first
        operation connects.

    Raises:
        InvalidArgument: a malformed URL or a non-positive timeout.
        MetadataError: the backend's client library is not installed.
    """
    target = parse_url(url)
    if target is None:
        return None
    if not timeout_s > 0:
        raise InvalidArgument(f"timeout_s must be > 0, got {timeout_s!r}")
    try:
        cls = _load_backend(target.scheme)
    except ImportError as exc:
        raise MetadataError(
            f"metadata URL {target.url}: the {target.scheme} backend is unavailable "
            f"({exc}): pip install 'mooncake_plugins[{target.scheme}]'") from exc
    return cls.from_target(target, timeout_s)
