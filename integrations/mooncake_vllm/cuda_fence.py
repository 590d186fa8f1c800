"""Our KV transfers ordered after vLLM's GPU work, by an event on its compute stream.

Kernels run asynchronously. When vLLM calls the connector after a forward pass, the KV
that pass writes may not be in GPU memory yet; blocks handed to a load may still be read
by kernels of an earlier step. So before a transfer thread touches a CUDA KV cache, it
waits on an event recorded on the compute stream when the transfer was queued: that
stream's work up to that point and nothing more, never a device-wide synchronize, and
only the transfer thread waits. Host KV caches need no fence: the CPU backend's forward
pass is over when the connector is called.
"""

from __future__ import annotations

import threading
from typing import Sequence

from mooncake_plugins.transfer import cuda


def compute_stream(device: int) -> int:
    """The raw handle of torch's current stream on ``device``: vLLM's compute stream."""
    import torch

    return torch.cuda.current_stream(device).cuda_stream


class Fence:
    """The compute streams' work queued so far on ``devices``. ``wait`` blocks the calling
    thread until it is done (at once when another thread already waited); the events are
    freed then, or by ``close``, or when the fence is dropped."""

    def __init__(self, devices: Sequence[int]) -> None:
        self._lock = threading.Lock()
        self._events: list[cuda.Event] = []
        try:
            for d in devices:
                self._events.append(cuda.Event(d).record(compute_stream(d)))
        except BaseException:
            self.close()
            raise

    def wait(self) -> None:
        with self._lock:   # a second waiter returns once the first saw the work done
            try:
                for event in self._events:
                    event.synchronize()
            finally:
                self._free()

    def close(self) -> None:
        with self._lock:
            self._free()

    def _free(self) -> None:
        events, self._events = self._events, []
        for event in events:
            event.close()

    def __del__(self) -> None:
        self._free()


def fence(devices: Sequence[int]) -> Fence | None:
    """A fence over the compute streams of ``devices``; None for a host KV cache."""
    return Fence(devices) if devices else None
