"""``DataProtoCatalogTransfer``: writes DataProto fragments and publishes them in a catalog.

The catalog (:class:`mooncake_plugins.store.catalog.DataProtoCatalog`, possibly in
another process) is reached through ``catalog_call(method, *args, **kwargs)``. Every
publication carries an operation id, so a retried call is applied once; a publication
that still fails is kept and retried before the next write (and by :meth:`close`).
Fragments the catalog retires (no key and no pinned read refers to them any more) are
removed from the store here and then acknowledged.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from mooncake_plugins.store.catalog import normalize_handle

from .dataproto import batch_size_of, export_dataproto_ref, split_sections

log = logging.getLogger(__name__)

RESULTS_ATTR = "_mooncake_catalog_results"


def _name(value: Any, label: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{label} must be a non-empty string")
    return value


def _keys(keys: Any) -> tuple[str, ...]:
    if isinstance(keys, str):
        raise ValueError("keys must be a sequence of non-empty strings")
    names = tuple(keys)
    if not names or not all(isinstance(k, str) and k for k in names):
        raise ValueError("keys must be non-empty strings")
    if len(set(names)) != len(names):
        raise ValueError("keys must be unique")
    return names


def _rows(data: Any, keys: Sequence[str]) -> None:
    """Raise unless the DataProto-like ``data`` has one row per key."""
    rows = batch_size_of(*split_sections(data)[:2])
    if rows != len(keys):
        raise ValueError(f"DataProto batch size {rows} does not match {len(keys)} "
                         "logical keys")


def _tags(tags: Sequence[Mapping[str, Any]] | None, count: int) -> list[dict[str, Any]] | None:
    if tags is None:
        return None
    if len(tags) != count:
        raise ValueError("tags must have the same length as keys")
    if not all(isinstance(t, Mapping) for t in tags):
        raise TypeError("tags must be mappings")
    return [dict(t) for t in tags]


class DataProtoCatalogTransfer:
    """A :class:`MooncakeBundleTransfer` whose writes are published in a catalog."""

    def __init__(self, transfer: Any, catalog_call: Callable[..., Any]) -> None:
        self.transfer = transfer
        self._call = catalog_call
        self._lock = threading.RLock()
        self._pending_publications: list[dict[str, Any]] = []
        self._pending_acks: list[str] = []
        self._pending_results: list[Any] = []

    # -- writes -------------------------------------------------------------------------

    def put(self, data: Any, *, partition: str, keys: Sequence[str],
            tags: Sequence[Mapping[str, Any]] | None = None, **put_kwargs: Any
            ) -> dict[str, Any]:
        """Store ``data`` (row ``i`` is ``keys[i]``) as one fragment and publish it,
        with ``tags``; either may be omitted, not both."""
        self._flush(strict=True)
        partition = _name(partition, "partition")
        keys = _keys(keys)
        tags = _tags(tags, len(keys))
        if data is None and tags is None:
            raise ValueError("catalog update requires tags or DataProto data")
        handle = None
        if data is not None:
            _rows(data, keys)
            handle = export_dataproto_ref(
                self.transfer.put(data, type="dataproto", partition=partition, **put_kwargs))
        return self._publish_with_retry({
            "operation_id": uuid.uuid4().hex, "method": "publish", "args": (partition, keys),
            "kwargs": {"tags": tags, "handle": handle}})

    def append(self, fragment_id: str, handle: Mapping[str, Any], data: Any, *,
               partition: str, keys: Sequence[str], stage: str, **append_kwargs: Any
               ) -> dict[str, Any]:
        """Append ``data``'s fields to published fragment ``fragment_id`` (whose current
        handle is ``handle``) and publish the appended fragment in its place."""
        self._flush(strict=True)
        fragment_id = _name(fragment_id, "fragment_id")
        partition = _name(partition, "partition")
        keys = _keys(keys)
        if append_kwargs.get("overwrite"):
            raise ValueError("catalog append does not support overwrite")
        _rows(data, keys)
        previous = normalize_handle(handle)
        if previous.partition != partition:
            raise ValueError("DataProto handle partition does not match Catalog partition")
        plan = self._call("resolve", partition, keys, list(previous.fields))
        if plan["handles"].get(fragment_id) != previous.handle:
            raise ValueError(f"stale DataProto append handle: {fragment_id!r}")
        appended = export_dataproto_ref(self.transfer.append_dataproto_fields(
            previous.handle, data, stage=stage, **append_kwargs))
        result = self._publish_with_retry({
            "operation_id": uuid.uuid4().hex, "method": "publish_append",
            "args": (fragment_id, partition, keys),
            "kwargs": {"previous_handle": previous.handle, "handle": appended}})
        if result.get("append_rejected") is not None:
            raise ValueError(result["append_rejected"])
        return result

    def remove(self, partition: str, keys: Sequence[str]) -> None:
        """Drop logical keys; fragments nothing refers to any more are removed."""
        self._clean_retired(self._call("remove", partition, keys))

    def drain(self) -> None:
        """Publish what is pending, then retire and remove every managed fragment."""
        for attempt in range(2):
            try:
                self._retry_publications(strict=True)
                self._clean_retired(self._call("drain"), strict=True)
                return
            except Exception:
                if attempt:
                    raise
                log.exception("retrying DataProto catalog drain")

    def close(self) -> None:
        """Finish pending releases, publications and acknowledgements (raise if any fail)."""
        self.discard_results((), strict=True)
        self._retry_publications(strict=True)
        self._retry_acks(strict=True)

    # -- reads --------------------------------------------------------------------------

    def resolve(self, partition: str, keys: Sequence[str],
                fields: Sequence[str] | None = None) -> dict[str, Any]:
        """A pinned read plan; pass its ``read_token`` to :meth:`release_read`."""
        return self._call("resolve", partition, keys, fields, pin=True)

    def release_read(self, token: int) -> None:
        self._clean_retired(self._call("release_read", token))

    def list(self, partition: str | None = None) -> dict[str, dict[str, Any]]:
        return self._call("list", partition)

    def attach_results(self, output: Any, results: Sequence[Any]) -> None:
        """Remember the raw read results behind ``output`` for :meth:`release_result`."""
        setattr(output, RESULTS_ATTR, list(results))

    def release_result(self, output: Any) -> None:
        results = getattr(output, RESULTS_ATTR, ()) or ()
        setattr(output, RESULTS_ATTR, [])
        self.discard_results(results)

    def discard_results(self, results: Sequence[Any], *, strict: bool = False) -> None:
        """Release the pool buffers of read results (kept for retry if that fails)."""
        self._retry("_pending_results", results, self.transfer.release_result,
                    "release DataProto read buffer", attempts=2, strict=strict)

    # -- internals ----------------------------------------------------------------------

    def _flush(self, strict: bool) -> None:
        self._retry_acks()
        self._retry_publications(strict=strict)

    def _publish_with_retry(self, publication: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._publish(publication)
        except Exception:
            log.exception("retrying DataProto catalog publication")
        try:
            return self._publish(publication)
        except Exception:
            with self._lock:
                self._pending_publications.append(publication)
            raise

    def _publish(self, publication: Mapping[str, Any]) -> dict[str, Any]:
        operation = publication["operation_id"]
        result = self._call(publication["method"], operation, *publication["args"],
                            **publication["kwargs"])
        if publication["method"] == "publish_append" and result.get("append_rejected"):
            kwargs = publication["kwargs"]
            self.transfer.cleanup_dataproto_append(kwargs["previous_handle"], kwargs["handle"])
        self._clean_retired(result)
        try:
            self._call("ack_publication", operation)
        except Exception:
            log.exception("failed to acknowledge DataProto catalog publication")
            with self._lock:
                if operation not in self._pending_acks:
                    self._pending_acks.append(operation)
        return result

    def _clean_retired(self, result: Mapping[str, Any], *, strict: bool = False) -> None:
        removed, failures = [], 0
        for handle in result.get("retired_handles", ()):
            try:
                self.transfer.cleanup_dataproto(handle)
            except Exception:
                failures += 1
                log.exception("failed to clean up retired DataProto fragment")
            else:
                removed.append(handle)
        if removed:
            try:
                self._call("ack_retired", removed)
            except Exception:
                log.exception("failed to acknowledge retired DataProto fragments")
                if strict:
                    raise
        if strict and failures:
            raise RuntimeError(f"failed to clean up {failures} retired DataProto fragment(s)")

    def _retry_acks(self, *, strict: bool = False) -> None:
        self._retry("_pending_acks", (), lambda op: self._call("ack_publication", op),
                    "acknowledge DataProto catalog publication", strict=strict)

    def _retry_publications(self, *, strict: bool = False) -> None:
        self._retry("_pending_publications", (), self._publish,
                    "publish pending DataProto fragment", strict=strict)

    def _retry(self, attr: str, extra: Iterable[Any], action: Callable[[Any], Any],
               label: str, *, attempts: int = 1, strict: bool = False) -> None:
        """Run ``action`` on the pending items of ``attr`` plus ``extra``; keep failures."""
        with self._lock:
            pending = [*getattr(self, attr), *extra]
            setattr(self, attr, [])
        for _ in range(attempts):
            failed = []
            for item in pending:
                try:
                    action(item)
                except Exception:
                    log.exception("failed to %s", label)
                    failed.append(item)
            pending = failed
        with self._lock:
            getattr(self, attr).extend(pending)
            left = len(getattr(self, attr))
        if strict and left:
            raise RuntimeError(f"failed to {label} for {left} item(s)")
