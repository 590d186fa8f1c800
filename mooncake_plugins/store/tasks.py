"""Replica copy/move tasks: the master's queue of them and the client that runs one.

The master validates a task and queues it for the client that owns the source segment;
that client picks it up with its next heartbeat, runs it (``replica_start``: the master
reserves the new replicas; the client copies the bytes; ``replica_end``: they become
readable and, for a move, the source replica goes) and reports the outcome. Task ids
are ``(high, low)`` 64-bit halves of a random UUID, as the original's.

Statuses: PENDING (queued) -> PROCESSING (handed to the client) -> SUCCESS | FAILED. A
task its client does not finish within ``processing_timeout_s`` (or pick up within
``pending_timeout_s``) fails. At most ``max_finished`` finished tasks are remembered.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from ..errors import InvalidParams, MooncakeError, TaskLimitExceeded, TaskNotFound

log = logging.getLogger(__name__)

PENDING, PROCESSING, FAILED, SUCCESS = 0, 1, 2, 3     # the original's TaskStatus values
STATUS_NAMES = ("PENDING", "PROCESSING", "FAILED", "SUCCESS")
COPY, MOVE = 0, 1
TYPE_NAMES = ("REPLICA_COPY", "REPLICA_MOVE")

TaskId = tuple[int, int]


def new_task_id() -> TaskId:
    n = uuid.uuid4().int
    return n >> 64, n & ((1 << 64) - 1)


@dataclass(eq=False)
class Task:
    id: TaskId
    type: int
    key: str
    source: str
    targets: list[str]
    client_id: str
    status: int = PENDING
    message: str = ""
    created_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    updated_ms: int = 0
    deadline: float = 0.0     # monotonic: when a PENDING or PROCESSING task times out

    def to_wire(self) -> dict:
        return {"id": list(self.id), "type": self.type, "key": self.key, "source": self.source,
                "targets": self.targets, "client_id": self.client_id, "status": self.status,
                "message": self.message, "created_ms": self.created_ms,
                "updated_ms": self.updated_ms or self.created_ms}


class TaskQueue:
    """Every task the master knows, by id; thread-safe."""

    def __init__(self, *, max_pending: int = 10000, max_finished: int = 10000,
                 pending_timeout_s: float = 300.0, processing_timeout_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._tasks: dict[TaskId, Task] = {}
        self._open: dict[TaskId, Task] = {}     # PENDING or PROCESSING: what the scans look at
        self._finished: OrderedDict[TaskId, None] = OrderedDict()
        self._max_pending, self._max_finished = max_pending, max_finished
        self._pending_timeout_s, self._processing_timeout_s = pending_timeout_s, processing_timeout_s
        self._clock = clock

    def submit(self, type_: int, key: str, source: str, targets: list[str], client_id: str) -> TaskId:
        with self._lock:
            if sum(t.status == PENDING for t in self._open.values()) >= self._max_pending:
                raise TaskLimitExceeded(f"{self._max_pending} tasks are pending already")
            task = Task(new_task_id(), type_, key, source, list(targets), client_id,
                        deadline=self._clock() + self._pending_timeout_s)
            self._tasks[task.id] = self._open[task.id] = task
        log.info("task %s: %s of %r from %s to %s, run by client %s", task.id, TYPE_NAMES[type_],
                 key, source, targets, client_id)
        return task.id

    def get(self, task_id: TaskId) -> dict:
        with self._lock:
            task = self._tasks.get(tuple(task_id))  # type: ignore[arg-type]
            if task is None:
                raise TaskNotFound(f"no task {tuple(task_id)}")
            return task.to_wire()

    def status(self, task_id: TaskId) -> int | None:
        """A task's status, None when it is unknown (or forgotten)."""
        with self._lock:
            task = self._tasks.get(task_id)
            return None if task is None else task.status

    def message(self, task_id: TaskId) -> str:
        """What a task's client reported (why it failed), "" when it is unknown."""
        with self._lock:
            task = self._tasks.get(task_id)
            return "" if task is None else task.message

    def take(self, client_id: str) -> list[dict]:
        """The pending tasks of ``client_id``, now PROCESSING (the heartbeat hands them over)."""
        with self._lock:
            now = self._clock()
            out = []
            for t in self._open.values():
                if t.client_id == client_id and t.status == PENDING:
                    t.status, t.deadline = PROCESSING, now + self._processing_timeout_s
                    t.updated_ms = int(time.time() * 1000)
                    out.append(t.to_wire())
            return out

    def complete(self, client_id: str, task_id: TaskId, ok: bool, message: str) -> str:
        """Finish ``client_id``'s running task; returns the task's key."""
        with self._lock:
            task = self._tasks.get(tuple(task_id))  # type: ignore[arg-type]
            if task is None:
                raise TaskNotFound(f"no task {tuple(task_id)}")
            if task.client_id != client_id or task.status != PROCESSING:
                raise InvalidParams(f"task {task.id} is not being run by client {client_id}")
            self._finish(task, SUCCESS if ok else FAILED, message)
            return task.key

    def _finish(self, task: Task, status: int, message: str) -> None:
        task.status, task.message = status, message
        self._open.pop(task.id, None)
        task.updated_ms = int(time.time() * 1000)
        self._finished[task.id] = None
        while len(self._finished) > self._max_finished:
            old, _ = self._finished.popitem(last=False)
            self._tasks.pop(old, None)

    def fail_client(self, client_id: str, why: str) -> None:
        """Fail the unfinished tasks of a client that went away."""
        with self._lock:
            for t in list(self._open.values()):
                if t.client_id == client_id:
                    self._finish(t, FAILED, why)

    def expire(self) -> list[tuple[str, str]]:
        """Fail tasks that waited or ran past their timeout; returns their (client id, key)."""
        with self._lock:
            now = self._clock()
            expired = []
            for t in list(self._open.values()):
                if now > t.deadline:
                    self._finish(t, FAILED, f"timed out while {STATUS_NAMES[t.status]}")
                    expired.append((t.client_id, t.key))
            return expired

    def unfinished(self) -> int:
        with self._lock:
            return len(self._open)


class TaskRunner(Protocol):
    """What :func:`run_task` needs of the client that runs a task (``StoreClient``,
    which imports this module, so it is not imported here)."""

    client_id: str

    def copy_replicas(self, key: str, source: str, targets: Sequence[str],
                      move: bool = False) -> None: ...

    def call_master(self, method: str, **args: Any) -> Any: ...


def run_task(client: TaskRunner, task: dict) -> None:
    """Run one task handed to ``client`` and report its outcome to the master."""
    ok, message = True, ""
    try:
        client.copy_replicas(task["key"], task["source"], task["targets"], move=task["type"] == MOVE)
    except Exception as exc:  # whatever it was, the master must hear the task failed
        ok, message = False, f"{type(exc).__name__}: {exc}"
        log.warning("task %s (%s of %r) failed: %s", task["id"], TYPE_NAMES[task["type"]],
                    task["key"], message, exc_info=not isinstance(exc, MooncakeError))
    try:
        client.call_master("complete_task", client_id=client.client_id, task_id=task["id"],
                           ok=ok, message=message)
    except Exception as exc:
        log.warning("could not report task %s: %s", task["id"], exc)


JOB_STATUS_NAMES = ("CREATED", "PLANNING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELED")
JOB_RUNNING, JOB_SUCCEEDED, JOB_FAILED, JOB_CANCELED = 2, 3, 4, 5


@dataclass(eq=False)
class DrainJob:
    """Moving every replica off ``segments`` (to ``targets``, or anywhere else when empty),
    at most ``max_concurrency`` move tasks at a time. The master drives it."""

    id: str
    segments: list[str]
    targets: list[str]
    max_concurrency: int
    status: int = JOB_RUNNING
    active: dict[TaskId, str] = field(default_factory=dict)   # move task -> key
    failed_keys: set[str] = field(default_factory=set)         # not retried
    succeeded_units: int = 0
    failed_units: int = 0
    created_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    updated_ms: int = 0

    @property
    def finished(self) -> bool:
        return self.status in (JOB_SUCCEEDED, JOB_FAILED, JOB_CANCELED)

    def to_wire(self) -> dict:
        return {"job_id": self.id, "type": 0, "type_name": "DRAIN", "status": self.status,
                "status_name": JOB_STATUS_NAMES[self.status],
                "created_at_ms_epoch": self.created_ms,
                "last_updated_at_ms_epoch": self.updated_ms or self.created_ms,
                "segments": list(self.segments), "target_segments": list(self.targets),
                "succeeded_units": self.succeeded_units, "failed_units": self.failed_units,
                "blocked_units": 0, "active_units": len(self.active)}
