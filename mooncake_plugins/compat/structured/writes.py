"""Store writes with an optional ReplicateConfig, status checks and best-effort cleanup.

A structured object spans many store keys but belongs to one *storage group*: callers
give at most one ``config.group_ids`` entry and it is repeated for every key a single
write call covers. The caller's config object is never modified; a copy is made when
its group ids must change.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from .records import MISSING_OBJECT_ERROR

DUPLICATE_REGISTRATION = -600
"""Status ``register_buffer`` gives for memory that is already registered."""

_CONFIG_FIELDS = ("data_type", "group_ids", "nof_replica_num", "prefer_alloc_in_same_node",
                  "preferred_nof_segments", "preferred_segment", "preferred_segments",
                  "replica_num", "with_hard_pin", "with_soft_pin")

_ONE_GROUP = ("structured object store config.group_ids must contain exactly one logical "
              "group id; it is expanded across internal Mooncake keys")
_STRINGS = "structured object store config.group_ids must contain strings"


def check_status(status: Any, operation: str, key: str) -> None:
    """Raise RuntimeError unless a store call returned 0 (or None)."""
    if status not in (None, 0):
        raise RuntimeError(f"{operation} failed for {key}: {status}")


def copy_config(config: Any) -> Any:
    """A shallow copy of a write config; one that cannot be copied is rebuilt field by
    field on a default-constructed instance of its type."""
    try:
        return copy.copy(config)
    except TypeError:
        pass
    try:
        copied = type(config)()
    except Exception as exc:
        raise TypeError("structured object store config must be copyable or "
                        "default-constructible") from exc
    for name in _CONFIG_FIELDS:
        try:
            value = getattr(config, name)
        except Exception:
            continue
        if isinstance(value, (list, tuple)):
            value = type(value)(value)
        try:
            setattr(copied, name, value)
        except Exception as exc:
            raise TypeError(f"structured object store config field {name!r} is not "
                            "writable") from exc
    return copied


def config_for_keys(config: Any, key_count: int) -> Any:
    """``config`` with its one group id repeated ``key_count`` times (the config itself
    when nothing changes; an empty group list becomes ``None``)."""
    if config is None or key_count <= 0:
        return config
    group_ids = getattr(config, "group_ids", None)
    if group_ids is None:
        return config
    was_string = isinstance(group_ids, str)
    ids = [group_ids] if was_string else list(group_ids)
    if not ids:
        ungrouped = copy_config(config)
        ungrouped.group_ids = None
        return ungrouped
    if len(ids) != 1:
        raise ValueError(_ONE_GROUP)
    if key_count == 1 and not was_string:
        return config
    grouped = copy_config(config)
    grouped.group_ids = [ids[0]] * key_count
    return grouped


def storage_group_for(config: Any) -> str | None:
    """The storage group a new object gets: the config's one group id, a fresh opaque
    ``structured-<hex>`` id when it names none, or None for an explicit ``""``."""
    raw = getattr(config, "group_ids", None)
    if raw is None or isinstance(raw, str):
        group = raw
    else:
        try:
            ids = list(raw)
        except TypeError as exc:
            raise ValueError(_STRINGS) from exc
        if len(ids) > 1:
            raise ValueError(_ONE_GROUP)
        group = ids[0] if ids else None
    if group is None:
        return f"structured-{uuid.uuid4().hex}"
    if not isinstance(group, str):
        raise ValueError(_STRINGS)
    return group or None


def config_in_group(config: Any, group_id: str, default_factory: Any = None) -> Any:
    """A copy of ``config`` (or a new config) whose group is ``group_id``; ValueError when
    ``config`` names another group."""
    named = getattr(config_for_keys(config, 1), "group_ids", None)
    if named and named[0] and named[0] != group_id:
        raise ValueError("config.group_ids conflicts with the DataProto storage group")
    if config is None:
        grouped = (default_factory or SimpleNamespace)()
    else:
        grouped = copy_config(config)
    grouped.group_ids = [group_id]
    return grouped


def call_with_config(fn: Any, *args: Any, config: Any = None) -> Any:
    """``fn(*args)``, passing ``config=`` only when there is one (fakes may lack it)."""
    return fn(*args) if config is None else fn(*args, config=config)


def put(store: Any, key: str, value: Any, config: Any = None) -> int:
    return call_with_config(store.put, key, value, config=config_for_keys(config, 1))


def put_from(store: Any, key: str, ptr: int, size: int, config: Any = None) -> int:
    """``put_tensor_from`` (no config) or ``put_from`` of registered memory."""
    config = config_for_keys(config, 1)
    put_tensor_from = getattr(store, "put_tensor_from", None)
    if config is None and callable(put_tensor_from):
        return put_tensor_from(key, ptr, size)
    plain = getattr(store, "put_from", None)
    if callable(plain):
        return call_with_config(plain, key, ptr, size, config=config)
    raise RuntimeError("put_from is unavailable")


def batch_put_from(fn: Any, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
                   config: Any = None) -> Sequence[int]:
    return call_with_config(fn, list(keys), list(ptrs), list(sizes),
                            config=config_for_keys(config, len(keys)))


def check_results(results: Sequence[Any], keys: Sequence[str], operation: str) -> None:
    """Raise unless a batch call returned one 0 per key."""
    if len(results) != len(keys):
        raise RuntimeError(f"{operation} returned {len(results)} results for {len(keys)} chunks")
    for key, status in zip(keys, results):
        check_status(status, operation, key)


def remove_keys(store: Any, keys: Sequence[str], strict: bool) -> None:
    """Remove ``keys`` (forced; already missing ones are fine).

    ``batch_remove`` is tried first and keys it could not remove are retried one by one.
    With ``strict`` any remaining failure raises; without, cleanup is best effort and
    never masks the error that caused it.
    """
    pending = list(dict.fromkeys(keys))
    batch_remove = getattr(store, "batch_remove", None)
    if callable(batch_remove) and pending:
        try:
            try:
                results = batch_remove(pending, True)
            except TypeError:
                results = batch_remove(pending)
            if len(results) != len(pending):
                raise RuntimeError(f"batch_remove returned {len(results)} results for "
                                   f"{len(pending)} keys")
            pending = [key for key, status in zip(pending, results)
                       if status not in (None, 0, MISSING_OBJECT_ERROR)]
            if not pending:
                return
        except Exception:
            if strict:
                raise
    failures = []
    for key in pending:
        try:
            status = store.remove(key, True)
        except KeyError:
            continue
        except Exception:
            if strict:
                raise
            continue
        if status not in (None, 0, MISSING_OBJECT_ERROR):
            failures.append((key, status))
    if failures and strict:
        raise RuntimeError(f"failed to remove {len(failures)} Mooncake keys: {failures[:3]}")
