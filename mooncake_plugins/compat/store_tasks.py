"""copy/move tasks, replica clearing and other master-side operations of ``MooncakeDistributedStore``.

As the original: ``create_copy_task``/``create_move_task`` return ``(task_id, code)`` with
task id ``(0, 0)`` on failure; ``query_task`` returns ``(QueryTaskResponse | None, code)``.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import re
from typing import TYPE_CHECKING, Sequence

from ..errors import MooncakeError
from ..store import tasks

if TYPE_CHECKING:
    from ..store.client import StoreClient

log = logging.getLogger(__name__)

_NO_TASK = (0, 0)


class TaskType(enum.IntEnum):
    REPLICA_COPY = tasks.COPY
    REPLICA_MOVE = tasks.MOVE

    def __str__(self) -> str:
        return f"TaskType.{self.name}"


class TaskStatus(enum.IntEnum):
    PENDING = tasks.PENDING
    PROCESSING = tasks.PROCESSING
    FAILED = tasks.FAILED
    SUCCESS = tasks.SUCCESS

    def __str__(self) -> str:
        return f"TaskStatus.{self.name}"


_UUID_HEX = re.compile(r"[0-9a-fA-F]{1,32}")


def _uuid_pair(client_id: str) -> tuple[int, int]:
    """The original's ``(high, low)`` UUID of a client id: our clients' ids are 32 hex
    digits; any other id (clients choose their own) maps to a stable 128-bit hash of it."""
    if not client_id:
        return 0, 0
    if _UUID_HEX.fullmatch(client_id):
        n = int(client_id, 16)
    else:
        n = int.from_bytes(hashlib.blake2b(client_id.encode(), digest_size=16).digest(), "big")
    return n >> 64, n & ((1 << 64) - 1)


class QueryTaskResponse:
    """A task's state, as ``query_task`` reports it."""

    def __init__(self, info: dict | None = None) -> None:
        info = info or {}
        self.id: tuple[int, int] = tuple(info.get("id", _NO_TASK))  # type: ignore[assignment]
        self.type = TaskType(info.get("type", tasks.COPY))
        self.status = TaskStatus(info.get("status", tasks.PENDING))
        self.created_at_ms_epoch: int = info.get("created_ms", 0)
        self.last_updated_at_ms_epoch: int = info.get("updated_ms", 0)
        self.assigned_client = _uuid_pair(info.get("client_id", ""))
        self.message: str = info.get("message", "")

    def __repr__(self) -> str:
        return (f"QueryTaskResponse(id={self.id[0]}-{self.id[1]}, type={int(self.type)}, "
                f"status={int(self.status)}, created_at={self.created_at_ms_epoch}, "
                f"last_updated_at={self.last_updated_at_ms_epoch}, assigned_client="
                f"{self.assigned_client[0]}-{self.assigned_client[1]}, message=\"{self.message}\")")


def _code(exc: MooncakeError) -> int:
    return exc.code if exc.code < 0 else -1


class _TaskMethods:
    """Mixed into :class:`mooncake_plugins.compat.store.MooncakeDistributedStore`."""

    client: StoreClient

    def create_copy_task(self, key: str, targets: Sequence[str]) -> tuple[tuple[int, int], int]:
        """Copy ``key`` to every segment of ``targets``: ``(task_id, 0)`` or ``((0, 0), code)``."""
        try:
            return self.client.create_copy_task(key, list(targets)), 0
        except MooncakeError as exc:
            log.error("copy of %r to %s failed: %s", key, list(targets), exc)
            return _NO_TASK, _code(exc)

    def create_move_task(self, key: str, source: str, target: str) -> tuple[tuple[int, int], int]:
        """Move ``key``'s replica on ``source`` to ``target``: ``(task_id, 0)`` or ``((0, 0), code)``."""
        try:
            return self.client.create_move_task(key, source, target), 0
        except MooncakeError as exc:
            log.error("move of %r from %s to %s failed: %s", key, source, target, exc)
            return _NO_TASK, _code(exc)

    def query_task(self, task_id: tuple[int, int]) -> tuple[QueryTaskResponse | None, int]:
        try:
            return QueryTaskResponse(self.client.query_task(task_id)), 0
        except MooncakeError as exc:
            log.error("query of task %s failed: %s", task_id, exc)
            return None, _code(exc)

    def batch_replica_clear(self, keys: list[str], segment_name: str = "") -> list[str]:
        """Clear this client's objects among ``keys`` (only their replicas on
        ``segment_name`` when given) whose lease expired; returns the keys cleared."""
        try:
            return self.client.batch_replica_clear(keys, segment_name)
        except MooncakeError as exc:
            log.error("batch_replica_clear failed: %s", exc)
            return []
