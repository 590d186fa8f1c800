"""``mooncake.store.MooncakeDistributedStore`` of the original (``ReplicateConfig``,
``SoftPinAction`` and ``ObjectDataType`` are :mod:`..store.replicate_config`'s, re-exported).

Same names, argument order and return conventions: ints are 0 or a negative ErrorCode;
``get`` returns ``b""`` on failure; ``get_into`` and ``batch_get_into`` return the bytes
read or a negative code; ``is_exist`` returns 1, 0 or a negative code. Errors are logged,
since an int cannot carry the reason.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import random
from contextlib import nullcontext
from typing import Any, Sequence

from ..config import parse_size
from ..errors import InvalidParams, MooncakeError, NotSupported, ObjectAlreadyExists
from ..store.client import ReplicateConfig as _Config, StoreClient
from ..store.replicate_config import ObjectDataType, ReplicateConfig, SoftPinAction
from ..transfer import verbs
from ..transfer.memory import address_of
from .engine import TransferEngine as CompatEngine
from .store_dummy import _DummyMethods
from .store_tasks import _TaskMethods
from .store_tensors import _TensorMethods

log = logging.getLogger(__name__)


def _code(exc: BaseException) -> int:
    return exc.code if isinstance(exc, MooncakeError) and exc.code < 0 else -1


def _size(value: Any) -> int:
    """Sizes as the frameworks pass them: ints, or strings such as "4GB", "512MiB"."""
    try:
        return parse_size(value)
    except ValueError as exc:
        raise InvalidParams(str(exc)) from None


class BufferHandle(bytes):
    """The original's BufferHandle: one object's bytes, with ``ptr()``, ``size()``, ``len()``
    and the buffer protocol (it is a ``bytes``)."""

    def ptr(self) -> int:
        """Address of the first byte (valid while this handle lives)."""
        return address_of(self)[0] if len(self) else 0

    def size(self) -> int:
        return len(self)


class Descriptor:
    """Where a memory replica lives: ``transport_endpoint`` is its segment's name."""

    def __init__(self, size: int = 0, buffer_address: int = 0, transport_endpoint: str = "") -> None:
        self.size = size
        self.buffer_address = buffer_address
        self.transport_endpoint = transport_endpoint

    def __repr__(self) -> str:
        return (f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
                f"transport_endpoint={self.transport_endpoint}>")


class MemoryDescriptor:
    def __init__(self, buffer_descriptor: Descriptor) -> None:
        self.buffer_descriptor = buffer_descriptor


class DiskDescriptor:
    def __init__(self, file_path: str = "", object_size: int = 0) -> None:
        self.file_path = file_path
        self.object_size = object_size


class ReplicaDescriptor:
    """One replica of an object, as ``batch_get_replica_desc`` reports it."""

    def __init__(self, shards: list | None = None, disk_path: str | None = None,
                 nbytes: int = 0) -> None:
        self.shards = shards or []
        self.disk_path = disk_path
        self.nbytes = nbytes
        self.status = "COMPLETE"

    def get_memory_descriptor(self) -> MemoryDescriptor:
        """The replica's first (usually only) shard: segment, address; size is the object's."""
        if not self.shards:
            raise RuntimeError("not a memory replica")
        segment, address, _ = self.shards[0]
        return MemoryDescriptor(Descriptor(self.nbytes, address, segment))

    def get_disk_descriptor(self) -> DiskDescriptor:
        if self.disk_path is None:
            raise RuntimeError("not a disk replica")
        return DiskDescriptor(self.disk_path, self.nbytes)

    def is_memory_replica(self) -> bool:
        return self.disk_path is None

    def is_disk_replica(self) -> bool:
        return self.disk_path is not None

    def is_local_disk_replica(self) -> bool:
        """A disk replica whose file this host can open directly."""
        return self.disk_path is not None and os.path.exists(self.disk_path)

    def __repr__(self) -> str:
        where = f"disk {self.disk_path}" if self.disk_path else f"memory {self.shards}"
        return f"ReplicaDescriptor({where})"


class MooncakeDistributedStore(_TensorMethods, _TaskMethods, _DummyMethods):
    """Drop-in for the original client; call ``setup`` first."""

    def __init__(self) -> None:
        self._client: StoreClient | None = None
        self._setup_error: str | None = None  # why the last setup() failed
        self._hostname = ""
        self._local_buffer_size = 0  # bytes of the BufferPool's local buffer (compat.buffer_pool)
        self._no_local_buffer = False  # setup(local_buffer_size=0): copying puts and gets fail

    @property
    def client(self) -> StoreClient:
        if self._client is None:
            raise InvalidParams(self._why_not_connected())
        return self._client

    def _why_not_connected(self) -> str:
        if self._setup_error is not None:
            return f"MooncakeDistributedStore.setup() failed ({self._setup_error}): not connected"
        return "MooncakeDistributedStore.setup() has not been called"

    # -- setup ------------------------------------------------------------------------
    def setup(self, local_hostname: Any, metadata_server: str = "P2PHANDSHAKE",
              global_segment_size: Any = 3355443200, local_buffer_size: Any = 1073741824,
              protocol: str = "tcp", rdma_devices: str = "", master_server_addr: str = "127.0.0.1:50051",
              engine: Any = None, enable_ssd_offload: bool = False, ssd_offload_path: str = "",
              tenant_id: str = "default", enable_client_http_server: bool = False,
              client_http_port: int = 9300) -> int:
        """Connect to the master and mount ``global_segment_size`` bytes (0 or negative code).

        Also takes a single dict (the newer API) with those names as keys, and the
        names frameworks use for two of them (``master_server_address``, ``device_name``).
        After a failed setup every call logs why and fails, and ``is_exist`` /
        ``batch_is_exist`` answer 0: callers that ignore setup's code (LMCache) must not
        read a negative code as "present".
        ``local_buffer_size`` 0 makes copying puts and gets fail, as the original; otherwise
        it is accepted for compatibility: reads land straight in the
        caller's memory here, so no staging buffer is allocated.
        """
        try:
            if isinstance(local_hostname, dict):
                cfg = dict(local_hostname)
                for alias, name in _SETUP_ALIASES.items():
                    if alias in cfg:
                        cfg.setdefault(name, cfg.pop(alias))
                local_hostname = cfg.pop("local_hostname", "127.0.0.1")
                unknown = sorted(set(cfg) - _SETUP_KEYS)
                if unknown:
                    log.warning("setup: ignoring unknown keys %s", ", ".join(unknown))
                return self.setup(local_hostname, **{k: v for k, v in cfg.items() if k in _SETUP_KEYS})
            if tenant_id != "default":
                raise NotSupported("tenants other than 'default' are not supported")
            if enable_client_http_server:
                raise NotSupported("the client HTTP server is not supported")
            if protocol == "rdma" and not verbs.available():
                log.warning("rdma: %s here, using tcp (and shm on one host)",
                            verbs.why_unavailable())
                protocol = "tcp"
            inner = engine.get_engine() if isinstance(engine, CompatEngine) else engine
            self._hostname = str(local_hostname)
            self._local_buffer_size = _size(local_buffer_size)
            self._no_local_buffer = self._local_buffer_size == 0
            segment_size = _size(global_segment_size)
            # as the original: a hostname without a port gets one in [12300, 14300]
            names = ([self._hostname] if ":" in self._hostname or inner is not None else
                     [f"{self._hostname}:{p}" for p in random.sample(_AUTO_PORTS, 20)])
            for i, name in enumerate(names):
                try:
                    self._client = StoreClient(
                        master_server_addr, local_hostname=name,
                        metadata_server=metadata_server or "P2PHANDSHAKE",
                        global_segment_size=segment_size, protocol=protocol, engine=inner,
                        enable_ssd_offload=bool(enable_ssd_offload), ssd_offload_path=ssd_offload_path)
                    break
                except OSError:
                    if i == len(names) - 1:
                        raise
            self._setup_error = None
            return 0
        except MooncakeError as exc:
            log.error("setup failed: %s", exc)
            self._setup_error = str(exc)
            return _code(exc)

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = 16 << 20) -> int:
        """Older API: setup with defaults (master on 127.0.0.1:50051, P2P handshake)."""
        return self.setup("127.0.0.1", "P2PHANDSHAKE", mount_segment_size, 0, protocol, device_name)

    def get_hostname(self) -> str:
        """This client's segment name (``host:port``), as peers address it."""
        return self.client.segment_name if self._client else self._hostname

    def close(self) -> int:
        if self._client is not None:
            self._client.close()
            self._client = None
        return 0

    def __del__(self) -> None:
        """As the original's destructor: a store dropped without ``close()`` is closed
        (SGLang's HiCache backend relies on it)."""
        client = getattr(self, "_client", None)
        if client is not None:
            self._client = None
            try:
                client.close()
            except Exception as exc:  # noqa: BLE001 (a destructor must not raise)
                log.debug("closing a dropped store: %s", exc)

    # -- helpers ----------------------------------------------------------------------
    def _int(self, what: str, fn: Any, *args: Any) -> int:
        try:
            out = fn(*args)
            return out if isinstance(out, int) and not isinstance(out, bool) else 0
        except MooncakeError as exc:
            log.error("%s failed: %s", what, exc)
            return _code(exc)

    def _staging_refused(self, what: str) -> bool:
        """As the original: without a local buffer, calls that copy through it fail."""
        if self._no_local_buffer:
            log.error("%s: local_buffer_size is 0, so only put_from/get_into with registered "
                      "buffers work", what)
        return self._no_local_buffer

    def _put(self, what: str, fn: Any, *args: Any) -> int:
        """A put's code: an existing key is success, as the original's put leaves it as is."""
        if self._staging_refused(what) and not what.endswith("_from"):
            return InvalidParams.code
        try:
            fn(*args)
            return 0
        except ObjectAlreadyExists as exc:
            log.debug("%s: %s (kept)", what, exc)
            return 0
        except MooncakeError as exc:
            log.error("%s failed: %s", what, exc)
            return _code(exc)

    @staticmethod
    def _put_codes(errors: Sequence[Any]) -> list[int]:
        return [0 if e is None or isinstance(e, ObjectAlreadyExists) else _code(e) for e in errors]

    @staticmethod
    def _codes(results: Sequence[Any]) -> list[int]:
        return [(_code(r) if isinstance(r, Exception) else (r if isinstance(r, int) else 0))
                for r in results]

    @staticmethod
    def _cfg(config: ReplicateConfig | None) -> _Config | None:
        return config._ours() if config is not None else None

    # -- buffers ----------------------------------------------------------------------
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        return self._int("register_buffer", self.client.register_buffer, buffer_ptr, size)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        return self._int("unregister_buffer", self.client.unregister_buffer, buffer_ptr)

    # -- puts -------------------------------------------------------------------------
    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self._put("put", self.client.put, key, value, self._cfg(config))

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self._put("upsert", self.client.upsert, key, value, self._cfg(config))

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self._put("put_from", self.client.put_from, key, buffer_ptr, size, self._cfg(config))

    def upsert_from(self, key: str, buffer_ptr: int, size: int,
                    config: ReplicateConfig | None = None) -> int:
        return self._put("upsert_from", self.client.put_from, key, buffer_ptr, size,
                         self._cfg(config), True)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        return self._put("put_parts", lambda: self.client.put_parts(key, *parts, config=self._cfg(config)))

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        return self._put("upsert_parts",
                         lambda: self.client.put_parts(key, *parts, config=self._cfg(config), upsert=True))

    def put_batch(self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None) -> int:
        return self._first_error(self.client.batch_put, keys, values, self._cfg(config))

    def upsert_batch(self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None) -> int:
        return self._first_error(self.client.batch_put, keys, values, self._cfg(config), True)

    def _first_error(self, fn: Any, *args: Any) -> int:
        if self._staging_refused("batch put"):
            return InvalidParams.code
        try:
            errors = fn(*args)
        except MooncakeError as exc:
            log.error("batch put failed: %s", exc)
            return _code(exc)
        for e, code in zip(errors, self._put_codes(errors)):
            if code:
                log.error("batch put: %s", e)
                return code
        return 0

    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        try:
            return self._put_codes(self.client.batch_put_from(keys, buffer_ptrs, sizes,
                                                              self._cfg(config)))
        except MooncakeError as exc:
            log.error("batch_put_from failed: %s", exc)
            return [_code(exc)] * len(keys)

    def batch_upsert_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                          config: ReplicateConfig | None = None) -> list[int]:
        try:
            return self._put_codes(self.client.batch_put_from(keys, buffer_ptrs, sizes,
                                                              self._cfg(config), True))
        except MooncakeError as exc:
            log.error("batch_upsert_from failed: %s", exc)
            return [_code(exc)] * len(keys)

    def batch_put_from_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]],
                                     config: ReplicateConfig | None = None) -> list[int]:
        try:
            parts = [list(zip(p, s)) for p, s in zip(all_buffer_ptrs, all_sizes)]
            return self._put_codes(self.client.batch_put_from_parts(keys, parts, self._cfg(config)))
        except MooncakeError as exc:
            log.error("batch_put_from_multi_buffers failed: %s", exc)
            return [_code(exc)] * len(keys)

    # -- gets -------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        if self._staging_refused("get"):
            return b""
        try:
            return self.client.get(key)
        except MooncakeError as exc:
            log.error("get %r failed: %s", key, exc)
            return b""

    def get_batch(self, keys: list[str]) -> list[bytes]:
        if self._staging_refused("get_batch"):
            return [b""] * len(keys)
        try:
            return [b"" if isinstance(r, Exception) else r for r in self.client.batch_get(keys)]
        except MooncakeError as exc:
            log.error("get_batch failed: %s", exc)
            return [b""] * len(keys)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        try:
            with self._gpu_destinations(buffer_ptrs, sizes):
                return self._codes(self.client.batch_get_into(keys, buffer_ptrs, sizes))
        except MooncakeError as exc:
            log.error("batch_get_into failed: %s", exc)
            return [_code(exc)] * len(keys)

    def _gpu_destinations(self, ptrs: Sequence[int], sizes: Sequence[int]) -> Any:
        """GPU memory the caller did not register, registered for the call: the original
        reads into any CUDA destination (its tests do). Host memory must be registered."""
        gpu_buffers = getattr(self.client, "gpu_buffers", None)   # a dummy client has none
        return gpu_buffers(zip(ptrs, sizes)) if gpu_buffers else nullcontext()

    def batch_get_into_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        try:
            parts = [list(zip(p, s)) for p, s in zip(all_buffer_ptrs, all_sizes)]
            return self._codes(self.client.batch_get_into_parts(keys, parts))
        except MooncakeError as exc:
            log.error("batch_get_into_multi_buffers failed: %s", exc)
            return [_code(exc)] * len(keys)

    def get_into_ranges(self, buffer_ptrs: list[int], all_keys: list[list[str]],
                        all_dst_offsets: list[list[list[int]]], all_src_offsets: list[list[list[int]]],
                        all_sizes: list[list[list[int]]]) -> list[list[list[int]]]:
        """Copy byte ranges of objects into registered buffers: for buffer ``i`` and its key
        ``j``, ``all_sizes[i][j][k]`` bytes from offset ``all_src_offsets[i][j][k]`` of the
        object to ``buffer_ptrs[i] + all_dst_offsets[i][j][k]``. Returns the bytes copied
        per range, or a negative code (ranges of a missing key, a range outside the object
        or the buffer's registration, range lists of unequal length). Each object is read
        once, whole.
        """
        if not len(buffer_ptrs) == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets) \
                == len(all_sizes):
            log.error("get_into_ranges: the per-buffer lists differ in length")
            return []
        if not hasattr(self.client, "local_view"):
            log.error("get_into_ranges: not supported by %s", type(self.client).__name__)
            return [[[NotSupported.code] * len(n) for n in sizes] for sizes in all_sizes]
        keys = list(dict.fromkeys(k for ks in all_keys for k in ks))
        try:
            objects = dict(zip(keys, self.client.batch_get(keys)))
        except MooncakeError as exc:
            log.error("get_into_ranges failed: %s", exc)
            return [[[_code(exc)] * len(n) for n in sizes] for sizes in all_sizes]
        out = []
        for ptr, ks, dsts, srcs, sizes in zip(buffer_ptrs, all_keys, all_dst_offsets,
                                              all_src_offsets, all_sizes):
            out.append([self._copy_ranges(ptr, objects[k], d, s, n)
                        for k, d, s, n in zip(ks, dsts, srcs, sizes)])
        return out

    def _copy_ranges(self, ptr: int, obj: bytes | Exception, dsts: list[int], srcs: list[int],
                     sizes: list[int]) -> list[int]:
        if not len(dsts) == len(srcs) == len(sizes):
            return [InvalidParams.code] * max(len(dsts), len(srcs), len(sizes))
        if isinstance(obj, Exception):
            return [_code(obj)] * len(sizes)
        done = []
        for d, s, n in zip(dsts, srcs, sizes):
            if min(d, s, n) < 0 or s + n > len(obj):
                done.append(InvalidParams.code)
                continue
            try:
                self.client.local_view(ptr + d, n)[:] = memoryview(obj)[s:s + n]
            except MooncakeError as exc:   # outside the buffer's registration
                log.error("get_into_ranges: %s", exc)
                done.append(InvalidParams.code)
                continue
            done.append(n)
        return done

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object in a BufferHandle, or None (logged) when it cannot be read."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        if self._staging_refused("batch_get_buffer"):
            return [None] * len(keys)
        try:
            out = self.client.batch_get(keys)
        except MooncakeError as exc:
            log.error("batch_get_buffer failed: %s", exc)
            return [None] * len(keys)
        handles: list[BufferHandle | None] = []
        for key, item in zip(keys, out):
            if isinstance(item, Exception):
                log.error("get_buffer %r failed: %s", key, item)
                handles.append(None)
            else:
                handles.append(BufferHandle(item))
        return handles

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        return self.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[ReplicaDescriptor]]:
        """Replicas of every key that exists (missing keys are left out)."""
        try:
            infos = self.client.replicas(keys)
        except MooncakeError as exc:
            log.error("batch_get_replica_desc failed: %s", exc)
            return {}
        out: dict[str, list[ReplicaDescriptor]] = {}
        for key, info in zip(keys, infos):
            if isinstance(info, Exception):
                continue
            nbytes, memory, disk = info
            out[key] = [ReplicaDescriptor(list(r), nbytes=nbytes) for r in memory]
            if disk is not None:
                out[key].append(ReplicaDescriptor(disk_path=disk, nbytes=nbytes))
        return out

    # -- queries and removal ----------------------------------------------------------
    def is_exist(self, key: str) -> int:
        if self._client is None:  # holds nothing (a negative code would read as "present")
            log.error("is_exist: %s", self._why_not_connected())
            return 0
        try:
            return int(self.client.exists(key))
        except MooncakeError as exc:
            log.error("is_exist failed: %s", exc)
            return _code(exc)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        if self._client is None:
            log.error("batch_is_exist: %s", self._why_not_connected())
            return [0] * len(keys)
        try:
            return [int(x) for x in self.client.batch_exists(keys)]
        except MooncakeError as exc:
            log.error("batch_is_exist failed: %s", exc)
            return [_code(exc)] * len(keys)

    def get_size(self, key: str) -> int:
        return self._int("get_size", self.client.size, key)

    def remove(self, key: str, force: bool = False) -> int:
        return self._int("remove", self.client.remove, key, force)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        return self._int("remove_by_regex", self.client.remove_by_regex, regex_pattern, force)

    def remove_all(self, force: bool = False) -> int:
        return self._int("remove_all", self.client.remove_all, force)


class MooncakeHostMemAllocator:
    """The original's host memory allocator: ``alloc(size)`` gives the address of
    ``size`` bytes of page-aligned anonymous memory (0 when there is none), valid until
    ``free(address)`` (SGLang's HiCache allocates its host KV pool with it)."""

    def __init__(self) -> None:
        self._maps: dict[int, tuple[mmap.mmap, Any]] = {}

    def alloc(self, size: int) -> int:
        try:
            m = mmap.mmap(-1, size)
        except (OSError, ValueError, OverflowError) as exc:
            log.error("MooncakeHostMemAllocator.alloc(%r): %s", size, exc)
            return 0
        anchor = ctypes.c_char.from_buffer(m)  # keeps the mapping open until free()
        address = ctypes.addressof(anchor)
        self._maps[address] = (m, anchor)
        return address

    def free(self, address: int) -> int:
        """0, or a negative code for an address ``alloc`` did not return."""
        entry = self._maps.pop(address, None)
        if entry is None:
            log.error("MooncakeHostMemAllocator.free(%#x): not allocated here", address)
            return InvalidParams.code
        m, anchor = entry
        del entry, anchor
        m.close()
        return 0


_AUTO_PORTS = range(12300, 14301)
_SETUP_ALIASES = {"master_server_address": "master_server_addr", "device_name": "rdma_devices"}
_SETUP_KEYS = {"metadata_server", "global_segment_size", "local_buffer_size", "protocol",
               "rdma_devices", "master_server_addr", "enable_ssd_offload", "ssd_offload_path",
               "tenant_id"}

