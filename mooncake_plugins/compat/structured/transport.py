"""Moving payload bytes through a store, using its fast paths when it has them.

A payload is described by its spec ``{"key", "bytes", "chunks": [{"key", "bytes"}]}``;
its bytes are the chunks' objects back to back. Writes go through a buffer pool and
``batch_put_from`` when a pool is available (else plain ``put``); reads use
``batch_get_into``/``get_into``/``get_into_ranges`` into registered memory when the store
can register buffers, and fall back to ``get``. Every method works with any store that
has the original's ``put``/``get``/``remove``; the others are optional.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from typing import Any

import numpy as np

from . import tensor_codec, writes
from .payloads import (PoolBackedArray, PoolLeaseOwner, TensorObjectBuffer, TensorPayload,
                       buffer_address, buffer_nbytes, copy_into_lease)
from .records import AUTO_PARALLEL_MIN_BYTES, AUTO_PARALLEL_MIN_CHUNKS, BundleTransferPolicy

Range = tuple[int, int, int]            # (source offset, destination offset, bytes)
Fragment = tuple[str, int, int, int, int]  # (key, chunk bytes, dst offset, src offset, bytes)


def fragments(chunks: Sequence[Mapping[str, Any]], offset: int, length: int,
              dst_offset: int = 0) -> list[Fragment]:
    """The pieces of chunk objects covering payload bytes ``offset:offset+length``."""
    out: list[Fragment] = []
    end = offset + length
    start = 0
    for chunk in chunks:
        size = int(chunk["bytes"])
        lo, hi = max(offset, start), min(end, start + size)
        if lo < hi:
            out.append((chunk["key"], size, dst_offset + lo - offset, lo - start, hi - lo))
        start += size
    return out


class PayloadTransport:
    """Payload IO over one store (and an optional buffer pool)."""

    def __init__(self, store: Any, buffer_pool: Any = None) -> None:
        self._store = store
        self._pool = buffer_pool
        self._batch_put_from = getattr(store, "batch_put_from", None)
        self._batch_get_into = getattr(store, "batch_get_into", None)
        self._get_into = getattr(store, "get_into", None)
        self._get_into_ranges = getattr(store, "get_into_ranges", None)
        self._register = getattr(store, "register_buffer", None)
        self._unregister = getattr(store, "unregister_buffer", None)

    # -- pool ---------------------------------------------------------------------------

    def buffer_pool(self) -> Any:
        """The pool given, or None."""
        return self._pool

    @property
    def batch_put_from_fn(self) -> Any:
        return self._batch_put_from

    def can_register(self) -> bool:
        return callable(self._register) and callable(self._unregister)

    # -- writes -------------------------------------------------------------------------

    def put_chunks(self, keys: Sequence[str], groups: Sequence[Sequence[memoryview]],
                   policy: BundleTransferPolicy, config: Any = None) -> None:
        """Write chunk ``i`` (the buffers of ``groups[i]`` back to back) as ``keys[i]``.

        On failure every chunk key is removed again and the error raised.
        """
        if policy.copy_mode == "zero_copy":
            raise RuntimeError("zero-copy put requires tensor-object buffers")
        if policy.copy_mode == "copy" or self.buffer_pool() is None \
                or not callable(self._batch_put_from):
            self._put_direct(keys, [memoryview(b"".join(g)) if len(g) != 1 else g[0]
                                    for g in groups], config)
            return
        if self.put_mode(groups, policy) == "batch":
            self._put_groups_through_pool(keys, groups, config)
            return
        self._put_groups_parallel(list(keys), list(groups), policy.max_inflight_put, config)

    def put_mode(self, groups: Sequence[Sequence[Any]], policy: BundleTransferPolicy) -> str:
        """``"batch"`` or ``"parallel"`` for writing ``groups`` under ``policy``."""
        if policy.put_mode != "auto":
            return policy.put_mode
        if policy.max_inflight_put <= 1 or len(groups) < AUTO_PARALLEL_MIN_CHUNKS:
            return "batch"
        total = sum(len(b) for group in groups for b in group)
        return "parallel" if total >= AUTO_PARALLEL_MIN_BYTES else "batch"

    # the original's private name, kept for callers that probe it
    _resolve_buffer_group_put_mode = put_mode

    def _put_direct(self, keys: Sequence[str], chunks: Sequence[memoryview],
                    config: Any) -> None:
        written: list[str] = []
        try:
            for key, chunk in zip(keys, chunks):
                writes.check_status(writes.put(self._store, key, chunk, config), "put", key)
                written.append(key)
        except Exception:
            writes.remove_keys(self._store, written, strict=False)
            raise

    def _put_groups_through_pool(self, keys: Sequence[str],
                                 groups: Sequence[Sequence[memoryview]], config: Any) -> None:
        """One chunk at a time: lease, copy in, ``batch_put_from``, release."""
        pool = self.buffer_pool()
        for key, group in zip(keys, groups):
            size = sum(len(b) for b in group)
            lease = pool.acquire(size)
            try:
                copy_into_lease(group, lease)
                results = writes.batch_put_from(self._batch_put_from, [key], [lease.ptr],
                                                [size], config)
                writes.check_results(results, [key], "batch_put_from")
            except Exception:
                writes.remove_keys(self._store, keys, strict=False)
                raise
            finally:
                lease.release()

    def _put_groups_parallel(self, keys: list[str], groups: list[Sequence[memoryview]],
                             inflight: int, config: Any) -> None:
        per_worker = -(-len(groups) // max(1, min(inflight, len(groups))))
        slices = [(keys[i:i + per_worker], groups[i:i + per_worker])
                  for i in range(0, len(groups), per_worker)]
        futures = []
        try:
            with ThreadPoolExecutor(max_workers=len(slices)) as pool:
                futures = [pool.submit(self._put_groups_through_pool, k, g, config)
                           for k, g in slices]
                for future in as_completed(futures):
                    future.result()
        except Exception:
            writes.remove_keys(self._store, keys, strict=False)
            raise

    def put_tensor_object(self, key: str, value: TensorObjectBuffer, config: Any) -> int:
        """Write a serialized tensor object from caller memory; its byte count."""
        writes.check_status(writes.put_from(self._store, key, value.ptr, value.size, config),
                            "put_from", key)
        return value.size

    def put_tensor(self, key: str, value: TensorPayload, config: Any) -> dict[str, Any] | None:
        """Write with the store's ``put_tensor``/``pub_tensor``; the payload spec, or None
        when the store has no tensor API."""
        put_tensor = getattr(self._store, "put_tensor" if config is None else "pub_tensor", None)
        if not callable(put_tensor):
            return None
        tensor = value.tensor
        header = tensor_codec.metadata_size()
        total = header + int(tensor.numel() * tensor.element_size())
        writes.check_status(writes.call_with_config(
            put_tensor, key, tensor, config=writes.config_for_keys(config, 1)), "put_tensor", key)
        return {"key": key, "kind": "tensor", "bytes": total, "dtype": str(tensor.dtype),
                "shape": list(tensor.shape), "chunks": [{"key": key, "bytes": total}],
                "metadata_bytes": header}

    def put_tensor_through_pool(self, key: str, value: TensorPayload, config: Any) -> int | None:
        """Serialize into a pool lease and ``put_from`` it; None without a pool or
        ``put_from``."""
        if self._pool is None or not (callable(getattr(self._store, "put_tensor_from", None))
                                      or callable(getattr(self._store, "put_from", None))):
            return None
        header, data_ptr, nbytes, owner = tensor_codec.serialize(value.tensor)
        total = len(header) + nbytes
        lease = self._pool.acquire(total)
        try:
            ctypes.memmove(lease.ptr, header, len(header))
            if nbytes:
                ctypes.memmove(lease.ptr + len(header), data_ptr, nbytes)
            writes.check_status(writes.put_from(self._store, key, lease.ptr, total, config),
                                "put_from", key)
        finally:
            lease.release()
        del owner
        return total

    # -- reads --------------------------------------------------------------------------

    def read(self, spec: Mapping[str, Any]) -> bytes:
        """A whole payload's bytes."""
        total = int(spec["bytes"])
        if total == 0:
            return b""
        data = bytearray(total)
        chunks = spec["chunks"]
        if not self._batch_get(chunks, data):
            offset = 0
            for chunk in chunks:
                size = int(chunk["bytes"])
                data[offset:offset + size] = self._get_chunk(chunk["key"], size)
                offset += size
        return bytes(data)

    def read_tensor(self, spec: Mapping[str, Any]) -> Any:
        get_tensor = getattr(self._store, "get_tensor", None)
        if not callable(get_tensor):
            raise RuntimeError("structured tensor payload does not support get_tensor")
        return get_tensor(spec["key"])

    def read_tensor_into(self, spec: Mapping[str, Any], dest: Any) -> Any:
        """A whole tensor payload into caller memory ``dest`` (``.ptr``/``.size``);
        returns what ``get_tensor_into`` returned, else None."""
        if spec.get("kind") == "tensor":
            get_tensor_into = getattr(self._store, "get_tensor_into", None)
            if not callable(get_tensor_into):
                raise RuntimeError("structured tensor payload does not support get_tensor_into")
            with self._registered_at(dest.ptr, dest.size,
                                     getattr(dest, "pre_registered", False)
                                     or not self.can_register()):
                tensor = get_tensor_into(spec["key"], dest.ptr, dest.size)
            if tensor is None:
                raise RuntimeError(f"get_tensor_into failed for {spec['key']}")
            return tensor
        total = int(spec["bytes"])
        if dest.size < total:
            raise ValueError(f"tensor destination has {dest.size} bytes, expected at least "
                             f"{total}")
        if not self._ranges_into(spec["chunks"], dest.ptr, [(0, 0, total)]):
            ctypes.memmove(dest.ptr, self.read(spec), total)
        return None

    def read_range(self, spec: Mapping[str, Any], offset: int, length: int) -> bytes:
        """Payload bytes ``offset:offset+length``."""
        if length == 0:
            return b""
        data = bytearray(length)
        self.read_ranges_into(spec, data, [(offset, 0, length)])
        return bytes(data)

    def read_into(self, spec: Mapping[str, Any], dest: np.ndarray | bytearray, offset: int,
                  pre_registered: bool = False) -> None:
        """Fill ``dest`` with payload bytes from ``offset`` on (``get_into`` when it is the
        whole single-chunk payload, else ranged reads)."""
        length = buffer_nbytes(dest)
        if length == 0:
            return
        chunks = spec["chunks"]
        if self.can_register() and (callable(self._get_into) or callable(self._get_into_ranges)):
            with self._registered(dest, pre_registered) as ptr:
                if (len(chunks) == 1 and offset == 0 and callable(self._get_into)
                        and int(chunks[0]["bytes"]) == length):
                    got = self._get_into(chunks[0]["key"], ptr, length)
                    if got != length:
                        raise RuntimeError(f"get_into failed for {chunks[0]['key']}: expected "
                                           f"{length}, got {got}")
                    return
                if self._ranges_into(chunks, ptr, [(offset, 0, length)]):
                    return
        self._copy_ranges(chunks, dest, [(offset, 0, length)])

    def read_ranges_into(self, spec: Mapping[str, Any], dest: np.ndarray | bytearray,
                         ranges: Sequence[Range]) -> None:
        """Copy payload ranges into ``dest`` (registered for the call when possible)."""
        if not ranges:
            return
        if self.can_register() and callable(self._get_into_ranges):
            with self._registered(dest) as ptr:
                if self._ranges_into(spec["chunks"], ptr, ranges):
                    return
        self._copy_ranges(spec["chunks"], dest, ranges)

    def read_ranges_to_address(self, spec: Mapping[str, Any], ptr: int,
                               ranges: Sequence[Range]) -> None:
        """Copy payload ranges to memory the store already knows (``ptr``)."""
        if not ranges:
            return
        if self._ranges_into(spec["chunks"], ptr, ranges):
            return
        for src, dst, length in ranges:
            ctypes.memmove(ptr + dst, self.read_range(spec, src, length), length)

    def read_into_pool_array(self, spec: Mapping[str, Any], dtype: np.dtype,
                             shape: tuple[int, ...], offset: int) -> np.ndarray | None:
        """Payload bytes from ``offset`` as a pool-backed array, or None (no pool, or
        no ranged reads)."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:
            return np.empty(shape, dtype=dtype)
        pool = self.buffer_pool()
        if pool is None or not callable(self._get_into_ranges):
            return None
        try:
            lease = pool.acquire(nbytes)
        except RuntimeError:
            return None
        owner = PoolLeaseOwner(lease)
        try:
            self._ranges_into(spec["chunks"], lease.ptr, [(offset, 0, nbytes)])
        except Exception:
            owner.release()
            raise
        return PoolBackedArray(owner, dtype, shape)

    # -- internals ----------------------------------------------------------------------

    def _get_chunk(self, key: str, size: int) -> bytes:
        data = self._store.get(key)
        if len(data) != size:
            raise RuntimeError(f"get failed for {key}: expected {size} bytes, got {len(data)}")
        return data

    def _batch_get(self, chunks: Sequence[Mapping[str, Any]], data: bytearray) -> bool:
        if not callable(self._batch_get_into) or not self.can_register():
            return False
        with self._registered(data) as base:
            keys, ptrs, sizes, offset = [], [], [], 0
            for chunk in chunks:
                keys.append(chunk["key"])
                ptrs.append(base + offset)
                sizes.append(int(chunk["bytes"]))
                offset += sizes[-1]
            got = self._batch_get_into(keys, ptrs, sizes)
            if len(got) != len(keys):
                raise RuntimeError(f"batch_get_into returned {len(got)} results for "
                                   f"{len(keys)} chunks")
            for key, want, have in zip(keys, sizes, got):
                if have != want:
                    raise RuntimeError(f"batch_get_into failed for {key}: expected {want}, "
                                       f"got {have}")
        return True

    def _ranges_into(self, chunks: Sequence[Mapping[str, Any]], base: int,
                     ranges: Sequence[Range]) -> bool:
        """One ``get_into_ranges`` call for all ``ranges``; False if the store lacks it."""
        if not callable(self._get_into_ranges):
            return False
        pieces = [f for src, dst, length in ranges for f in fragments(chunks, src, length, dst)]
        if not pieces:
            return True
        keys = [p[0] for p in pieces]
        sizes = [[p[4]] for p in pieces]
        results = self._get_into_ranges([base], [keys], [[[p[2]] for p in pieces]],
                                        [[[p[3]] for p in pieces]], [sizes])
        if len(results) != 1 or len(results[0]) != len(keys):
            raise RuntimeError(f"get_into_ranges returned invalid ranged result shape for "
                               f"{len(keys)} chunks")
        for key, want, have in zip(keys, sizes, results[0]):
            if list(have) != want:
                raise RuntimeError(f"get_into_ranges failed for {key}: expected {want}, "
                                   f"got {list(have)}")
        return True

    def _copy_ranges(self, chunks: Sequence[Mapping[str, Any]], dest: Any,
                     ranges: Sequence[Range]) -> None:
        """Ranged reads with plain ``get`` (each chunk fetched once)."""
        cache: dict[str, bytes] = {}
        with memoryview(dest).cast("B") as target:
            for src, dst, length in ranges:
                for key, size, d, s, n in fragments(chunks, src, length, dst):
                    if key not in cache:
                        cache[key] = self._get_chunk(key, size)
                    target[d:d + n] = cache[key][s:s + n]

    @contextmanager
    def _registered(self, dest: np.ndarray | bytearray,
                    pre_registered: bool = False) -> Iterator[int]:
        """``dest``'s address, registered with the store for the block unless it already
        is (a duplicate registration is tolerated and left alone)."""
        with self._registered_at(buffer_address(dest), buffer_nbytes(dest),
                                 pre_registered) as ptr:
            yield ptr

    @contextmanager
    def _registered_at(self, ptr: int, size: int, pre_registered: bool = False
                       ) -> Iterator[int]:
        """``ptr`` (``size`` bytes) registered for the block, as :meth:`_registered`."""
        if pre_registered or size == 0:
            yield ptr
            return
        status = self._register(ptr, size)
        if status == writes.DUPLICATE_REGISTRATION:
            yield ptr
            return
        writes.check_status(status, "register_buffer", "structured payload")
        ok = False
        try:
            yield ptr
            ok = True
        finally:
            try:
                writes.check_status(self._unregister(ptr), "unregister_buffer",
                                    "structured payload")
            except Exception:
                if ok:
                    raise

