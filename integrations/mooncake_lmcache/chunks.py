"""Moving LMCache memory objects to and from the store (blocking; run in worker threads).

An object whose bytes are contiguous memory inside a buffer registered with the store
client (LMCache's local CPU pool, or a GPU pool) moves zero-copy: ``batch_put_from`` reads
it in place and ``batch_get_into`` writes straight into it. A contiguous object in GPU
memory outside any registered buffer is registered for the call (``cuda:N``) and moves
zero-copy too, through the engine's CUDA paths. Any other object (host memory outside
the pool, non-contiguous) is copied through a staging buffer by ``batch_put``/``batch_get``.
A chunk is stored as its raw bytes; its shape comes from LMCache's metadata (a short last
chunk is recognised by its size).
"""

from __future__ import annotations

import bisect
import ctypes
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Sequence

from mooncake_plugins.errors import BufferTooSmall, ObjectAlreadyExists, StoreError
from mooncake_plugins.store.client import ReplicateConfig, StoreClient

if TYPE_CHECKING:
    from lmcache.v1.memory_management import MemoryObj


class ChunkIO:
    """Batched puts and gets of memory objects through one store client."""

    def __init__(self, client: StoreClient, replica_num: int) -> None:
        self.client = client
        self._config = ReplicateConfig(replica_num=replica_num)
        self._regions: list[tuple[int, int]] = []  # sorted (address, nbytes)
        self._lock = threading.Lock()

    # -- registered memory ------------------------------------------------------------
    def register(self, address: int, nbytes: int, location: str = "*") -> None:
        """Make ``[address, address+nbytes)`` a zero-copy source and destination."""
        self.client.register_buffer(address, nbytes, location)
        with self._lock:
            bisect.insort(self._regions, (address, nbytes))

    def unregister_all(self) -> None:
        with self._lock:
            regions, self._regions = self._regions, []
        for address, _ in regions:
            self.client.unregister_buffer(address)

    @property
    def region_count(self) -> int:
        return len(self._regions)

    def zero_copy(self, obj: "MemoryObj") -> bool:
        """Whether ``obj``'s bytes are contiguous memory inside a registered buffer."""
        raw = obj.raw_tensor
        if raw is None or not raw.is_contiguous():
            return False
        address, nbytes = obj.data_ptr, obj.get_size()
        with self._lock:
            i = bisect.bisect_right(self._regions, (address, float("inf"))) - 1
            return i >= 0 and address + nbytes <= sum(self._regions[i])

    @staticmethod
    def _gpu(obj: "MemoryObj") -> bool:
        """Whether ``obj`` is contiguous GPU memory."""
        raw = obj.raw_tensor
        return raw is not None and raw.device.type == "cuda" and raw.is_contiguous()

    @contextmanager
    def _direct(self, objs: Sequence["MemoryObj"]) -> Iterator[list[int]]:
        """Indices of the objects that move zero-copy, GPU objects outside the registered
        buffers registered for the block's duration."""
        direct = [i for i, o in enumerate(objs) if self.zero_copy(o) or self._gpu(o)]
        with self.client.gpu_buffers((objs[i].data_ptr, objs[i].get_size()) for i in direct
                                     if self._gpu(objs[i])):
            yield direct

    # -- transfers ----------------------------------------------------------------------
    def put(self, keys: Sequence[str], objs: Sequence["MemoryObj"]) -> list[StoreError | None]:
        """Store each object under its key; per key an error or None. A key stored
        already (another worker wrote the same chunk) counts as stored."""
        errors: list[StoreError | None] = [None] * len(keys)
        with self._direct(objs) as direct:
            staged = sorted(set(range(len(keys))) - set(direct))
            if direct:
                res = self.client.batch_put_from([keys[i] for i in direct],
                                                 [objs[i].data_ptr for i in direct],
                                                 [objs[i].get_size() for i in direct],
                                                 self._config)
                for i, err in zip(direct, res):
                    errors[i] = err
        if staged:
            res = self.client.batch_put([keys[i] for i in staged],
                                        [objs[i].byte_array for i in staged], self._config)
            for i, err in zip(staged, res):
                errors[i] = err
        return [None if isinstance(e, ObjectAlreadyExists) else e for e in errors]

    def get(self, keys: Sequence[str], objs: Sequence["MemoryObj"]) -> list[int | StoreError]:
        """Read each key into its object; per key the bytes read or an error."""
        out: list[int | StoreError] = [0] * len(keys)
        with self._direct(objs) as direct:
            staged = sorted(set(range(len(keys))) - set(direct))
            if direct:
                res = self.client.batch_get_into([keys[i] for i in direct],
                                                 [objs[i].data_ptr for i in direct],
                                                 [objs[i].get_size() for i in direct])
                for i, r in zip(direct, res):
                    out[i] = r
        if staged:
            for i, data in zip(staged, self.client.batch_get([keys[i] for i in staged])):
                out[i] = data if isinstance(data, Exception) else _copy_into(objs[i], data)
        return out


def _copy_into(obj: "MemoryObj", data: bytes) -> int | StoreError:
    """Copy a staged chunk into ``obj`` (host memory); the bytes copied."""
    raw = obj.raw_tensor
    if raw is None or raw.device.type != "cpu" or not raw.is_contiguous() \
            or len(data) > obj.get_size():
        return BufferTooSmall(f"cannot copy {len(data)} bytes into the {obj.get_size()}-byte "
                              "chunk LMCache allocated (it must be contiguous host or GPU "
                              "memory)")
    ctypes.memmove(raw.data_ptr(), data, len(data))
    return len(data)
