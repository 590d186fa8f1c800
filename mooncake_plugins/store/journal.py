"""The master's durable metadata: committed state written in group commits, replayed at start.

The master records each change of committed state (a segment mounted or gone, an object
made visible, changed or gone) with :meth:`Journal.record` while it holds its lock: that
only stores the name's latest state in the pending batch. A flusher thread writes pending
batches to a backend; RPC handlers call :meth:`Journal.wait` after the master released its
lock, so a call is answered only once its changes are durable, and concurrent calls share
one write. Pending puts are never recorded: after a restart they are simply gone.

Backends: :class:`FileJournal`, an append-only log in a local directory (a single master
that restarts), and :class:`EtcdJournal`, one etcd key per name (an HA group: the new
leader reads what the old one wrote). Why this design: ``docs/store-durability.md``.
"""

from __future__ import annotations

import base64
import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from abc import ABC, abstractmethod
from typing import Any, Iterator

import msgpack

from ..errors import MetadataError, NotSupported

log = logging.getLogger(__name__)

OBJECT, SEGMENT = "o", "s"
Name = tuple[str, str]          # (OBJECT or SEGMENT, object key or segment name)
State = dict[Name, Any]         # a value per name; None in a batch: the name is gone

WAIT_TIMEOUT_S = 10.0
"""How long a call waits for its changes to become durable before it fails."""


class JournalFenced(NotSupported):
    """This master may not write any more (another one leads the group)."""


class JournalBackend(ABC):
    """Where batches go. Called from one thread at a time (the journal's flusher)."""

    @abstractmethod
    def load(self) -> State:
        """The state written so far (gone names left out)."""

    @abstractmethod
    def write(self, batch: State) -> None:
        """Make ``batch`` durable. Raises JournalFenced, or OSError/MetadataError (retried)."""

    @abstractmethod
    def close(self) -> None:
        """Release files and connections."""


class Journal:
    """Group commit of the master's changes to a :class:`JournalBackend` (thread-safe).

    Lock order: the master's lock -> ``_cond`` (never held during I/O).
    """

    def __init__(self, backend: JournalBackend) -> None:
        self.backend = backend
        self._cond = threading.Condition()
        self._pending: State = {}
        self._seq = 0           # changes recorded
        self._durable = 0       # changes written
        self._failed: Exception | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._flush_loop, name="mc-master-journal", daemon=True)
        self.batches = 0
        self.written = 0

    def start(self) -> None:
        self._thread.start()

    @property
    def seq(self) -> int:
        """The number of changes recorded so far (wait for it to cover them)."""
        return self._seq

    def record(self, kind: str, name: str, value: Any) -> None:
        """Note ``name``'s new state (None: gone); no I/O."""
        with self._cond:
            self._pending[(kind, name)] = value
            self._seq += 1
            self._cond.notify_all()

    def wait(self, seq: int, timeout_s: float = WAIT_TIMEOUT_S) -> None:
        """Block until the first ``seq`` changes are durable.

        Raises:
            JournalFenced: another master leads now; MetadataError: not written in time.
        """
        if self._durable >= seq:
            return
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._durable < seq:
                if self._failed is not None:
                    raise JournalFenced(str(self._failed))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MetadataError(f"the metadata journal did not write within {timeout_s} s")
                self._cond.wait(left)

    def _flush_loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                batch, self._pending = self._pending, {}
                upto = self._seq
            try:
                self.backend.write(batch)
            except JournalFenced as exc:
                log.error("metadata journal stopped: %s", exc)
                with self._cond:
                    self._failed = exc
                    self._cond.notify_all()
                return
            except (OSError, MetadataError) as exc:
                log.warning("metadata journal write failed, retrying: %s", exc)
                with self._cond:
                    batch.update(self._pending)   # newer states win
                    self._pending = batch
                    closing = self._closing
                if closing:
                    return
                time.sleep(0.1)
                continue
            with self._cond:
                self._durable = upto
                self.batches += 1
                self.written += len(batch)
                self._cond.notify_all()

    def close(self) -> None:
        """Write what is pending (one attempt), stop the flusher, close the backend."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        self.backend.close()


# -- value encoding ---------------------------------------------------------------------

def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# -- a local append-only log ------------------------------------------------------------

_FRAME = struct.Struct("<II")    # payload length, crc32 of the payload
_FRAME_RECORDS = 10_000          # records per frame when the log is rewritten
_COMPACT_MIN_NBYTES = 64 << 20


class FileJournal(JournalBackend):
    """``<directory>/journal.log``: frames ``u32 length | u32 crc32 | msgpack [[kind, name,
    value], ...]``, one per batch. A torn last frame (a crash mid-write) is dropped at load;
    the log is rewritten compacted at load and whenever it grew to twice that size (64 MiB
    at least). ``fsync``: sync every batch to the device (survives power loss, not only a
    crash of the master). One master per directory (an exclusive lock on ``lock``).
    """

    def __init__(self, directory: str, fsync: bool = False) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "journal.log")
        self._fsync = fsync
        self._lock_fd = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise MetadataError(f"another master uses the metadata directory {directory}") from None
        self._file: Any = None
        self._nbytes = 0
        self._compact_at = _COMPACT_MIN_NBYTES

    def _frames(self) -> Iterator[list]:
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return
        with f:
            while True:
                head = f.read(_FRAME.size)
                if len(head) < _FRAME.size:
                    return
                n, crc = _FRAME.unpack(head)
                payload = f.read(n)
                if len(payload) < n or zlib.crc32(payload) != crc:
                    log.warning("metadata journal %s: dropping a torn frame at its end", self.path)
                    return
                yield _unpack(payload)

    def load(self) -> State:
        state: State = {}
        for frame in self._frames():
            for kind, name, value in frame:
                if value is None:
                    state.pop((kind, name), None)
                else:
                    state[(kind, name)] = value
        self._rewrite(state)
        return state

    def _rewrite(self, state: State) -> None:
        """Replace the log by one holding ``state`` only (atomically, by rename)."""
        if self._file is not None:
            self._file.close()
        tmp = self.path + ".tmp"
        items = [[k, n, v] for (k, n), v in state.items()]
        with open(tmp, "wb") as f:
            for i in range(0, len(items), _FRAME_RECORDS):
                f.write(self._frame(items[i:i + _FRAME_RECORDS]))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._file = open(self.path, "ab")
        self._nbytes = self._file.tell()
        self._compact_at = max(_COMPACT_MIN_NBYTES, 2 * self._nbytes)

    @staticmethod
    def _frame(records: list) -> bytes:
        payload = _pack(records)
        return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload

    def write(self, batch: State) -> None:
        frame = self._frame([[k, n, v] for (k, n), v in batch.items()])
        self._file.write(frame)
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())
        self._nbytes += len(frame)
        if self._nbytes >= self._compact_at:
            self._file.close()
            self._file = None
            self.load()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        os.close(self._lock_fd)


# -- etcd ---------------------------------------------------------------------------------

_TXN_OPS = 128                  # etcd's default --max-txn-ops
_TXN_NBYTES = 1 << 20           # under etcd's default 1.5 MiB request limit
_RANGE_LIMIT = 1000


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class EtcdJournal(JournalBackend):
    """One key per name under ``mooncake-store/<cluster_id>/meta/``; each write is a
    transaction that only succeeds while ``lease_id`` still holds the group's leader key,
    so a deposed leader can never overwrite what its successor recovered."""

    def __init__(self, etcd_endpoints: str, cluster_id: str, lease_id: int) -> None:
        from .ha import _EtcdCluster, leader_key, parse_etcd_endpoints

        self._cluster = _EtcdCluster(parse_etcd_endpoints(etcd_endpoints))
        self._prefix = f"mooncake-store/{cluster_id}/meta/".encode()
        self._fence = {"key": _b64(leader_key(cluster_id).encode()), "target": "LEASE",
                       "result": "EQUAL", "lease": lease_id}

    def _key(self, kind: str, name: str) -> bytes:
        return self._prefix + kind.encode() + b"/" + name.encode("utf-8", "surrogatepass")

    def load(self) -> State:
        end = self._prefix[:-1] + bytes([self._prefix[-1] + 1])
        start = self._prefix
        state: State = {}
        while True:
            reply = self._cluster.call("journal load", "/kv/range",
                                       {"key": _b64(start), "range_end": _b64(end),
                                        "limit": _RANGE_LIMIT})
            kvs = reply.get("kvs") or []
            for kv in kvs:
                key = base64.b64decode(kv["key"])
                kind, _, name = key[len(self._prefix):].decode("utf-8", "surrogatepass").partition("/")
                state[(kind, name)] = _unpack(base64.b64decode(kv.get("value", "")))
            if not reply.get("more") or not kvs:
                return state
            start = base64.b64decode(kvs[-1]["key"]) + b"\0"

    def write(self, batch: State) -> None:
        ops: list[dict] = []
        nbytes = 0
        for (kind, name), value in batch.items():
            key = _b64(self._key(kind, name))
            op = {"request_delete_range": {"key": key}} if value is None else \
                {"request_put": {"key": key, "value": _b64(_pack(value))}}
            size = len(key) + (0 if value is None else len(op["request_put"]["value"]))
            if ops and (len(ops) == _TXN_OPS or nbytes + size > _TXN_NBYTES):
                self._commit(ops)
                ops, nbytes = [], 0
            ops.append(op)
            nbytes += size
        if ops:
            self._commit(ops)

    def _commit(self, ops: list[dict]) -> None:
        reply = self._cluster.call("journal write", "/kv/txn",
                                   {"compare": [self._fence], "success": ops})
        if not reply.get("succeeded"):
            raise JournalFenced("this master's lease no longer holds the leader key")

    def close(self) -> None:
        self._cluster.close()
