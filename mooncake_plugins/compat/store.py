"""``mooncake.store.MooncakeDistributedStore`` and ``ReplicateConfig`` of the original.

Same names, argument order and return conventions: ints are 0 or a negative ErrorCode;
``get`` returns ``b""`` on failure; ``get_into`` and ``batch_get_into`` return the bytes
read or a negative code; ``is_exist`` returns 1, 0 or a negative code. Errors are logged,
since an int cannot carry the reason.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import msgpack

from ..errors import InvalidParams, MooncakeError, NotSupported
from ..store.client import ReplicateConfig as _Config, StoreClient
from ..transfer.memory import address_of
from .engine import TransferEngine as CompatEngine

log = logging.getLogger(__name__)


def _code(exc: BaseException) -> int:
    return exc.code if isinstance(exc, MooncakeError) and exc.code < 0 else -1


def _size(value: Any) -> int:
    """Sizes as the frameworks pass them: ints, or strings such as "4GB", "512MiB", "1073741824"."""
    if isinstance(value, int):
        return value
    text = str(value).strip().upper().replace("IB", "B")
    for suffix, mult in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("B", 1)):
        if text.endswith(suffix):
            return int(float(text[:-len(suffix)]) * mult)
    return int(text)


class ReplicateConfig:
    """The original's ReplicateConfig (the attributes the frameworks set)."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.with_soft_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []

    def _ours(self) -> _Config:
        preferred = list(self.preferred_segments)
        if self.preferred_segment and self.preferred_segment not in preferred:
            preferred.insert(0, self.preferred_segment)
        return _Config(int(self.replica_num), preferred, bool(self.with_soft_pin))

    def __repr__(self) -> str:
        return (f"ReplicateConfig(replica_num={self.replica_num}, with_soft_pin={self.with_soft_pin}, "
                f"preferred_segment={self.preferred_segment!r})")


class BufferHandle(bytes):
    """The original's BufferHandle: one object's bytes, with ``ptr()``, ``size()``, ``len()``
    and the buffer protocol (it is a ``bytes``)."""

    def ptr(self) -> int:
        """Address of the first byte (valid while this handle lives)."""
        return address_of(self)[0] if len(self) else 0

    def size(self) -> int:
        return len(self)


class ReplicaDescriptor:
    """One replica of an object, as ``batch_get_replica_desc`` reports it."""

    def __init__(self, shards: list | None = None, disk_path: str | None = None) -> None:
        self.shards = shards or []
        self.disk_path = disk_path
        self.status = "COMPLETE"

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


class MooncakeDistributedStore:
    """Drop-in for the original client; call ``setup`` first."""

    def __init__(self) -> None:
        self._client: StoreClient | None = None
        self._hostname = ""

    @property
    def client(self) -> StoreClient:
        if self._client is None:
            raise InvalidParams("MooncakeDistributedStore.setup() has not been called")
        return self._client

    # -- setup ------------------------------------------------------------------------
    def setup(self, local_hostname: Any, metadata_server: str = "P2PHANDSHAKE",
              global_segment_size: Any = 3355443200, local_buffer_size: Any = 1073741824,
              protocol: str = "tcp", rdma_devices: str = "", master_server_addr: str = "127.0.0.1:50051",
              engine: Any = None, enable_ssd_offload: bool = False, ssd_offload_path: str = "",
              tenant_id: str = "default", enable_client_http_server: bool = False,
              client_http_port: int = 9300) -> int:
        """Connect to the master and mount ``global_segment_size`` bytes (0 or negative code).

        Also takes a single dict (the newer API) with those names as keys.
        ``local_buffer_size`` is accepted for compatibility: reads land straight in the
        caller's memory here, so no staging buffer is allocated.
        """
        try:
            if isinstance(local_hostname, dict):
                cfg = dict(local_hostname)
                local_hostname = cfg.pop("local_hostname", "127.0.0.1")
                return self.setup(local_hostname, **{k: v for k, v in cfg.items() if k in _SETUP_KEYS})
            if tenant_id != "default":
                raise NotSupported("tenants other than 'default' are not supported")
            if enable_client_http_server:
                raise NotSupported("the client HTTP server is not supported")
            if protocol == "rdma":
                log.warning("rdma is not available on this build: using tcp (and shm on one host)")
                protocol = "tcp"
            inner = engine.get_engine() if isinstance(engine, CompatEngine) else engine
            self._hostname = str(local_hostname)
            self._client = StoreClient(
                master_server_addr, local_hostname=self._hostname,
                metadata_server=metadata_server or "P2PHANDSHAKE",
                global_segment_size=_size(global_segment_size), protocol=protocol, engine=inner,
                enable_ssd_offload=bool(enable_ssd_offload), ssd_offload_path=ssd_offload_path)
            return 0
        except MooncakeError as exc:
            log.error("setup failed: %s", exc)
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

    # -- helpers ----------------------------------------------------------------------
    def _int(self, what: str, fn: Any, *args: Any) -> int:
        try:
            out = fn(*args)
            return out if isinstance(out, int) and not isinstance(out, bool) else 0
        except MooncakeError as exc:
            log.error("%s failed: %s", what, exc)
            return _code(exc)

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
        return self._int("put", self.client.put, key, value, self._cfg(config))

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self._int("upsert", self.client.upsert, key, value, self._cfg(config))

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self._int("put_from", self.client.put_from, key, buffer_ptr, size, self._cfg(config))

    def upsert_from(self, key: str, buffer_ptr: int, size: int,
                    config: ReplicateConfig | None = None) -> int:
        return self._int("upsert_from", self.client.put_from, key, buffer_ptr, size,
                         self._cfg(config), True)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        return self._int("put_parts", lambda: self.client.put_parts(key, *parts, config=self._cfg(config)))

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        return self._int("upsert_parts",
                         lambda: self.client.put_parts(key, *parts, config=self._cfg(config), upsert=True))

    def put_batch(self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None) -> int:
        return self._first_error(self.client.batch_put, keys, values, self._cfg(config))

    def upsert_batch(self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None) -> int:
        return self._first_error(self.client.batch_put, keys, values, self._cfg(config), True)

    def _first_error(self, fn: Any, *args: Any) -> int:
        try:
            errors = fn(*args)
        except MooncakeError as exc:
            log.error("batch put failed: %s", exc)
            return _code(exc)
        for e in errors:
            if e is not None:
                log.error("batch put: %s", e)
                return _code(e)
        return 0

    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                       config: ReplicateConfig | None = None) -> list[int]:
        try:
            return self._codes([e or 0 for e in self.client.batch_put_from(keys, buffer_ptrs, sizes,
                                                                            self._cfg(config))])
        except MooncakeError as exc:
            log.error("batch_put_from failed: %s", exc)
            return [_code(exc)] * len(keys)

    def batch_upsert_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int],
                          config: ReplicateConfig | None = None) -> list[int]:
        try:
            return self._codes([e or 0 for e in self.client.batch_put_from(
                keys, buffer_ptrs, sizes, self._cfg(config), True)])
        except MooncakeError as exc:
            log.error("batch_upsert_from failed: %s", exc)
            return [_code(exc)] * len(keys)

    def batch_put_from_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]],
                                     config: ReplicateConfig | None = None) -> list[int]:
        try:
            parts = [list(zip(p, s)) for p, s in zip(all_buffer_ptrs, all_sizes)]
            return self._codes([e or 0 for e in self.client.batch_put_from_parts(keys, parts,
                                                                                  self._cfg(config))])
        except MooncakeError as exc:
            log.error("batch_put_from_multi_buffers failed: %s", exc)
            return [_code(exc)] * len(keys)

    # -- gets -------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        try:
            return self.client.get(key)
        except MooncakeError as exc:
            log.error("get %r failed: %s", key, exc)
            return b""

    def get_batch(self, keys: list[str]) -> list[bytes]:
        try:
            return [b"" if isinstance(r, Exception) else r for r in self.client.batch_get(keys)]
        except MooncakeError as exc:
            log.error("get_batch failed: %s", exc)
            return [b""] * len(keys)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        try:
            return self._codes(self.client.batch_get_into(keys, buffer_ptrs, sizes))
        except MooncakeError as exc:
            log.error("batch_get_into failed: %s", exc)
            return [_code(exc)] * len(keys)

    def batch_get_into_multi_buffers(self, keys: list[str], all_buffer_ptrs: list[list[int]],
                                     all_sizes: list[list[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        try:
            parts = [list(zip(p, s)) for p, s in zip(all_buffer_ptrs, all_sizes)]
            return self._codes(self.client.batch_get_into_parts(keys, parts))
        except MooncakeError as exc:
            log.error("batch_get_into_multi_buffers failed: %s", exc)
            return [_code(exc)] * len(keys)

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object in a BufferHandle, or None (logged) when it cannot be read."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
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
            _, memory, disk = info
            out[key] = [ReplicaDescriptor(list(r)) for r in memory]
            if disk is not None:
                out[key].append(ReplicaDescriptor(disk_path=disk))
        return out

    # -- queries and removal ----------------------------------------------------------
    def is_exist(self, key: str) -> int:
        try:
            return int(self.client.exists(key))
        except MooncakeError as exc:
            log.error("is_exist failed: %s", exc)
            return _code(exc)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
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

    # -- tensors ----------------------------------------------------------------------
    def put_tensor(self, key: str, tensor: Any) -> int:
        """Store a CPU torch tensor with its dtype and shape (read back by ``get_tensor``)."""
        try:
            header = msgpack.packb({"dtype": str(tensor.dtype).removeprefix("torch."),
                                    "shape": list(tensor.shape)})
            data = tensor.detach().contiguous().cpu().view(-1).view(_torch().uint8).numpy()
            self.client.put_parts(key, len(header).to_bytes(4, "little"), header, data)
            return 0
        except MooncakeError as exc:
            log.error("put_tensor failed: %s", exc)
            return _code(exc)

    def get_tensor(self, key: str) -> Any:
        """The tensor stored by ``put_tensor``, or None."""
        try:
            raw = self.client.get(key)
        except MooncakeError as exc:
            log.error("get_tensor failed: %s", exc)
            return None
        torch = _torch()
        n = int.from_bytes(raw[:4], "little")
        meta = msgpack.unpackb(raw[4:4 + n])
        flat = torch.frombuffer(bytearray(raw[4 + n:]), dtype=torch.uint8)
        return flat.view(getattr(torch, meta["dtype"])).reshape(meta["shape"])


_SETUP_KEYS = {"metadata_server", "global_segment_size", "local_buffer_size", "protocol",
               "rdma_devices", "master_server_addr", "enable_ssd_offload", "ssd_offload_path",
               "tenant_id"}


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise NotSupported("put_tensor/get_tensor need torch installed") from exc
    return torch
