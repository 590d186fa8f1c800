"""Transfer requests, their slices, and the status of a batch.

A :class:`Batch` is completed by the engine's worker threads; callers poll
``status()``/``done()`` or block in ``wait()``. Lock order: ``Batch._lock`` is a leaf.
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Callable, NamedTuple

from ..errors import InvalidArgument, MooncakeError, TransferTimeout
from .segment import MAX_ADDRESS

log = logging.getLogger("mooncake_plugins.transfer")


class OpCode(enum.IntEnum):
    """Direction of a request, seen from the initiator (values match the original)."""

    READ = 0
    WRITE = 1


class TransferStatus(enum.IntEnum):
    """Status of one request or a whole batch (values match the original's enum)."""

    WAITING = 0
    PENDING = 1
    INVALID = 2
    CANCELED = 3
    COMPLETED = 4
    TIMEOUT = 5
    FAILED = 6


class TransferRequest(NamedTuple):
    """Move ``nbytes`` between local ``local_address`` and the target's ``remote_address``.

    A plain tuple, cheap to build by the thousand; ``TransferEngine.submit`` validates it.
    """

    op: OpCode
    local_address: int
    remote_address: int
    nbytes: int


def validate_request(r: TransferRequest) -> None:
    """Raise InvalidArgument unless ``r`` has an OpCode, non-negative ints and no wrap-around."""
    if type(r.op) is not OpCode:
        raise InvalidArgument(f"op must be OpCode.READ or OpCode.WRITE, got {r.op!r}")
    validate_range(r.local_address, r.remote_address, r.nbytes)


def validate_range(local: int, remote: int, nbytes: int) -> None:
    """Raise InvalidArgument unless both ranges are non-negative ints inside the address space."""
    if (type(local) is not int or type(remote) is not int or type(nbytes) is not int
            or local < 0 or remote < 0 or nbytes < 0
            or local + nbytes > MAX_ADDRESS or remote + nbytes > MAX_ADDRESS):
        raise InvalidArgument(f"addresses and nbytes must be non-negative ints within the "
                              f"address space, got {(local, remote, nbytes)!r}")


class Batch:
    """Requests submitted together to one segment; completion is tracked per request."""

    def __init__(self, batch_id: int, segment: str, requests: list[TransferRequest]) -> None:
        self.id = batch_id
        self.segment = segment
        self.requests = requests
        self.nbytes = sum(r.nbytes for r in requests)
        self._lock = threading.Lock()
        self._done_event = threading.Event()
        self._left = [0] * len(requests)  # slices still running, per request
        self._errors: list[MooncakeError | None] = [None] * len(requests)
        self._open = 0
        self._callbacks: list[Callable[[Batch], None]] = []

    # -- engine side ---------------------------------------------------------------
    def add_slices(self, index: int, count: int) -> None:
        self._left[index] += count
        self._open += count

    def seal(self) -> None:
        """No more slices will be added; an empty batch completes at once."""
        if self._open == 0:
            self._finish()

    def slices_done(self, results: list[tuple[int, MooncakeError | None]]) -> None:
        """Record finished slices as ``(request index, error or None)`` pairs."""
        with self._lock:
            for index, error in results:
                self._left[index] -= 1
                if error is not None and self._errors[index] is None:
                    self._errors[index] = error
            self._open -= len(results)
            if self._open:
                return
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            self._done_event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            self._call(fn)

    def _call(self, fn: Callable[[Batch], None]) -> None:
        try:
            fn(self)
        except Exception:  # a caller's callback: it must not take the worker down
            log.exception("callback of batch %d failed", self.id)

    def on_done(self, fn: Callable[[Batch], None]) -> None:
        """Call ``fn(batch)`` once every slice has ended: now, in this thread, if they have;
        else in the thread that ends the last one (an engine worker: keep it short)."""
        with self._lock:
            if not self._done_event.is_set():
                self._callbacks.append(fn)
                return
        self._call(fn)

    # -- caller side ---------------------------------------------------------------
    def done(self) -> bool:
        return self._done_event.is_set()

    def request_status(self, index: int) -> TransferStatus:
        with self._lock:
            if self._errors[index] is not None:
                return TransferStatus.FAILED if self._left[index] == 0 else TransferStatus.PENDING
            return TransferStatus.COMPLETED if self._left[index] == 0 else TransferStatus.PENDING

    def errors(self) -> list[MooncakeError | None]:
        """Every request's error (None where it succeeded or still runs)."""
        with self._lock:
            return list(self._errors)

    def wait_done(self, timeout_s: float | None = None) -> bool:
        """Block until every slice ended, without raising; False on timeout."""
        return self._done_event.wait(timeout_s)

    def status(self) -> TransferStatus:
        """COMPLETED when every request succeeded, FAILED when all ended and one failed."""
        if not self.done():
            return TransferStatus.PENDING
        return TransferStatus.FAILED if self.error() else TransferStatus.COMPLETED

    def error(self) -> MooncakeError | None:
        """The first error of any request, or None."""
        with self._lock:
            return next((e for e in self._errors if e is not None), None)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every slice ended; raise the first error, or TransferTimeout.

        Called from any thread; blocks.
        """
        if not self._done_event.wait(timeout_s):
            raise TransferTimeout(f"batch {self.id} to {self.segment!r} ({self.nbytes} bytes) "
                                  f"did not complete within {timeout_s} s")
        err = self.error()
        if err is not None:
            raise err
