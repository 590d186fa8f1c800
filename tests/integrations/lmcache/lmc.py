"""LMCache's storage stack on CPU, as a worker builds it, for tests and the reader child.

``Backends`` owns an asyncio loop thread and the backends ``CreateStorageBackends``
made from an ``LMCacheEngineConfig``; chunks are real ``MemoryObj``s from LMCache's local
CPU pool, filled with bytes that depend only on (seed, chunk index).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend import CreateStorageBackends

import mooncake_lmcache

CHUNK = 16
MODEL = "tiny-llama"
KV_SHAPE = (4, 2, CHUNK, 4, 32)  # layers, k/v, tokens, heads, head size: 64 KiB fp32


def ours(address: str, **settings: Any) -> dict[str, Any]:
    """``extra_config`` selecting our connector, with no segment of its own."""
    return mooncake_lmcache.extra_config(master_server_address=address, global_segment_size=0,
                                         rpc_timeout_s=2.0, transfer_timeout_s=5.0,
                                         **settings)


def config(plugins: list[str], extra: dict[str, Any], **fields: Any) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.05,
        remote_storage_plugins=plugins, extra_config=extra, **fields)


def metadata(role: str | None = None) -> LMCacheMetadata:
    """A one-worker deployment's metadata; LMCache's scheduler process has role scheduler."""
    return LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.float32, kv_shape=KV_SHAPE,
                           chunk_size=CHUNK, role=role)


def key(chunk: int, worker: int = 0) -> CacheEngineKey:
    return CacheEngineKey(MODEL, 1, worker, 0x5EED0000 + chunk, torch.float32)


def chunk_bytes(seed: int, chunk: int, tokens: int = CHUNK) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100003 + chunk)
    shape = (KV_SHAPE[1], KV_SHAPE[0], tokens, KV_SHAPE[3] * KV_SHAPE[4])
    return torch.randn(shape, generator=g, dtype=torch.float32)


def expected_digest(seed: int, chunk: int, tokens: int = CHUNK) -> str:
    return hashlib.sha256(chunk_bytes(seed, chunk, tokens).numpy().tobytes()).hexdigest()


def digest(obj: MemoryObj) -> str:
    return hashlib.sha256(bytes(obj.byte_array)).hexdigest()


class Backends:
    """LMCache's backends for ``cfg``: ``.cpu`` (LocalCPUBackend) and ``.remote``."""

    def __init__(self, cfg: LMCacheEngineConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="lmcache-loop",
                                        daemon=True)
        self._thread.start()
        self.metadata = metadata()
        try:
            self.all = CreateStorageBackends(cfg, self.metadata, self.loop, dst_device="cpu")
        except BaseException:
            self._stop_loop()
            raise
        self.cpu = self.all["LocalCPUBackend"]
        remotes = [b for name, b in self.all.items() if name.startswith("RemoteBackend")]
        self.remote = remotes[0] if remotes else None

    def chunk(self, seed: int, index: int, tokens: int = CHUNK) -> MemoryObj:
        """A memory object of LMCache's CPU pool holding chunk ``index`` of ``seed``."""
        md = self.metadata
        obj = self.cpu.allocate(md.get_shapes(tokens), md.get_dtypes(), None)
        assert obj is not None
        obj.tensor.copy_(chunk_bytes(seed, index, tokens))
        return obj

    def put(self, keys: list[CacheEngineKey], objs: list[MemoryObj],
            timeout_s: float = 30.0) -> None:
        """LMCache's batched put, waited for until every key's write completed."""
        done: set[CacheEngineKey] = set()
        finished = threading.Event()

        def on_complete(k: CacheEngineKey) -> None:
            done.add(k)
            if len(done) == len(keys):
                finished.set()

        self.remote.batched_submit_put_task(keys, objs, on_complete_callback=on_complete)
        assert finished.wait(timeout_s), "LMCache's put tasks did not finish"

    def close(self) -> None:
        try:
            for backend in reversed(self.all.values()):
                backend.close()
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
