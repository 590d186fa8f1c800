"""High availability of the store master: leader election through etcd, leader lookup for clients.

Several masters of one cluster run :class:`LeaderElection` with the same ``cluster_id``. The
leader is whoever created the key :func:`leader_key` (value: its ``candidate_address``, UTF-8)
with an etcd transaction "create if ``create_revision == 0``", with its own lease attached. A
daemon thread refreshes the lease every ``ttl_s / 3``; when the leader dies the lease expires,
etcd deletes the key, and a waiting candidate (watching the key) creates it. Clients find the
leader with :func:`find_leader` and, after losing it, :func:`wait_for_leader`.

A leader is identified by its term, the etcd revision that created the key, not by its
address: a master killed and restarted with the same command (same address) that wins again
is a new term, which clients follow like any other.

Safety: a leader counts itself leader only while its last successful refresh (timed from when
the request was sent) is younger than ``ttl_s``, and it gives up once refreshes have failed for
``2/3 * ttl_s``, so it steps down before etcd can expire its lease and elect another master.

Everything talks to etcd's HTTP/JSON gateway through ``etcd3gw``; a call that finds one endpoint
down tries the next in the list. Errors are :class:`~mooncake_plugins.errors.MetadataError`
(etcd unreachable or refusing) and :class:`~mooncake_plugins.errors.InvalidArgument`.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import etcd3gw
import requests
from urllib3.exceptions import ReadTimeoutError
from etcd3gw.exceptions import (
    ConnectionFailedError,
    ConnectionTimeoutError,
    Etcd3Exception,
    InternalServerError,
)

from mooncake_plugins.errors import InvalidArgument, MetadataError

logger = logging.getLogger(__name__)

__all__ = [
    "Leader",
    "LeaderElection",
    "LeaderWaitTimeout",
    "current_leader",
    "find_leader",
    "leader_key",
    "parse_etcd_endpoints",
    "wait_for_leader",
]

_DEFAULT_PORT_HINT = "host:port, etcd://host:port or http://host:port"
_SCHEMES = ("etcd://", "http://")
_REQUEST_TIMEOUT_S = 5.0       # one HTTP request other than a lease refresh
_CONNECT_TIMEOUT_S = 2.0       # opening a watch stream
_WATCH_SLICE_S = 0.5           # a quiet watch is re-opened this often (bounds reaction to `stop`)
_MIN_KEEPALIVE_TIMEOUT_S = 0.2
# Errors after which the next endpoint is tried (503 maps to ConnectionFailedError in etcd3gw).
_FAILOVER_ERRORS = (ConnectionFailedError, ConnectionTimeoutError, InternalServerError)


class LeaderWaitTimeout(MetadataError, TimeoutError):
    """No leader (other than the excluded term) was published in etcd before the deadline."""


@dataclass(frozen=True)
class Leader:
    """A published leader: where clients reach it, and its term (the etcd revision that
    created the leader key; each election makes a new one, whatever the address)."""

    address: str
    term: int


# --------------------------------------------------------------------------------------------
# Endpoints and keys
# --------------------------------------------------------------------------------------------

def parse_etcd_endpoints(endpoints: str) -> list[tuple[str, int]]:
    """Parse an etcd endpoint list such as ``"127.0.0.1:2379;etcd://h2:2379,http://[::1]:2379"``.

    Entries are separated by ``;`` or ``,``; each is ``host:port`` with an optional ``etcd://``
    or ``http://`` prefix and an optional trailing ``/``. Empty entries are skipped, duplicates
    dropped, order kept. Pure function, any thread.

    Returns:
        ``[(host, port), ...]`` (IPv6 hosts without brackets), at least one entry.

    Raises:
        InvalidArgument: not a string, no entry, another scheme (https is not supported),
            a missing or bad host or port.
    """
    if not isinstance(endpoints, str):
        raise InvalidArgument(f"etcd endpoints must be a string, not {type(endpoints).__name__}")
    result: list[tuple[str, int]] = []
    for raw in endpoints.replace(",", ";").split(";"):
        entry = raw.strip()
        if not entry:
            continue
        endpoint = _parse_one_endpoint(entry)
        if endpoint not in result:
            result.append(endpoint)
    if not result:
        raise InvalidArgument(f"no etcd endpoint in {endpoints!r}; expected {_DEFAULT_PORT_HINT}, "
                              "several separated by ';'")
    return result


def _parse_one_endpoint(entry: str) -> tuple[str, int]:
    rest = entry
    lowered = entry.lower()
    for scheme in _SCHEMES:
        if lowered.startswith(scheme):
            rest = entry[len(scheme):]
            break
    else:
        if "://" in entry:
            raise InvalidArgument(f"etcd endpoint {entry!r}: unsupported scheme; "
                                  f"expected {_DEFAULT_PORT_HINT}")
    if rest.endswith("/"):
        rest = rest[:-1]
    if rest.startswith("["):
        host, sep, port_text = rest[1:].partition("]:")
        if not sep or not host or "]" in host:
            raise InvalidArgument(f"etcd endpoint {entry!r}: expected [ipv6]:port")
    else:
        host, sep, port_text = rest.rpartition(":")
        if not sep or not host:
            raise InvalidArgument(f"etcd endpoint {entry!r}: missing port; "
                                  f"expected {_DEFAULT_PORT_HINT}")
        if ":" in host:
            raise InvalidArgument(f"etcd endpoint {entry!r}: write IPv6 hosts as [addr]:port")
    if any(ch.isspace() or ch in "/?#@[]" for ch in host):
        raise InvalidArgument(f"etcd endpoint {entry!r}: bad host {host!r}")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidArgument(f"etcd endpoint {entry!r}: port {port_text!r} is not in 1..65535")
    return host, int(port_text)


def leader_key(cluster_id: str) -> str:
    """Return the etcd key of the leader's address, ``mooncake-store/<cluster_id>/master/leader``.

    Raises:
        InvalidArgument: ``cluster_id`` is empty or has ``/``, whitespace or control characters.
    """
    if (not isinstance(cluster_id, str) or not cluster_id or "/" in cluster_id
            or not cluster_id.isprintable() or any(ch.isspace() for ch in cluster_id)):
        raise InvalidArgument(f"bad cluster_id {cluster_id!r}: use a non-empty name without "
                              "'/', spaces or control characters")
    return f"mooncake-store/{cluster_id}/master/leader"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def _revision(reply: dict[str, Any]) -> int:
    """The store revision in a unary reply's header (JSON encodes int64 as a string)."""
    return int(reply["header"]["revision"])


def _detail(exc: BaseException) -> str:
    text = getattr(exc, "detail_text", None) or str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {str(text)[:300]}"


# --------------------------------------------------------------------------------------------
# Cluster access with endpoint failover
# --------------------------------------------------------------------------------------------

@dataclass(eq=False)
class _Endpoint:
    host: str
    port: int
    name: str
    api_path: str | None = None     # etcd's API prefix, discovered by the first call
    idle: list[etcd3gw.Etcd3Client] = field(default_factory=list)   # pooled HTTP clients


@dataclass
class _KeyState:
    """The leader key as read at ``revision`` (the store revision of that read)."""

    revision: int
    value: bytes | None = None
    lease_id: int = 0
    create_revision: int = 0    # the term of the leader that holds the key


class _EtcdCluster:
    """Calls to one etcd cluster through any of its client endpoints.

    A call starts at the endpoint that answered last and tries the others in list order while
    they are down, blocking for at most its timeout per endpoint. Each call borrows an HTTP
    client of its own from the endpoint's pool (``requests.Session`` is not documented as
    thread-safe); ``_lock`` guards only the pools, the current endpoint and ``_closed`` and is
    never held during network I/O, so a slow or failing call on one thread never delays
    another's (the leader's lease refresh above all). Any number of threads may call.
    """

    def __init__(self, endpoints: list[tuple[str, int]]) -> None:
        self._endpoints = [_Endpoint(host, port, f"http://[{host}]:{port}" if ":" in host
                                     else f"http://{host}:{port}") for host, port in endpoints]
        self.names = ";".join(ep.name for ep in self._endpoints)
        self._current = 0
        self._lock = threading.Lock()
        self._closed = False

    def _order(self, op: str) -> list[int]:
        with self._lock:
            if self._closed:
                raise MetadataError(f"etcd client for {self.names} is closed ({op})")
            return [self._current] + [i for i in range(len(self._endpoints)) if i != self._current]

    def _use(self, endpoint: _Endpoint) -> None:
        with self._lock:
            index = self._endpoints.index(endpoint)
            if index != self._current:
                logger.info("etcd: switched from %s to %s", self._endpoints[self._current].name,
                            endpoint.name)
                self._current = index

    def _borrow(self, endpoint: _Endpoint, timeout_s: float) -> etcd3gw.Etcd3Client:
        """An HTTP client for ``endpoint`` that only the calling thread uses until returned."""
        with self._lock:
            client = endpoint.idle.pop() if endpoint.idle else None
            api_path = endpoint.api_path
        if client is None:
            session = requests.Session()
            session.trust_env = False  # etcd is reached directly, never through a proxy
            client = etcd3gw.Etcd3Client(host=endpoint.host, port=endpoint.port,
                                         timeout=timeout_s, session=session, api_path=api_path)
        client.timeout = timeout_s
        return client

    def _give_back(self, endpoint: _Endpoint, client: etcd3gw.Etcd3Client, healthy: bool) -> None:
        """Pool ``client`` again after a call that reached etcd; close it otherwise."""
        with self._lock:
            if healthy and not self._closed:
                endpoint.api_path = endpoint.api_path or client.api_path  # known after a call
                endpoint.idle.append(client)
                return
        client.session.close()

    def _unreachable(self, op: str, errors: list[str]) -> MetadataError:
        return MetadataError(f"etcd unreachable during {op}: {'; '.join(errors)}; check that "
                             f"etcd runs and the endpoints ({self.names}) are right")

    def call(self, op: str, path: str, payload: dict[str, Any],
             timeout_s: float = _REQUEST_TIMEOUT_S) -> dict[str, Any]:
        """POST ``payload`` to ``/v3/<path>`` on the first endpoint that answers; blocking.

        Raises:
            MetadataError: every endpoint is down, or etcd refused the request.
        """
        errors: list[str] = []
        for index in self._order(op):
            endpoint = self._endpoints[index]
            client = self._borrow(endpoint, timeout_s)
            healthy = False
            try:
                result = client.post(client.get_url(path), json=payload)
                healthy = True
            except _FAILOVER_ERRORS as exc:
                errors.append(f"{endpoint.name}: {_detail(exc)}")
                continue
            except (Etcd3Exception, requests.RequestException, ValueError) as exc:
                healthy = isinstance(exc, Etcd3Exception)  # etcd answered: the session is fine
                raise MetadataError(f"etcd {endpoint.name}: {op} failed: {_detail(exc)}") \
                    from exc
            finally:
                self._give_back(endpoint, client, healthy)
            self._use(endpoint)
            if not isinstance(result, dict):
                raise MetadataError(f"etcd {endpoint.name}: {op}: unexpected reply {result!r}")
            return result
        raise self._unreachable(op, errors)

    def read_key(self, key: bytes, op: str, timeout_s: float = _REQUEST_TIMEOUT_S) -> _KeyState:
        """Read ``key``; blocking. Raises MetadataError like :meth:`call`."""
        reply = self.call(op, "/kv/range", {"key": _b64(key)}, timeout_s)
        try:
            state = _KeyState(revision=_revision(reply))
            kvs = reply.get("kvs") or []
            if kvs:
                state.value = _unb64(kvs[0].get("value", ""))
                state.lease_id = int(kvs[0].get("lease", 0))
                state.create_revision = int(kvs[0].get("create_revision", 0))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MetadataError(f"etcd {self.names}: {op}: unusable reply {reply!r:.300}") from exc
        return state

    def watch_slice(self, key: bytes, start_revision: int, quiet_s: float) -> bool:
        """Watch ``key`` from ``start_revision`` until an event or ``quiet_s`` without one.

        Blocking, for about ``quiet_s`` at most once the stream is open. A broken stream counts
        as quiet (the caller's next unary call reveals a dead etcd).

        Returns:
            True when something happened to the key (or the watch was cancelled, e.g. by
            compaction): re-read it. False when the time passed quietly.

        Raises:
            MetadataError: no endpoint accepted the watch.
        """
        payload = {"create_request": {"key": _b64(key), "start_revision": start_revision}}
        errors: list[str] = []
        for index in self._order("watch"):
            endpoint = self._endpoints[index]
            client = self._borrow(endpoint, _CONNECT_TIMEOUT_S)
            try:
                response = client.session.post(
                    client.get_url("/watch"), json=payload, stream=True,
                    timeout=(_CONNECT_TIMEOUT_S, max(quiet_s, 0.01)))
            except requests.ReadTimeout:
                # connected, but a busy etcd sent no headers within the slice: a quiet one
                self._give_back(endpoint, client, False)
                return False
            except (Etcd3Exception, requests.RequestException) as exc:
                errors.append(f"{endpoint.name}: {_detail(exc)}")
                self._give_back(endpoint, client, False)
                continue
            try:
                with response:  # closing it drops a connection left mid-stream
                    if response.status_code != 200:
                        errors.append(f"{endpoint.name}: HTTP {response.status_code}")
                        continue
                    self._use(endpoint)
                    return _read_watch_stream(response)
            finally:
                self._give_back(endpoint, client, True)
        raise self._unreachable("watch", errors)

    def close(self) -> None:
        """Close the pooled sessions (borrowed ones close when returned); later calls raise
        MetadataError. Idempotent, any thread, never waits for a call in flight."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = [c for ep in self._endpoints for c in ep.idle]
            for ep in self._endpoints:
                ep.idle.clear()
        for client in idle:
            client.session.close()


def _read_watch_stream(response: requests.Response) -> bool:
    """Read newline-delimited watch replies until an event; see :meth:`_EtcdCluster.watch_slice`."""
    try:
        for line in response.iter_lines():
            if not line.strip():
                continue
            reply = json.loads(line)
            result = reply.get("result") if isinstance(reply, dict) else None
            if not isinstance(result, dict):
                logger.debug("etcd watch: unexpected reply %r", reply)
                return True
            if result.get("events") or result.get("canceled") or "compact_revision" in result:
                return True
        return True  # the server ended the stream: re-read the key
    except (requests.RequestException, ValueError) as exc:
        # A quiet slice ends with a read timeout, raised as requests.ConnectionError.
        if not (exc.args and isinstance(exc.args[0], ReadTimeoutError)):
            logger.debug("etcd watch stream broke: %s", _detail(exc))
        return False


# --------------------------------------------------------------------------------------------
# Leader election
# --------------------------------------------------------------------------------------------

@dataclass
class _Term:
    """One period of leadership: its lease and keepalive thread."""

    lease_id: int
    last_ok: float                      # monotonic send time of the last successful grant/refresh
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


class LeaderElection:
    """One master's candidacy for leadership of ``cluster_id``.

    Thread use: :meth:`campaign` is called by the master's main thread (concurrent calls are
    serialized); :meth:`resign`, :meth:`close`, :meth:`on_lost` and :attr:`is_leader` from any
    thread. While leader, a daemon thread refreshes the lease and runs the ``on_lost``
    callbacks. Lock order: ``_campaign_lock`` -> ``_lock`` -> the etcd client's lock; only
    ``_campaign_lock`` is held during etcd I/O (the keepalive thread never takes it), and no
    lock is held while callbacks run or while a thread is joined.
    """

    def __init__(self, etcd_endpoints: str, cluster_id: str, candidate_address: str,
                 ttl_s: float = 5.0) -> None:
        """Validate the arguments and check that etcd answers; blocking (one request).

        Args:
            etcd_endpoints: see :func:`parse_etcd_endpoints`.
            cluster_id: names the election (several clusters may share one etcd).
            candidate_address: what clients read to reach this master, e.g. ``"10.0.0.5:50051"``.
            ttl_s: lease TTL; etcd rounds it up to whole seconds (and to at least its minimum,
                2 s by default), this object times refreshes and step-down on ``ttl_s`` itself.

        Raises:
            InvalidArgument: bad endpoints, cluster_id, address or TTL.
            MetadataError: no endpoint answered.
        """
        endpoints = parse_etcd_endpoints(etcd_endpoints)
        self._key = leader_key(cluster_id).encode("utf-8")
        if not isinstance(candidate_address, str) or not candidate_address.strip():
            raise InvalidArgument(f"candidate_address must be a non-empty string, "
                                  f"not {candidate_address!r}")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) \
                or not math.isfinite(ttl_s) or ttl_s <= 0:
            raise InvalidArgument(f"ttl_s must be a positive number of seconds, not {ttl_s!r}")
        self.cluster_id = cluster_id
        self.candidate_address = candidate_address
        self.ttl_s = float(ttl_s)
        self._value = candidate_address.encode("utf-8")
        self._keepalive_timeout_s = max(_MIN_KEEPALIVE_TIMEOUT_S, self.ttl_s / 4)
        self._campaign_lock = threading.Lock()
        self._lock = threading.Lock()
        self._term: _Term | None = None             # guarded by _lock
        self._callbacks: list[Callable[[], None]] = []  # guarded by _lock
        self._closed = threading.Event()
        self._cluster = _EtcdCluster(endpoints)
        try:
            state = self._cluster.read_key(self._key, "connect")
        except BaseException:
            self._cluster.close()
            raise
        logger.debug("election %s: etcd %s answers, current leader %r", self.cluster_id,
                     self._cluster.names, state.value)

    # -- state ---------------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True while this candidate holds the key and its lease cannot have expired; no I/O."""
        with self._lock:
            term = self._term
        return term is not None and time.monotonic() - term.last_ok < self.ttl_s

    @property
    def lease_id(self) -> int:
        """The lease of the current term (0 when not leader); no I/O."""
        with self._lock:
            return self._term.lease_id if self._term is not None else 0

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Register ``callback`` to run when leadership is lost without resign()/close().

        It runs once per lost term, on the keepalive thread, after ``is_leader`` became False;
        exceptions are logged. Register before :meth:`campaign` so no loss is missed.
        """
        if not callable(callback):
            raise InvalidArgument(f"on_lost callback {callback!r} is not callable")
        with self._lock:
            self._callbacks.append(callback)

    # -- campaign ------------------------------------------------------------------------------

    def campaign(self, stop: threading.Event | None = None,
                 timeout_s: float | None = None) -> bool:
        """Block until this candidate is leader; re-callable after a loss or resign.

        Each attempt grants a lease and runs the create-if-absent transaction; on failure it
        revokes that lease and watches the key until it changes, then retries. ``stop``,
        ``timeout_s`` and :meth:`close` are noticed within about half a second.

        Returns:
            True when leader (at once if already leader), False when ``stop`` was set, the
            timeout passed or the election was closed.

        Raises:
            MetadataError: etcd became unreachable (every endpoint) or refused a request.
        """
        deadline = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
        with self._campaign_lock:
            while True:
                if self._closed.is_set() or (stop is not None and stop.is_set()):
                    return False
                with self._lock:
                    holding = self._term is not None
                if holding:
                    return True
                won, revision = self._try_acquire()
                if won:
                    return True
                if not self._wait_for_change(revision, stop, deadline):
                    return False

    def _try_acquire(self) -> tuple[bool, int]:
        """Grant a lease and try to create the key with it; blocking. Called with _campaign_lock."""
        sent = time.monotonic()
        grant = self._cluster.call("lease grant", "/lease/grant",
                                   {"TTL": max(1, math.ceil(self.ttl_s)), "ID": 0})
        try:
            lease_id = int(grant["ID"])
        except (KeyError, TypeError, ValueError) as exc:
            raise MetadataError(f"etcd {self._cluster.names}: lease grant: unusable reply "
                                f"{grant!r:.300}") from exc
        key = _b64(self._key)
        txn = {
            "compare": [{"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
            "success": [{"request_put": {"key": key, "value": _b64(self._value),
                                         "lease": lease_id}}],
            "failure": [{"request_range": {"key": key}}],
        }
        try:
            reply = self._cluster.call("campaign", "/kv/txn", txn)
            revision = _revision(reply)
        except (KeyError, TypeError, ValueError) as exc:
            self._revoke_quietly(lease_id)
            raise MetadataError(f"etcd {self._cluster.names}: campaign: unusable reply") from exc
        except BaseException:
            self._revoke_quietly(lease_id)
            raise
        if not reply.get("succeeded"):
            self._revoke_quietly(lease_id)
            holder = None
            for response in reply.get("responses") or []:
                for kv in response.get("response_range", {}).get("kvs") or []:
                    holder = _unb64(kv.get("value", "")).decode("utf-8", "replace")
            logger.debug("election %s: %s waits, leader is %r", self.cluster_id,
                         self.candidate_address, holder)
            return False, revision
        term = _Term(lease_id=lease_id, last_ok=sent)
        term.thread = threading.Thread(target=self._keep_alive, args=(term,), daemon=True,
                                       name=f"ha-keepalive-{self.cluster_id}")
        with self._lock:
            self._term = term
        term.thread.start()
        logger.info("election %s: %s is leader (lease %x, granted TTL %s s, revision %d)",
                    self.cluster_id, self.candidate_address, lease_id, grant.get("TTL"), revision)
        if self._closed.is_set():  # close() ran meanwhile and saw no term to resign
            self.resign()
            return False, revision
        return True, revision

    def _wait_for_change(self, revision: int, stop: threading.Event | None,
                         deadline: float | None) -> bool:
        """Watch the key after ``revision``: True once it changed, False on stop/deadline/close."""
        while True:
            if self._closed.is_set() or (stop is not None and stop.is_set()):
                return False
            quiet_s = _WATCH_SLICE_S
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                quiet_s = min(quiet_s, remaining)
            if self._cluster.watch_slice(self._key, revision + 1, quiet_s):
                return True
            # a busy etcd may not open the watch within a slice: look at the key itself
            if self._cluster.read_key(self._key, "leader lookup").value is None:
                return True

    # -- leadership ----------------------------------------------------------------------------

    def _keep_alive(self, term: _Term) -> None:
        """Keepalive thread of one term: refresh the lease, check the key, detect loss."""
        interval_s = self.ttl_s / 3
        give_up_s = self.ttl_s * 2 / 3
        delay_s = interval_s
        reason = ""
        while not term.stop.wait(delay_s):
            sent = time.monotonic()
            try:
                reply = self._cluster.call("lease refresh", "/lease/keepalive",
                                           {"ID": term.lease_id}, self._keepalive_timeout_s)
                if int(reply.get("result", {}).get("TTL", -1)) <= 0:
                    reason = "the lease expired"
                    break
                state = self._cluster.read_key(self._key, "leader check",
                                               self._keepalive_timeout_s)
                if state.value != self._value or state.lease_id != term.lease_id:
                    holder = state.value.decode("utf-8", "replace") if state.value else None
                    reason = f"the leader key now holds {holder!r}"
                    break
            except MetadataError as exc:
                if term.stop.is_set():
                    return
                if time.monotonic() - term.last_ok >= give_up_s:
                    reason = f"lease refreshes failed for {give_up_s:.2f} s ({exc})"
                    break
                logger.warning("election %s: lease refresh failed, retrying: %s",
                               self.cluster_id, exc)
                delay_s = min(interval_s, 0.1)
                continue
            except Exception as exc:  # an unusable reply: never leave a leader unguarded
                logger.exception("election %s: keepalive failed", self.cluster_id)
                reason = f"keepalive failed: {exc!r}"
                break
            term.last_ok = sent
            delay_s = max(0.0, interval_s - (time.monotonic() - sent))
        else:
            return  # resign() or close() stopped this term
        self._lose(term, reason)

    def _lose(self, term: _Term, reason: str) -> None:
        """Mark ``term`` lost and run the callbacks once; keepalive thread, no lock held after."""
        with self._lock:
            if self._term is not term or term.stop.is_set():
                return  # resign() got there first
            self._term = None
            term.stop.set()
            callbacks = list(self._callbacks)
        logger.warning("election %s: %s lost leadership: %s", self.cluster_id,
                       self.candidate_address, reason)
        self._revoke_quietly(term.lease_id)
        for callback in callbacks:
            try:
                callback()
            except Exception:
                logger.exception("election %s: on_lost callback %r failed", self.cluster_id,
                                 callback)

    def _revoke_quietly(self, lease_id: int) -> None:
        try:
            self._cluster.call("lease revoke", "/kv/lease/revoke", {"ID": lease_id})
        except MetadataError as exc:
            logger.debug("election %s: revoking lease %x failed (it expires on its own): %s",
                         self.cluster_id, lease_id, exc)

    def resign(self) -> None:
        """Give up leadership: stop the keepalive thread and revoke the lease (the key goes away).

        Blocking (joins the thread, one request); a no-op when not leader. on_lost does not run.
        Safe to call from an on_lost callback.
        """
        with self._lock:
            term, self._term = self._term, None
            if term is not None:
                term.stop.set()
        if term is None:
            return
        if term.thread is not None and term.thread is not threading.current_thread():
            term.thread.join()
        self._revoke_quietly(term.lease_id)
        logger.info("election %s: %s resigned", self.cluster_id, self.candidate_address)

    def close(self) -> None:
        """Resign if leader, stop a running campaign, release the HTTP sessions. Idempotent.

        Blocking: waits for a running :meth:`campaign` to notice (about half a second). May be
        called from an on_lost callback.
        """
        self._closed.set()
        self.resign()
        if self._campaign_lock.acquire(timeout=_REQUEST_TIMEOUT_S * 3):
            self._campaign_lock.release()
        self.resign()  # a campaign that won just before it noticed close()
        self._cluster.close()

    def __enter__(self) -> LeaderElection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"LeaderElection(cluster_id={self.cluster_id!r}, "
                f"candidate={self.candidate_address!r}, leader={self.is_leader})")


# --------------------------------------------------------------------------------------------
# Client side: find and follow the leader
# --------------------------------------------------------------------------------------------

def find_leader(etcd_endpoints: str, cluster_id: str) -> Leader | None:
    """Return the published leader (address and term), or None; blocking (one read).

    Raises:
        InvalidArgument: bad endpoints or cluster_id.
        MetadataError: no endpoint answered.
    """
    key = leader_key(cluster_id).encode("utf-8")
    cluster = _EtcdCluster(parse_etcd_endpoints(etcd_endpoints))
    try:
        return _leader(cluster.read_key(key, "leader lookup"))
    finally:
        cluster.close()


def _leader(state: _KeyState) -> Leader | None:
    if state.value is None:
        return None
    return Leader(state.value.decode("utf-8", "replace"), state.create_revision)


def current_leader(etcd_endpoints: str, cluster_id: str) -> str | None:
    """Return the published leader's ``candidate_address``, or None; blocking (one read).

    Raises:
        InvalidArgument: bad endpoints or cluster_id.
        MetadataError: no endpoint answered.
    """
    leader = find_leader(etcd_endpoints, cluster_id)
    return None if leader is None else leader.address


def wait_for_leader(etcd_endpoints: str, cluster_id: str, timeout_s: float,
                    exclude_term: int | None = None,
                    stop: threading.Event | None = None) -> Leader:
    """Block until a leader of another term than ``exclude_term`` is published; return it.

    A client that lost its master passes that master's term as ``exclude_term`` so it does not
    get the stale key back before the old lease expires; a new term is taken at any address,
    the old one included (a master restarted in place). Watches the key, so a new leader is
    seen at once. Setting ``stop`` ends the wait within about half a second (as the deadline
    would).

    Raises:
        InvalidArgument: bad endpoints, cluster_id or timeout.
        LeaderWaitTimeout: no such leader within ``timeout_s``, or ``stop`` was set.
        MetadataError: no endpoint answered.
    """
    key = leader_key(cluster_id).encode("utf-8")
    endpoints = parse_etcd_endpoints(etcd_endpoints)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or math.isnan(timeout_s) or timeout_s < 0:
        raise InvalidArgument(f"timeout_s must be a non-negative number, not {timeout_s!r}")
    deadline = time.monotonic() + timeout_s
    cluster = _EtcdCluster(endpoints)
    try:
        while True:
            state = cluster.read_key(key, "leader lookup")
            leader = _leader(state)
            if leader is not None and leader.term != exclude_term:
                return leader
            remaining = deadline - time.monotonic()
            if stop is not None and stop.is_set():
                raise LeaderWaitTimeout(f"stopped waiting for a leader of cluster {cluster_id!r}")
            if remaining <= 0:
                seen = "none" if leader is None else f"{leader.address!r} (term {leader.term})"
                other = "" if exclude_term is None else f" of a term other than {exclude_term}"
                raise LeaderWaitTimeout(
                    f"no leader{other} of cluster {cluster_id!r} was published in "
                    f"etcd {cluster.names} within {timeout_s} s (current: {seen}); check that a "
                    "master runs with HA enabled and the same cluster_id")
            cluster.watch_slice(key, state.revision + 1, min(_WATCH_SLICE_S, remaining))
    finally:
        cluster.close()
