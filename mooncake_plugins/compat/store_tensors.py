"""torch tensor methods of ``MooncakeDistributedStore``: put/get/pub/upsert tensor, batch, tp and
parallelism forms, safetensors load/save (the bytes layout lives in the core).

Return conventions are the original's: writes return 0 or a negative code (a list of them
for batches), reads return a tensor or None, with the reason logged.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import (BufferTooSmall, InvalidParams, MooncakeError, NotSupported, ObjectAlreadyExists,
                      to_code)
from ..store import tensor_parallel as P, tensors as T
from ..transfer import cuda, memory

log = logging.getLogger("mooncake_plugins.compat.store")

_INVALID = InvalidParams.code
_FILE_NOT_FOUND = -1100  # the original's FILE_NOT_FOUND


class _TensorMethods:
    """Mixed into :class:`mooncake_plugins.compat.store.MooncakeDistributedStore`."""

    client: Any
    _cfg: Callable[[Any], Any]

    # -- writes ---------------------------------------------------------------------------
    def _write(self, what: str, keys: Sequence[str], blobs: Sequence[Any], config: Any = None,
               upsert: bool = False) -> list[int]:
        """Store encoded objects: a blob is a buffer, a list of buffers gathered into one
        object, or an error code; codes per key."""
        codes = [b if isinstance(b, int) else 0 for b in blobs]
        todo = [i for i, b in enumerate(blobs) if not isinstance(b, int)]
        if not todo:
            return codes
        parts = [blobs[i] if isinstance(blobs[i], list) else [blobs[i]] for i in todo]
        try:
            errors = self.client.batch_put_parts([keys[i] for i in todo], parts,
                                                 self._cfg(config), upsert)
        except MooncakeError as exc:
            log.error("%s failed: %s", what, exc)
            errors = [exc] * len(todo)
        for i, err in zip(todo, errors):
            codes[i] = _outcome(what, keys[i], err, upsert)
        return codes

    @staticmethod
    def _encode(key: str, tensor: Any, header: T.TensorHeader | None = None) -> Any:
        """The object's parts (header, data) for ``tensor``, or the code of why it cannot be
        stored."""
        try:
            return T.encode_parts(tensor, header)
        except MooncakeError as exc:
            log.error("tensor for %r: %s", key, exc)
            return to_code(exc)

    def _put_tensors(self, what: str, keys: Sequence[str], tensors: Sequence[Any],
                     config: Any = None, upsert: bool = False) -> list[int]:
        if not keys or len(keys) != len(tensors) or _bad_config(config):
            if keys:
                log.error("%s: %d keys, %d tensors or a bad config", what, len(keys), len(tensors))
            return [_INVALID] * len(keys)
        return self._write(what, keys, [self._encode(k, t) for k, t in zip(keys, tensors)],
                           config, upsert)

    def put_tensor(self, key: str, tensor: Any) -> int:
        """Store a tensor with its dtype and shape (the original's layout)."""
        return self._put_tensors("put_tensor", [key], [tensor])[0]

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        return self._put_tensors("upsert_tensor", [key], [tensor], upsert=True)[0]

    def pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        """``put_tensor`` with a ReplicateConfig."""
        return self._put_tensors("pub_tensor", [key], [tensor], config)[0]

    def upsert_pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        return self._put_tensors("upsert_pub_tensor", [key], [tensor], config, True)[0]

    def batch_put_tensor(self, keys: list[str], tensors_list: list) -> list[int]:
        return self._put_tensors("batch_put_tensor", keys, tensors_list)

    def batch_upsert_tensor(self, keys: list[str], tensors_list: list) -> list[int]:
        return self._put_tensors("batch_upsert_tensor", keys, tensors_list, upsert=True)

    def batch_pub_tensor(self, keys: list[str], tensors_list: list, config: Any = None) -> list[int]:
        return self._put_tensors("batch_pub_tensor", keys, tensors_list, config)

    def batch_upsert_pub_tensor(self, keys: list[str], tensors_list: list,
                                config: Any = None) -> list[int]:
        return self._put_tensors("batch_upsert_pub_tensor", keys, tensors_list, config, True)

    # -- zero-copy writes from [header | data] buffers -------------------------------------
    def _put_from(self, what: str, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
                  upsert: bool = False, config: Any = None) -> list[int]:
        if len(keys) != len(ptrs) or len(keys) != len(sizes):
            log.error("%s: keys, buffer_ptrs and sizes differ in length", what)
            return [_INVALID] * len(keys)
        for key, ptr, size in zip(keys, ptrs, sizes):
            try:
                _header_at(ptr, size)
            except MooncakeError as exc:
                log.error("%s %r: %s", what, key, exc)
                return [_INVALID] * len(keys)
        if not keys:
            return []
        try:
            errors = self.client.batch_put_from(list(keys), list(ptrs), list(sizes), self._cfg(config),
                                                upsert)
        except MooncakeError as exc:
            log.error("%s failed: %s", what, exc)
            return [to_code(exc)] * len(keys)
        return [_outcome(what, k, e, upsert) for k, e in zip(keys, errors)]

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Store a registered buffer laid out as ``[header | data]`` (checked, not copied)."""
        return self._put_from("put_tensor_from", [key], [buffer_ptr], [size])[0]

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._put_from("upsert_tensor_from", [key], [buffer_ptr], [size], True)[0]

    def batch_put_tensor_from(self, keys: list[str], buffer_ptrs: list[int],
                              sizes: list[int]) -> list[int]:
        return self._put_from("batch_put_tensor_from", keys, buffer_ptrs, sizes)

    def batch_upsert_tensor_from(self, keys: list[str], buffer_ptrs: list[int],
                                 sizes: list[int]) -> list[int]:
        return self._put_from("batch_upsert_tensor_from", keys, buffer_ptrs, sizes, True)

    # -- reads ----------------------------------------------------------------------------
    def get_tensor(self, key: str) -> Any:
        """The stored tensor (a fresh CPU tensor), or None."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: list[str]) -> list:
        try:
            raws = self.client.batch_get(keys)
        except MooncakeError as exc:
            log.error("batch_get_tensor failed: %s", exc)
            return [None] * len(keys)
        return [_decoded(k, lambda r=raw: T.decode(r)) if not isinstance(raw, Exception)
                else _failed(k, raw) for k, raw in zip(keys, raws)]

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Read into a registered buffer; the tensor returned views that buffer, or None."""
        return self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]

    def batch_get_tensor_into(self, keys: list[str], buffer_ptrs: list[int],
                              sizes: list[int]) -> list:
        if len(keys) != len(buffer_ptrs) or len(keys) != len(sizes) or 0 in buffer_ptrs:
            log.error("batch_get_tensor_into: mismatched lengths or a null buffer")
            return [_INVALID] * len(keys)
        try:
            got = self.client.batch_get_into(keys, buffer_ptrs, sizes)
        except MooncakeError as exc:
            log.error("batch_get_tensor_into failed: %s", exc)
            return [None] * len(keys)
        return [_failed(k, n) if isinstance(n, Exception) else
                _decoded(k, lambda p=p, n=n: _decode_in_place(p, n))
                for k, p, n in zip(keys, buffer_ptrs, got)]

    def get_tensor_into_cuda(self, key: str, tensor: Any) -> int:
        """Read the stored tensor's data (not its header) into ``tensor``, CPU or CUDA,
        whose memory the caller registered; the bytes read or a negative code."""
        return self.batch_get_tensor_into_cuda([key], [tensor])[0]

    def batch_get_tensor_into_cuda(self, keys: list[str], tensors_list: list) -> list[int]:
        """As :meth:`get_tensor_into_cuda` per key. One lookup takes a read lease on every
        object; headers and data are read from the replicas it found, so a concurrent
        upsert does not mix two versions, and a read that outlives the lease is
        LEASE_EXPIRED."""
        if len(keys) != len(tensors_list):
            log.error("batch_get_tensor_into_cuda: %d keys, %d tensors", len(keys),
                      len(tensors_list))
            return [_INVALID] * len(keys)
        try:
            located = self.client.locate(keys)
            heads = self.client.batch_get_ranges(
                located, [(i, 0, T.HEADER_SIZE) for i in range(len(keys))])
        except MooncakeError as exc:
            log.error("batch_get_tensor_into_cuda failed: %s", exc)
            return [to_code(exc)] * len(keys)
        codes: list[int] = [0] * len(keys)
        reads, order = [], []
        for i, (key, head, dest) in enumerate(zip(keys, heads, tensors_list)):
            try:
                if isinstance(head, Exception):
                    raise head
                h = T.parse_header(head, located.found[i][0])
                room = dest.numel() * dest.element_size()
                if not dest.is_contiguous() or room < h.data_bytes:
                    raise BufferTooSmall(f"a contiguous tensor of {h.data_bytes} bytes is "
                                         f"needed, got {room} bytes")
                reads.append((i, T.HEADER_SIZE, [(dest.data_ptr(), h.data_bytes)]))
                order.append(i)
            except MooncakeError as exc:
                log.error("get_tensor_into_cuda %r: %s", key, exc)
                codes[i] = to_code(exc)
        try:
            got = self.client.batch_get_ranges_into(located, reads) if reads else []
        except MooncakeError as exc:
            got = [exc] * len(reads)
        for i, r in zip(order, got):
            if isinstance(r, Exception):
                log.error("get_tensor_into_cuda %r: %s", keys[i], r)
            codes[i] = to_code(r) if isinstance(r, Exception) else r
        return codes

    # -- tensor parallel (legacy layout: one object per rank, "<key>_tp_<rank>") ------------
    def _put_tp(self, what: str, keys: Sequence[str], tensors: Sequence[Any], config: Any,
                tp_size: int, split_dim: int) -> list[int]:
        if not keys or len(keys) != len(tensors) or _bad_config(config):
            if keys:
                log.error("%s: %d keys, %d tensors or a bad config", what, len(keys), len(tensors))
            return [_INVALID] * len(keys)
        shard_keys: list[str] = []
        blobs: list[Any] = []
        for key, tensor in zip(keys, tensors):
            try:
                parts = [T.encode_parts(p, h) for _, p, h in P.tp_shards(tensor, tp_size, split_dim)]
            except (MooncakeError, AttributeError) as exc:
                log.error("%s %r: %s", what, key, exc)
                parts = [_INVALID] * tp_size
            shard_keys += [P.tp_key(key, r) for r in range(tp_size)]
            blobs += parts
        codes = self._write(what, shard_keys, blobs, config)
        return [next((c for c in codes[i * tp_size:(i + 1) * tp_size] if c), 0)
                for i in range(len(keys))]

    def put_tensor_with_tp(self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> int:
        """Store every tp shard of ``tensor`` (``tp_rank`` is unused, as in the original)."""
        if tp_size <= 1:
            return self.put_tensor(key, tensor)
        return self._put_tp("put_tensor_with_tp", [key], [tensor], None, tp_size, split_dim)[0]

    def pub_tensor_with_tp(self, key: str, tensor: Any, config: Any = None, tp_rank: int = 0,
                           tp_size: int = 1, split_dim: int = 0) -> int:
        if tp_size <= 1:
            return self.pub_tensor(key, tensor, config)
        return self._put_tp("pub_tensor_with_tp", [key], [tensor], config, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp(self, base_keys: list[str], tensors_list: list, tp_rank: int = 0,
                                 tp_size: int = 1, split_dim: int = 0) -> list[int]:
        if tp_size <= 1:
            return self.batch_put_tensor(base_keys, tensors_list)
        return self._put_tp("batch_put_tensor_with_tp", base_keys, tensors_list, None, tp_size,
                            split_dim)

    def batch_pub_tensor_with_tp(self, base_keys: list[str], tensors_list: list,
                                 config: Any = None, tp_rank: int = 0, tp_size: int = 1,
                                 split_dim: int = 0) -> list[int]:
        if tp_size <= 1:
            return self.batch_pub_tensor(base_keys, tensors_list, config)
        return self._put_tp("batch_pub_tensor_with_tp", base_keys, tensors_list, config, tp_size,
                            split_dim)

    def put_tensor_with_tp_from(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> int:
        """Shard the ``[header | data]`` tensor in a buffer and store the shards."""
        return self.batch_put_tensor_with_tp_from([key], [buffer_ptr], [size], tp_rank, tp_size,
                                                  split_dim)[0]

    def batch_put_tensor_with_tp_from(self, base_keys: list[str], buffer_ptrs: list[int],
                                      sizes: list[int], tp_rank: int = 0, tp_size: int = 1,
                                      split_dim: int = 0) -> list[int]:
        if tp_size <= 1:
            return self.batch_put_tensor_from(base_keys, buffer_ptrs, sizes)
        if not base_keys or len(base_keys) != len(buffer_ptrs) or len(base_keys) != len(sizes):
            return [_INVALID] * len(base_keys)
        tensors = [_decoded(k, lambda p=p, n=n: T.decode(_raw(p, n), copy=False))
                   for k, p, n in zip(base_keys, buffer_ptrs, sizes)]
        codes = [_INVALID if t is None else 0 for t in tensors]
        ok = [i for i, t in enumerate(tensors) if t is not None]
        done = self._put_tp("batch_put_tensor_with_tp_from", [base_keys[i] for i in ok],
                            [tensors[i] for i in ok], None, tp_size, split_dim) if ok else []
        for i, c in zip(ok, done):
            codes[i] = c
        return codes

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> Any:
        return self.get_tensor(key if tp_size <= 1 else P.tp_key(key, tp_rank))

    def batch_get_tensor_with_tp(self, base_keys: list[str], tp_rank: int = 0,
                                 tp_size: int = 1) -> list:
        return self.batch_get_tensor(base_keys if tp_size <= 1
                                     else [P.tp_key(k, tp_rank) for k in base_keys])

    def get_tensor_with_tp_into(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> Any:
        return self.get_tensor_into(key if tp_size <= 1 else P.tp_key(key, tp_rank),
                                    buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys: list[str], buffer_ptrs: list[int],
                                      sizes: list[int], tp_rank: int = 0,
                                      tp_size: int = 1) -> list:
        keys = base_keys if tp_size <= 1 else [P.tp_key(k, tp_rank) for k in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    # -- unified parallelism ------------------------------------------------------------
    def _put_parallel(self, what: str, key: str, tensor: Any, parallelism: Any, config: Any,
                      writer_partition: Any, upsert: bool) -> int:
        if _bad_config(config):
            log.error("%s: preferred_segments must name one segment per replica", what)
            return _INVALID
        try:
            plan = P.write_plan(key, tensor, _axes(parallelism), _writer(writer_partition))
        except (MooncakeError, AttributeError, TypeError) as exc:
            log.error("%s %r: %s", what, key, exc)
            return _INVALID
        return _first(self._write(what, [k for k, _ in plan], [b for _, b in plan], config, upsert))

    def _put_parallel_from(self, what: str, key: str, ptr: int, size: int, parallelism: Any,
                           config: Any, writer_partition: Any, upsert: bool) -> int:
        if _bad_config(config):
            log.error("%s: preferred_segments must name one segment per replica", what)
            return _INVALID
        try:
            plan = P.write_from_plan(key, _raw(ptr, size), _axes(parallelism), _writer(writer_partition))
        except (MooncakeError, AttributeError, TypeError) as exc:
            log.error("%s %r: %s", what, key, exc)
            return _INVALID
        if plan is None:  # the buffer is the object: stored as it is, zero-copy
            return self._put_from(what, [key], [ptr], [size], upsert, config)[0]
        return _first(self._write(what, [k for k, _ in plan], [b for _, b in plan], config, upsert))

    def _batch_parallel(self, what: str, keys: Sequence[str], count: int, parallelisms: Any,
                        writer_partitions: Any, one: Callable[[int, Any, Any], int],
                        direct: Callable[[], list[int]]) -> list[int]:
        if parallelisms is not None and writer_partitions is not None or count != len(keys):
            log.error("%s: parallelisms with writer_partitions, or values not one per key", what)
            return [_INVALID] * len(keys)
        if parallelisms is None and writer_partitions is None:
            return direct()
        specs = parallelisms if parallelisms is not None else writer_partitions
        if not isinstance(specs, (list, tuple)) or len(specs) != len(keys):
            log.error("%s: one parallelism or writer partition per key is needed", what)
            return [_INVALID] * len(keys)
        return [one(i, s, None) if parallelisms is not None else one(i, None, s)
                for i, s in enumerate(specs)]

    def put_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                    config: Any = None, writer_partition: Any = None) -> int:
        """Store a tensor under its parallel layout (see :mod:`..store.tensor_parallel`)."""
        return self._put_parallel("put_tensor_with_parallelism", key, tensor, parallelism, config,
                                  writer_partition, False)

    def upsert_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                       config: Any = None, writer_partition: Any = None) -> int:
        return self._put_parallel("upsert_tensor_with_parallelism", key, tensor, parallelism,
                                  config, writer_partition, True)

    def put_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int,
                                         parallelism: Any = None, config: Any = None,
                                         writer_partition: Any = None) -> int:
        return self._put_parallel_from("put_tensor_with_parallelism_from", key, buffer_ptr, size,
                                       parallelism, config, writer_partition, False)

    def upsert_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int,
                                            parallelism: Any = None, config: Any = None,
                                            writer_partition: Any = None) -> int:
        return self._put_parallel_from("upsert_tensor_with_parallelism_from", key, buffer_ptr, size,
                                       parallelism, config, writer_partition, True)

    def batch_put_tensor_with_parallelism(self, keys: list[str], tensors_list: list,
                                          parallelisms: Any = None, config: Any = None,
                                          writer_partitions: Any = None) -> list[int]:
        return self._batch_parallel(
            "batch_put_tensor_with_parallelism", keys, len(tensors_list), parallelisms,
            writer_partitions,
            lambda i, p, w: self.put_tensor_with_parallelism(keys[i], tensors_list[i], p, config, w),
            lambda: self._put_tensors("batch_put_tensor_with_parallelism", keys, tensors_list, config))

    def batch_upsert_tensor_with_parallelism(self, keys: list[str], tensors_list: list,
                                             parallelisms: Any = None, config: Any = None,
                                             writer_partitions: Any = None) -> list[int]:
        return self._batch_parallel(
            "batch_upsert_tensor_with_parallelism", keys, len(tensors_list), parallelisms,
            writer_partitions,
            lambda i, p, w: self.upsert_tensor_with_parallelism(keys[i], tensors_list[i], p, config, w),
            lambda: self._put_tensors("batch_upsert_tensor_with_parallelism", keys, tensors_list,
                                      config, True))

    def batch_put_tensor_with_parallelism_from(self, keys: list[str], buffer_ptrs: list[int],
                                               sizes: list[int], parallelisms: Any = None,
                                               config: Any = None,
                                               writer_partitions: Any = None) -> list[int]:
        if len(sizes) != len(buffer_ptrs):
            return [_INVALID] * len(keys)
        return self._batch_parallel(
            "batch_put_tensor_with_parallelism_from", keys, len(buffer_ptrs), parallelisms,
            writer_partitions,
            lambda i, p, w: self.put_tensor_with_parallelism_from(keys[i], buffer_ptrs[i], sizes[i],
                                                                  p, config, w),
            lambda: self._put_from("batch_put_tensor_with_parallelism_from", keys, buffer_ptrs,
                                   sizes, False, config))

    def batch_upsert_tensor_with_parallelism_from(self, keys: list[str], buffer_ptrs: list[int],
                                                  sizes: list[int], parallelisms: Any = None,
                                                  config: Any = None,
                                                  writer_partitions: Any = None) -> list[int]:
        if len(sizes) != len(buffer_ptrs):
            return [_INVALID] * len(keys)
        return self._batch_parallel(
            "batch_upsert_tensor_with_parallelism_from", keys, len(buffer_ptrs), parallelisms,
            writer_partitions,
            lambda i, p, w: self.upsert_tensor_with_parallelism_from(keys[i], buffer_ptrs[i],
                                                                     sizes[i], p, config, w),
            lambda: self._put_from("batch_upsert_tensor_with_parallelism_from", keys, buffer_ptrs,
                                   sizes, True, config))

    def _fetch(self, keys: Sequence[str]) -> list:
        """Objects' bytes, None where one cannot be read (the store's ``Fetch``)."""
        try:
            return [None if isinstance(r, Exception) else r for r in self.client.batch_get(keys)]
        except MooncakeError as exc:
            log.error("reading %s failed: %s", list(keys), exc)
            return [None] * len(keys)

    def _read_parallel(self, key: str, target: Any, dest: P.Dest | None = None) -> Any:
        """What a reader with ``target`` gets: object bytes, an Assembled tensor (in ``dest``
        when it is rebuilt from shards), None, or ``"as_stored"`` for a plain read of ``key``."""
        mode = str(getattr(target, "mode", "as_stored")).lower()
        parallelism = getattr(target, "parallelism", None)
        if mode not in P.READ_MODES:
            log.error("unsupported ReadTarget mode %r", mode)
            return None
        try:
            axes = _axes(parallelism)
            if axes is None:
                if mode == "full":
                    return P.read_writer_full(key, self._fetch, dest) or "as_stored"
                return "as_stored" if mode == "as_stored" else None
            P.check_axes(axes)
            if mode == "shard":
                return P.read_shard(key, axes, self._fetch)
            if mode == "full" and P.tp_axis(axes) is not None:
                return P.read_full(key, axes, self._fetch, dest)
        except (MooncakeError, AttributeError, TypeError) as exc:
            log.error("reading %r with %s: %s", key, target, exc)
            return None
        log.error("reading %r: mode %r with this parallelism is not supported", key, mode)
        return None

    def get_tensor_with_parallelism(self, key: str, target: Any = None) -> Any:
        """The tensor (or shard) ``target`` asks for (a ReadTarget; None: as stored)."""
        found = self._read_parallel(key, target)
        if isinstance(found, str):
            return self.get_tensor(key)
        if isinstance(found, P.Assembled):
            return T.torch().from_numpy(found.data).view(T.torch_dtype(found.header.dtype)) \
                .reshape(found.header.local_shape)
        return None if found is None else _decoded(key, lambda: T.decode(found))

    def batch_get_tensor_with_parallelism(self, keys: list[str], targets: Any = None) -> list:
        if targets is None:
            return self.batch_get_tensor(keys)
        if not isinstance(targets, (list, tuple)) or len(targets) != len(keys):
            log.error("batch_get_tensor_with_parallelism: one target per key is needed")
            return [None] * len(keys)
        return [self.get_tensor_with_parallelism(k, t) for k, t in zip(keys, targets)]

    def get_tensor_with_parallelism_into(self, key: str, buffer_ptr: int, size: int,
                                         target: Any = None) -> Any:
        """As ``get_tensor_with_parallelism``, laid out ``[header | data]`` in a registered
        buffer; the tensor returned views that buffer."""
        if not buffer_ptr:
            log.error("get_tensor_with_parallelism_into: null buffer")
            return None
        found = self._read_parallel(key, target, lambda h: _place(h, buffer_ptr, size))
        if isinstance(found, str):
            return self.get_tensor_into(key, buffer_ptr, size)
        if found is None:
            return None
        if isinstance(found, P.Assembled) and not found.placed:  # a slice of a rebuilt tensor
            found = T.pack_header(found.header) + found.data.tobytes()
        if isinstance(found, P.Assembled):
            n = T.HEADER_SIZE + found.header.data_bytes
        else:  # one stored object: copied in as it is
            n = len(found)
            if n > size:
                log.error("get_tensor_with_parallelism_into %r: needs %d bytes, the buffer has %d",
                          key, n, size)
                return None
            memory.view_of(None, buffer_ptr, n)[:] = found
        return _decoded(key, lambda: T.decode(memory.view_of(None, buffer_ptr, n), copy=False))

    def batch_get_tensor_with_parallelism_into(self, keys: list[str], buffer_ptrs: list[int],
                                               sizes: list[int], targets: Any = None) -> list:
        if len(keys) != len(buffer_ptrs) or len(keys) != len(sizes) or (
                targets is not None and (not isinstance(targets, (list, tuple))
                                         or len(targets) != len(keys))):
            log.error("batch_get_tensor_with_parallelism_into: lengths differ")
            return [None] * len(keys)
        if targets is None:
            return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)
        return [self.get_tensor_with_parallelism_into(k, p, n, t)
                for k, p, n, t in zip(keys, buffer_ptrs, sizes, targets)]

    # -- safetensors ----------------------------------------------------------------------
    def save_tensor_to_safetensor(self, key: str, file_name: str | None = None) -> int:
        """Write the tensor under ``key`` to a safetensors file (default name: the key)."""
        tensor = self.get_tensor(key)
        if tensor is None:
            log.error("save_tensor_to_safetensor: no tensor under %r", key)
            return _FILE_NOT_FOUND
        try:
            _safetensors().save_file({key: tensor}, key if file_name is None else file_name)
            return 0
        except (OSError, ValueError, TypeError) as exc:
            log.error("save_tensor_to_safetensor %r failed: %s", key, exc)
            return _INVALID
        except NotSupported as exc:
            log.error("save_tensor_to_safetensor: %s", exc)
            return to_code(exc)

    def load_tensor_from_safetensor(self, key: str | None = None, file_name: str = "") -> Any:
        """Store a tensor of a safetensors file under ``key`` (default: the file name) and
        return it, or None. The file's entry named ``key`` is used, else its first one."""
        try:
            loaded = _safetensors().load_file(file_name)
        except (OSError, ValueError, NotSupported) as exc:
            log.error("load_tensor_from_safetensor %r failed: %s", file_name, exc)
            return None
        if not loaded:
            log.error("load_tensor_from_safetensor: no tensors in %s", file_name)
            return None
        target = file_name if key is None else key
        if key is not None and key not in loaded:
            log.warning("%r is not in %s; storing its first tensor", key, file_name)
        tensor = loaded[key] if key in loaded else next(iter(loaded.values()))
        return tensor if self.put_tensor(target, tensor) == 0 else None


# -- the original's parallelism spec objects -----------------------------------------------
class ParallelAxis:
    """One parallel axis of a writer or reader: ``kind`` ("dp", "tp", "ep", "pp"), ``rank`` of
    ``size``; ``split_dim`` (tp), ``expert_id`` (ep), ``stage_id`` (pp)."""

    def __init__(self) -> None:
        self.kind = ""
        self.rank = 0
        self.size = 1
        self.split_dim: int | None = None
        self.expert_id: int | None = None
        self.stage_id: int | None = None

    def __repr__(self) -> str:
        return (f"ParallelAxis(kind={self.kind!r}, rank={self.rank}, size={self.size}, "
                f"split_dim={self.split_dim}, expert_id={self.expert_id}, stage_id={self.stage_id})")


class TensorParallelism:
    """The axes of one shard."""

    def __init__(self) -> None:
        self.axes: list[ParallelAxis] = []

    def __repr__(self) -> str:
        return f"TensorParallelism(axes={self.axes})"


class ReadTarget:
    """What a reader wants: ``mode`` "as_stored", "shard" (its own shard under
    ``parallelism``) or "full" (the whole tensor)."""

    def __init__(self) -> None:
        self.mode = "as_stored"
        self.parallelism: TensorParallelism | None = None

    def __repr__(self) -> str:
        return f"ReadTarget(mode={self.mode!r}, parallelism={self.parallelism})"


# -- helpers ------------------------------------------------------------------------------
def _opt(v: Any) -> int | None:
    return None if v is None else int(v)


def _axes(parallelism: Any) -> list[P.Axis] | None:
    """Our axes of a TensorParallelism-like object (None stays None)."""
    if parallelism is None:
        return None
    return [P.Axis(P.axis_kind(a.kind), int(a.rank), int(a.size), _opt(a.split_dim),
                   _opt(getattr(a, "expert_id", None)), _opt(getattr(a, "stage_id", None)))
            for a in parallelism.axes]


def _writer(partition: Any) -> P.Writer | None:
    if partition is None:
        return None
    w = P.Writer(int(partition.rank), int(partition.size), int(partition.split_dim))
    if w.size <= 0 or not 0 <= w.rank < w.size or w.split_dim < 0:
        raise InvalidParams(f"invalid writer partition {w}")
    return w


def _outcome(what: str, key: str, err: BaseException | None, upsert: bool) -> int:
    """The code of one key's write; the original's put keeps an existing object and
    reports success."""
    if err is None or (isinstance(err, ObjectAlreadyExists) and not upsert):
        return 0
    log.error("%s %r failed: %s", what, key, err)
    return to_code(err)


def _first(codes: Sequence[int]) -> int:
    return next((c for c in codes if c), 0)


def _bad_config(config: Any) -> bool:
    """The original refuses preferred segments that do not name one per replica."""
    segments = getattr(config, "preferred_segments", None)
    return bool(segments) and len(segments) != int(config.replica_num)


def _raw(ptr: int, size: int) -> memoryview:
    if not ptr or size < 0:
        raise InvalidParams("null buffer pointer or negative size")
    return memory.view_of(None, ptr, size)


def _place(header: T.TensorHeader, ptr: int, size: int) -> Any:
    """Write ``header`` at ``ptr`` and return the data room after it (``P.Dest``)."""
    need = T.HEADER_SIZE + header.data_bytes
    if need > size:
        raise BufferTooSmall(f"the tensor needs {need} bytes, the buffer has {size}")
    view = memory.view_of(None, ptr, need)
    view[:T.HEADER_SIZE] = T.pack_header(header)
    return np.frombuffer(view, np.uint8, header.data_bytes, T.HEADER_SIZE).reshape(
        tuple(header.local_shape) + (T.itemsize(header.dtype),))


def _header_at(ptr: int, size: int) -> T.TensorHeader:
    """Check the header of a ``[header | data]`` buffer of ``size`` bytes at ``ptr`` (host
    or GPU memory; a pointer to neither is InvalidArgument, not a crash)."""
    if not ptr:
        raise InvalidParams("buffer pointer cannot be null")
    if size < T.HEADER_SIZE:
        raise InvalidParams(f"{size} bytes cannot hold a tensor header")
    return T.parse_header(memory.read_bytes(ptr, T.HEADER_SIZE), size)


def _decode_in_place(address: int, nbytes: int) -> Any:
    """The tensor read into registered memory, over that memory: a CUDA tensor for GPU
    memory (never a CPU view of it), else a CPU one."""
    if memory.kind_of(address, nbytes) == "cuda":
        return T.decode_device(address, nbytes, cuda.pointer_info(address).device)
    return T.decode(memory.view_of(None, address, nbytes), copy=False)


def _decoded(key: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except MooncakeError as exc:
        log.error("tensor %r: %s", key, exc)
        return None


def _failed(key: str, exc: BaseException) -> None:
    log.error("reading tensor %r failed: %s", key, exc)
    return None


def _safetensors() -> Any:
    T.torch()
    try:
        import safetensors.torch as st
    except ImportError as exc:
        raise NotSupported("safetensors files need the safetensors package "
                           "(pip install safetensors)") from exc
    return st
