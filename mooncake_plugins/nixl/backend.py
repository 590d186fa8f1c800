"""The Python side of our NIXL backend plugin: one :class:`NixlBackend` per NIXL agent.

The C++ plugin (``native/nixl/plugin.cpp``, built as ``libplugin_MOONCAKE.so``) forwards
each call of NIXL's backend interface to one method here and hands back what it returns:
an int status (NIXL's codes, below), bytes, or a new transfer object. Methods never raise
into the plugin: an error is logged and returned as a status.

NIXL's model maps onto the engine like this:
- connection info: this engine's segment name (``host:port``, P2P handshake); a peer's is
  loaded per agent, and the peer's engine answers for its own regions (every range is
  checked by the target, as for any peer of the engine);
- registerMem: ``register_address`` (DRAM as ``cpu``, VRAM as ``cuda:<devId>``);
- prepXfer/postXfer/checkXfer/releaseReqH: a :class:`Transfer` holding the descriptors,
  one engine batch per post; a notification goes out once that batch has completed;
- genNotif/getNotifs: the engine's notify control message (bytes carried as latin-1 text).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
import weakref
from array import array
from typing import Any, Callable

from ..errors import AddressError, MooncakeError, SegmentNotFound, TransferError
from ..transfer.batch import Batch, OpCode, TransferRequest
from ..transfer.engine import P2P, TransferEngine
from ..config import EngineConfig

log = logging.getLogger("mooncake_plugins.nixl")

# NIXL's status codes (nixl_status_t)
IN_PROG = 1
SUCCESS = 0
ERR_INVALID_PARAM = -2
ERR_BACKEND = -3
ERR_NOT_FOUND = -4
ERR_REPOST_ACTIVE = -7
ERR_NOT_SUPPORTED = -9
ERR_REMOTE_DISCONNECT = -10

DRAM_SEG = 0
VRAM_SEG = 1
NIXL_READ = 0
NIXL_WRITE = 1

MAX_CONN_INFO = 512
CHECK_WAIT_S = 0.0001
BUSY_POLL_S = 0.001
"""A transfer checked again within BUSY_POLL_S of its last check is being polled in a
tight loop: ``check`` then waits up to CHECK_WAIT_S for it, without the GIL, before
answering IN_PROG. Such a loop holds the GIL (NIXL's Python binding keeps it) and would
otherwise starve the engine threads doing the transfer; a poller that checks once per
step (vLLM's) gets its answer at once."""
MAX_NOTIF_NBYTES = 65536


_LIVE: "weakref.WeakSet[NixlBackend]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Close the backends NIXL still holds at interpreter exit (agents are often left to
    the end): their engines' threads and sockets end while Python can still run them."""
    for backend in list(_LIVE):
        backend.close()


def status_of(exc: BaseException) -> int:
    """NIXL's status code for an engine error."""
    if isinstance(exc, AddressError):
        return ERR_INVALID_PARAM
    if isinstance(exc, (SegmentNotFound, TransferError)):
        return ERR_REMOTE_DISCONNECT
    return ERR_BACKEND


_AFTER_CLOSE = frozenset({"deregister", "disconnect", "release"})


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn whatever ``fn`` raises into a logged NIXL status (the plugin must not see
    a Python exception)."""
    def inner(self: "NixlBackend", *args: Any) -> Any:
        if self.closed:  # at interpreter exit NIXL lets go of what it held after our close
            return SUCCESS if fn.__name__ in _AFTER_CLOSE else ERR_BACKEND
        try:
            return fn(self, *args)
        except MooncakeError as exc:
            log.error("NIXL %s on agent %s: %s", fn.__name__, self.agent, str(exc))
            return status_of(exc)
        except Exception:
            log.exception("NIXL %s on agent %s failed", fn.__name__, self.agent)
            return ERR_BACKEND
    inner.__name__ = fn.__name__
    inner.__doc__ = fn.__doc__
    return inner


def default_ip() -> str:
    """The address to serve on when none is configured: ``NIXL_MOONCAKE_IP_ADDR`` (the
    variable NIXL's own Mooncake backend reads), else this host's outgoing address (a UDP
    socket's route lookup: no packet is sent), else 127.0.0.1."""
    configured = os.environ.get("NIXL_MOONCAKE_IP_ADDR")
    if configured:
        return configured
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: routed, never reached
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class Transfer:
    """A prepared NIXL request: ``(local, remote, nbytes)`` descriptors to one agent.

    Each post runs one engine batch; a notification goes out from the thread that ends the
    batch (so it needs no polling), and the post completes once it has been sent.
    """

    __slots__ = ("agent", "requests", "batch", "notifying", "error", "released", "checked")

    def __init__(self, agent: str, requests: list[TransferRequest]) -> None:
        self.agent = agent
        self.requests = requests
        self.batch: Batch | None = None
        self.notifying = False  # a notification of the current post is yet to be sent
        self.error = SUCCESS  # of the current post, besides its batch's errors
        self.released = False
        self.checked = 0.0  # time.monotonic() of the last check


class NixlBackend:
    """One NIXL agent's backend: an engine of its own, the peers' segments by agent name.

    Args:
        agent: the NIXL agent's name (the sender name of our notifications).
        params: NIXL backend parameters: ``ip_addr`` (see :func:`default_ip`),
            ``transports`` (comma-separated engine transports, e.g. ``"shm,tcp"``);
            ``mooncake_devices`` is accepted and unused (RDMA devices of NIXL's own
            Mooncake backend).
    """

    def __init__(self, agent: str, params: dict[str, str]) -> None:
        self.agent = agent
        self.closed = False
        config = EngineConfig.from_env()
        if params.get("transports"):
            config.transports = [t.strip() for t in params["transports"].split(",") if t.strip()]
        host = params.get("ip_addr") or default_ip()
        self.engine = TransferEngine(host, P2P, config=config)
        self._lock = threading.Lock()
        self._segments: dict[str, str] = {}  # agent -> segment name
        self._regions: dict[int, tuple[int, int, str]] = {}  # token -> (address, nbytes, loc)
        self._shares: dict[tuple[int, int, str], list[int]] = {}  # (addr, n, loc) -> [token, refs]
        self._tokens = 1
        _LIVE.add(self)
        log.info("NIXL agent %s: backend on segment %s", agent, self.engine.segment_name)

    # -- memory ------------------------------------------------------------------------
    @_guarded
    def register(self, address: int, nbytes: int, dev_id: int, mem: int) -> int:
        """Register local memory; a token for deregister, or a negative status."""
        if mem == DRAM_SEG:
            location = "cpu"
        elif mem == VRAM_SEG:
            location = f"cuda:{dev_id}"
        else:
            log.error("NIXL agent %s: memory type %d is not supported (DRAM and VRAM are)",
                      self.agent, mem)
            return ERR_NOT_SUPPORTED
        key = (address, nbytes, location)
        with self._lock:
            share = self._shares.get(key)
            if share is not None:  # the same range again: one registration, counted
                share[1] += 1
                return share[0]
            self.engine.register_address(address, nbytes, location)
            token = self._tokens
            self._tokens += 1
            self._shares[key] = [token, 1]
            self._regions[token] = key
        return token

    @_guarded
    def deregister(self, token: int) -> int:
        with self._lock:
            key = self._regions.get(token)
            if key is None:
                return ERR_NOT_FOUND
            share = self._shares[key]
            share[1] -= 1
            if share[1]:
                return SUCCESS
            del self._shares[key], self._regions[token]
        self.engine.unregister(key[0])
        return SUCCESS

    # -- peers -------------------------------------------------------------------------
    def conn_info(self) -> bytes:
        return self.engine.segment_name.encode()

    @_guarded
    def load_remote_conn_info(self, agent: str, info: bytes) -> int:
        """Take a peer agent's connection info: its segment name, ``host:port``."""
        try:
            name = info.decode("ascii")
            host, _, port = name.rpartition(":")
            valid = 0 < len(info) <= MAX_CONN_INFO and host and 0 < int(port) < 65536
        except (UnicodeDecodeError, ValueError):
            valid = False
        if not valid:
            log.error("NIXL agent %s: connection info of %s is not ours (%r)", self.agent,
                      agent, info[:64])
            return ERR_INVALID_PARAM
        with self._lock:
            old = self._segments.get(agent)
            self._segments[agent] = name
        if old is not None and old != name:
            self.engine.close_segment(old)  # the agent came back elsewhere
        return SUCCESS

    def _segment(self, agent: str) -> str | None:
        if agent == self.agent:
            return self.engine.segment_name
        with self._lock:
            return self._segments.get(agent)

    @_guarded
    def knows(self, agent: str) -> int:
        return SUCCESS if self._segment(agent) is not None else ERR_NOT_FOUND

    @_guarded
    def connect(self, agent: str) -> int:
        """Resolve the agent's segment now (its descriptor, and the transports that reach it)."""
        segment = self._segment(agent)
        if segment is None:
            return ERR_NOT_FOUND
        self.engine.open_segment(segment)
        return SUCCESS

    @_guarded
    def disconnect(self, agent: str) -> int:
        with self._lock:
            segment = self._segments.pop(agent, None)
        if segment is not None:
            self.engine.close_segment(segment)
        return SUCCESS

    # -- transfers -------------------------------------------------------------------
    @_guarded
    def prepare(self, op: int, agent: str, descs: bytes) -> Any:
        """A :class:`Transfer` of ``descs`` (native uint64 triples: local address, remote
        address, length), or a negative status."""
        if op not in (NIXL_READ, NIXL_WRITE):
            return ERR_INVALID_PARAM
        if self._segment(agent) is None:
            log.error("NIXL agent %s: no connection info for agent %s", self.agent, agent)
            return ERR_NOT_FOUND
        words = array("Q", descs)
        code = OpCode.READ if op == NIXL_READ else OpCode.WRITE
        requests = [TransferRequest(code, local, remote, n) for local, remote, n
                    in zip(words[0::3], words[1::3], words[2::3]) if n]
        return Transfer(agent, requests)

    @_guarded
    def post(self, xfer: Transfer, notif: bytes | None) -> int:
        """Start the transfer (again); SUCCESS when it has already completed."""
        if xfer.batch is not None and (not xfer.batch.done() or xfer.notifying):
            return ERR_REPOST_ACTIVE
        if notif is not None and len(notif) > MAX_NOTIF_NBYTES:
            log.error("NIXL agent %s: a notification of %d bytes (at most %d)", self.agent,
                      len(notif), MAX_NOTIF_NBYTES)
            return ERR_INVALID_PARAM
        segment = self._segment(xfer.agent)
        if segment is None:
            return ERR_NOT_FOUND
        xfer.batch, xfer.error, xfer.notifying = None, SUCCESS, notif is not None
        try:
            batch = self.engine.submit(segment, xfer.requests)
        except BaseException:
            xfer.notifying = False
            raise
        xfer.batch = batch
        if notif is not None:  # after the data: the peer sees both or neither
            batch.on_done(lambda done: self._notify_after(xfer, done, segment, notif))
        return self._progress(xfer)

    def _notify_after(self, xfer: Transfer, batch: Batch, segment: str, msg: bytes) -> None:
        try:
            if batch.error() is None and not xfer.released:
                self.engine.notify(segment, self.agent, msg.decode("latin-1"))
        except MooncakeError as exc:
            log.error("NIXL agent %s: notification to %s failed: %s", self.agent, xfer.agent, str(exc))
            xfer.error = status_of(exc)
        finally:
            xfer.notifying = False

    @_guarded
    def check(self, xfer: Transfer) -> int:
        if xfer.batch is None:
            return xfer.error if xfer.error != SUCCESS else ERR_INVALID_PARAM
        now = time.monotonic()
        if now - xfer.checked < BUSY_POLL_S and not xfer.batch.done():
            xfer.batch.wait_done(CHECK_WAIT_S)
        xfer.checked = now
        return self._progress(xfer)

    def _progress(self, xfer: Transfer) -> int:
        batch = xfer.batch
        if not batch.done() or xfer.notifying:
            return IN_PROG
        if xfer.error != SUCCESS:
            return xfer.error
        err = batch.error()
        if err is not None:
            log.error("NIXL agent %s: transfer to %s failed: %s", self.agent, xfer.agent, str(err))
            xfer.error = status_of(err)
            return xfer.error
        return SUCCESS

    @_guarded
    def release(self, xfer: Transfer) -> int:
        """Forget a request. One still running finishes in the engine (its local regions
        stay held until then), and its notification is not sent."""
        xfer.released = True
        return SUCCESS

    # -- notifications -----------------------------------------------------------------
    def notifs(self) -> list[tuple[bytes, bytes]]:
        """Notifications received since the last call, as ``(agent, message)``."""
        try:
            taken = self.engine.take_notifies()
        except MooncakeError as exc:
            log.error("NIXL agent %s: cannot take notifications: %s", self.agent, str(exc))
            return []
        return [(name.encode(), msg.encode("latin-1", "replace")) for name, msg in taken]

    @_guarded
    def gen_notif(self, agent: str, msg: bytes) -> int:
        """Send a notification on its own."""
        if len(msg) > MAX_NOTIF_NBYTES:
            return ERR_INVALID_PARAM
        segment = self._segment(agent)
        if segment is None:
            return ERR_NOT_FOUND
        self.engine.notify(segment, self.agent, msg.decode("latin-1"))
        return SUCCESS

    def close(self) -> None:
        self.closed = True
        self.engine.close()
