"""Bookkeeping of replica repair: objects waiting for replicas lost with a dead holder.

When the master drops the segments of a client that died, each complete object left with
fewer memory replicas than it should have (``ObjectMeta.replica_num``) waits here. The
master's reaper (``MasterService.advance_repairs``) starts a copy task (tasks.py) for
waiting objects, at most ``max_running`` at a time: the client owning a surviving replica
copies the bytes into replicas the master reserved on other live segments, and they become
readable only at that copy's ``replica_end``. A failed task is retried after a backoff,
``MAX_ATTEMPTS`` times in all; an object no live segment has room for keeps waiting (it
stays readable from its surviving replica) until room appears, e.g. a new holder joins.

Not thread-safe: the master uses it under its own lock.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass

from .tasks import TaskId

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 5
"""Copy tasks tried per object before its repair is given up (with an error log line)."""
SCAN_PER_PASS = 256
"""Waiting objects looked at per pass at most (the work a pass does under the lock)."""


@dataclass
class _Waiting:
    failures: int = 0
    not_before: float = 0.0     # monotonic: no new attempt before (backoff after a failure)


@dataclass
class Running:
    """A copy task repairing ``key``: ``client_id`` copies ``nbytes`` to each of ``targets``."""

    key: str
    client_id: str
    targets: list[str]
    nbytes: int
    wait: _Waiting


class RepairQueue:
    """Objects waiting for a repair (oldest first) and the copy tasks running one."""

    def __init__(self, max_running: int) -> None:
        self.max_running = max_running
        self._waiting: OrderedDict[str, _Waiting] = OrderedDict()
        self._running: dict[TaskId, Running] = {}
        self._blocked: set[str] = set()      # waiting, and no segment had room at the last try
        self.recreated = 0                   # replicas published by repair copies
        self.failed = 0                      # repair copy tasks that failed
        self.abandoned = 0                   # objects given up after MAX_ATTEMPTS failures

    @property
    def enabled(self) -> bool:
        return self.max_running > 0

    def add(self, key: str) -> None:
        """Queue ``key`` (nothing when it waits or is being repaired already)."""
        if self.enabled and key not in self._waiting and not self.running_for(key):
            self._waiting[key] = _Waiting()

    def running_for(self, key: str, client_id: str | None = None) -> bool:
        """Whether a repair copy of ``key`` runs (by ``client_id``, when given)."""
        return any(r.key == key and client_id in (None, r.client_id)
                   for r in self._running.values())

    def due(self, now: float) -> list[str]:
        """Waiting keys to try now, oldest first, at most SCAN_PER_PASS of them. Each must
        then be passed to :meth:`start`, :meth:`drop`, :meth:`later` or :meth:`block`."""
        out = []
        for key in list(itertools.islice(self._waiting, SCAN_PER_PASS)):
            if self._waiting[key].not_before <= now:
                out.append(key)
            else:
                self._waiting.move_to_end(key)
        return out

    @property
    def has_room(self) -> bool:
        return len(self._running) < self.max_running

    def start(self, key: str, task_id: TaskId, client_id: str, targets: list[str],
              nbytes: int) -> None:
        """Copy task ``task_id`` (``client_id`` copies ``nbytes`` to ``targets``) repairs ``key``."""
        self._running[task_id] = Running(key, client_id, targets, nbytes, self._waiting.pop(key))
        self._blocked.discard(key)

    def drop(self, key: str) -> None:
        """``key`` needs no repair (any more): it is whole again, gone or unrepairable."""
        self._waiting.pop(key, None)
        self._blocked.discard(key)

    def later(self, key: str) -> None:
        """Try ``key`` again in a later pass (busy with another copy, no live source yet)."""
        self._waiting.move_to_end(key)

    def block(self, key: str) -> bool:
        """No segment has room for ``key``'s new replicas: it waits at the back. Returns
        whether it was not blocked before."""
        self._waiting.move_to_end(key)
        new = key not in self._blocked
        self._blocked.add(key)
        return new

    def running(self) -> list[tuple[TaskId, Running]]:
        return list(self._running.items())

    def succeeded(self, task_id: TaskId) -> None:
        self._running.pop(task_id)

    def failed_task(self, task_id: TaskId, now: float) -> None:
        """A repair copy failed: retry after a backoff, or give up after MAX_ATTEMPTS."""
        run = self._running.pop(task_id)
        key, wait = run.key, run.wait
        self.failed += 1
        wait.failures += 1
        if wait.failures >= MAX_ATTEMPTS:
            self.abandoned += 1
            log.error("replica repair of %r given up after %d failed copies: it stays with "
                      "fewer replicas", key, wait.failures)
            return
        wait.not_before = now + min(60.0, 2.0 ** wait.failures)
        self._waiting[key] = wait

    def stats(self) -> dict[str, int]:
        return {"repairs_waiting": len(self._waiting), "repairs_running": len(self._running),
                "repairs_blocked": len(self._blocked), "replicas_recreated": self.recreated,
                "repairs_failed": self.failed, "repairs_abandoned": self.abandoned}
