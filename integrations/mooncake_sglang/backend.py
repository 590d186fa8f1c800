"""``MooncakePluginsHiCache``: SGLang's HiCache L3 storage over our store.

Each page is one store object. The zero-copy interface (``batch_set_v1`` /
``batch_get_v1``) gathers a page straight from the host pool's memory, registered with
the store client, and scatters it straight back: the pieces are those of SGLang's own
``get_page_buffer_meta`` (k and v of the page for ``page_first`` and
``page_first_direct``; k and v of each layer for ``layer_first``). The generic interface
(``batch_set`` / ``batch_get``) stores the flat data page SGLang hands over. The two
byte orders differ, so their keys differ too. Store faults give misses (a page read
only counts when all of its bytes arrived), never wrong pages.
"""

from __future__ import annotations

import hashlib
import re
import logging
from typing import Any, List, Optional, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, HiCacheStorageConfig,
                                                  HiCacheStorageExtraInfo)

from mooncake_plugins.errors import MooncakeError, ObjectAlreadyExists
from mooncake_plugins.store.client import ReplicateConfig, StoreClient

from .config import BackendSettings, from_extra_config

log = logging.getLogger(__name__)


def _model_tag(model: str | None) -> str:
    model = model or "model"
    base = model.rstrip("/").rsplit("/", 1)[-1] or "model"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in base)[:48]
    return f"{safe}-{hashlib.sha256(model.encode()).hexdigest()[:12]}"


class MooncakePluginsHiCache(HiCacheStorage):
    """HiCache storage backend over a Mooncake store.

    Built by SGLang's factory, as ``cls(storage_config, {})`` (``dynamic``) or
    ``cls(storage_config, host_pool)`` (the ``mooncake`` name, see
    :func:`mooncake_sglang.register`); the host pool arrives through
    ``register_mem_pool_host`` either way.

    Raises:
        ValueError: a bad extra-config key or value (named).
        MooncakeError / OSError: the store master cannot be reached.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, _host_pool_or_kwargs: Any = None
                 ) -> None:
        self.storage_config = storage_config
        self.settings: BackendSettings = from_extra_config(storage_config.extra_config)
        s = self.settings
        self._replicas = ReplicateConfig(replica_num=s.replica_num)
        self._base = ""
        self._registered: int | None = None
        self.client = StoreClient(s.master_server_address, local_hostname=s.local_hostname,
                                  metadata_server=s.metadata_server,
                                  global_segment_size=s.global_segment_size,
                                  protocol=s.protocol, rpc_timeout_s=s.rpc_timeout_s,
                                  transfer_timeout_s=s.transfer_timeout_s,
                                  failover_timeout_s=s.rpc_timeout_s)

    # -- attach ---------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Register the pool's KV memory with the store (zero-copy) and fix the keys."""
        super().register_mem_pool_host(mem_pool_host)
        buf = mem_pool_host.kv_buffer
        if buf is not None and buf.device.type == "cpu" and buf.is_contiguous():
            if self._registered is not None:
                self.client.unregister_buffer(self._registered)
            self.client.register_buffer(buf.data_ptr(), buf.numel() * buf.element_size())
            self._registered = buf.data_ptr()
        cfg = self.storage_config
        rank = "mla" if cfg.is_mla_model else f"tp{cfg.tp_rank}of{cfg.tp_size}"
        if cfg.pp_size > 1:
            rank += f"-pp{cfg.pp_rank}of{cfg.pp_size}"
        p = mem_pool_host
        shape = (f"{type(p).__name__}-{str(p.dtype).removeprefix('torch.')}-p{p.page_size}"
                 f"-L{p.layer_num}-{p.get_size_per_token()}Bpt")
        self._base = (f"{self.settings.key_prefix}sglang/{_model_tag(cfg.model_name)}/"
                      f"{shape}/{rank}/{p.layout}")
        log.info("HiCache pages under %s/... in the store at %s", self._base,
                 self.settings.master_server_address)

    def _keys(self, keys: Sequence[str], flat: bool) -> list[str]:
        if not self._base:
            raise RuntimeError("register_mem_pool_host() has not been called")
        base = self._base + ("-flat/" if flat else "/")
        return [base + k for k in keys]

    def _writes(self) -> bool:
        """MLA ranks hold the same KV: only SGLang's designated writer stores it."""
        return self.storage_config.is_storage_writer

    # -- existence ------------------------------------------------------------------
    def batch_exists(self, keys: List[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """How many of ``keys``, from the first, are stored (0 while the store is out)."""
        if not keys:
            return 0
        try:
            found = self.client.batch_exists(self._keys(keys, self._flat_mode()))
        except MooncakeError as exc:
            log.warning("HiCache lookup failed (a miss): %s", exc)
            return 0
        return next((i for i, hit in enumerate(found) if not hit), len(found))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def _flat_mode(self) -> bool:
        """Whether SGLang drives this backend through the generic (flat page) interface."""
        extra = self.storage_config.extra_config or {}
        return extra.get("backend_name") is not None and not extra.get("interface_v1")

    # -- zero-copy interface --------------------------------------------------------
    def _pieces(self, keys: Sequence[str], host_indices: torch.Tensor
                ) -> list[list[tuple[int, int]]]:
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per = len(ptrs) // len(keys)
        if per * len(keys) != len(ptrs):
            raise ValueError(f"{len(ptrs)} buffer pieces for {len(keys)} pages")
        return [list(zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per]))
                for i in range(len(keys))]

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Store pages from the host pool (pages already stored are left as they are)."""
        if not keys:
            return []
        if not self._writes():
            return [True] * len(keys)
        names = self._keys(keys, flat=False)
        try:
            errors = self.client.batch_put_from_parts(names, self._pieces(keys, host_indices),
                                                      self._replicas)
        except MooncakeError as exc:
            log.warning("HiCache backup of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        return [e is None or isinstance(e, ObjectAlreadyExists) for e in errors]

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Read pages into the host pool; a page is True only when all its bytes arrived."""
        if not keys:
            return []
        pieces = self._pieces(keys, host_indices)
        try:
            got = self.client.batch_get_into_parts(self._keys(keys, flat=False), pieces)
        except MooncakeError as exc:
            log.warning("HiCache prefetch of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        return [not isinstance(n, Exception) and n == sum(s for _, s in p)
                for n, p in zip(got, pieces)]

    # -- generic interface ----------------------------------------------------------
    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Store flat data pages (``values``: tensors); True when every page is stored."""
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set needs one value tensor per key")
        if not self._writes():
            return True
        data = [v.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
                for v in values]
        try:
            errors = self.client.batch_put(self._keys(keys, flat=True), data, self._replicas)
        except MooncakeError as exc:
            log.warning("HiCache backup of %d pages failed: %s", len(keys), exc)
            return False
        return all(e is None or isinstance(e, ObjectAlreadyExists) for e in errors)

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        """Read flat data pages into ``target_locations`` (one tensor per key); each
        target is returned filled, or None when its page is not (all) there."""
        if not keys:
            return []
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("batch_get needs one target tensor per key")
        try:
            got = self.client.batch_get(self._keys(keys, flat=True))
        except MooncakeError as exc:
            log.warning("HiCache prefetch of %d pages failed: %s", len(keys), exc)
            return [None] * len(keys)
        out: list[torch.Tensor | None] = []
        for data, target in zip(got, target_locations):
            flat = target.view(-1).view(torch.uint8)
            if isinstance(data, Exception) or len(data) != flat.numel():
                out.append(None)
                continue
            flat.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            out.append(target)
        return out

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    # -- lifecycle ------------------------------------------------------------------
    def clear(self) -> None:
        """Remove this deployment's pages (SGLang's cache reset)."""
        if self._base:
            self.client.remove_by_regex("^" + re.escape(self._base) + "(-flat)?/")

    def close(self) -> None:
        if self._registered is not None:
            self.client.unregister_buffer(self._registered)
            self._registered = None
        self.client.close()
