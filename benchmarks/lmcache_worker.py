#!/usr/bin/env python3
"""One LMCache worker of benchmarks/lmcache_bench.py: its storage backends, timed.

Builds LMCache's own storage stack (``CreateStorageBackends``: the local CPU pool plus
one remote backend) from an ``LMCacheEngineConfig`` selecting ``--variant``'s connector,
with LMCache's event loop in a thread as in a vLLM worker, and moves whole 256-token
chunks of a Llama-2-7B-shaped KV cache (``--layers`` of 32 KV heads x 128, bf16; LMCache's
``KV_2LTD`` memory objects from its CPU pool) through the remote backend's own calls:
``batched_submit_put_task`` (waited for), ``batched_contains``, ``batched_get_blocking``.

``--phase cold``: a fresh process on fresh servers; the connector's construction (the
remote backend's ``init_connection``; the whole ``CreateStorageBackends`` as well, most of
it LMCache filling its CPU pool), then the first put, contains and get of one batch of
fresh keys, each timed once. ``--phase warm``: ``--warmup`` untimed rounds, then
``--rounds`` timed ones, each over a batch of fresh keys, removed afterwards (untimed; on
our store the worker then also waits, untimed, until the master has room for the next
batch: kv_stores.RoomWaiter). Every chunk read is compared byte for byte with the chunk
written. Prints one JSON line. The in-tree ``mooncakestore`` connector imports whichever
``mooncake`` package comes first on the path (our drop-in, or the original's files put
first on PYTHONPATH by the parent).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import threading
import time
from typing import Any, Callable, Iterator

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend import CreateStorageBackends
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from kv_stores import RoomWaiter, worker_main, worker_parser

CHUNK_TOKENS = 256
KV_HEADS, HEAD_DIM = 32, 128  # Llama-2-7B
MODEL = "llama-2-7b-shaped"
VARIANTS = ("ours", "redis", "intree")


def engine_config(a: argparse.Namespace) -> LMCacheEngineConfig:
    """LMCache's config selecting the variant's connector, as a deployment writes it."""
    common: dict[str, Any] = dict(chunk_size=CHUNK_TOKENS, local_cpu=True,
                                  max_local_cpu_size=a.pool_gb, remote_serde="naive",
                                  use_layerwise=False, save_unfull_chunk=False,
                                  blocking_timeout_secs=120)
    if a.variant == "ours":
        import mooncake_lmcache
        extra = mooncake_lmcache.extra_config(
            master_server_address=a.master, metadata_server=a.metadata,
            global_segment_size=0, transfer_timeout_s=120.0)
        return LMCacheEngineConfig.from_defaults(
            remote_storage_plugins=[mooncake_lmcache.PLUGIN_NAME], extra_config=extra,
            **common)
    if a.variant == "redis":
        return LMCacheEngineConfig.from_defaults(remote_url=a.redis_url, extra_config={},
                                                 **common)
    # LMCache's documented keys for its in-tree connector, in its zero-copy mode
    # (chunk metadata kept locally: batch_put_from / batch_get_into into the CPU pool).
    # The original wheel's setup(dict) reads master_server_addr; ours accepts both.
    extra = {"local_hostname": "127.0.0.1", "metadata_server": a.metadata,
             "master_server_address": a.master, "mooncake_master_server_addr": a.master,
             "protocol": "tcp", "device_name": "", "global_segment_size": "0",
             "local_buffer_size": str(256 << 20), "transfer_timeout": 120,
             "save_chunk_meta": False}
    return LMCacheEngineConfig.from_defaults(remote_storage_plugins=["mooncakestore"],
                                             extra_config=extra, **common)


def engine_metadata(layers: int) -> LMCacheMetadata:
    return LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16,
                           kv_shape=(layers, 2, CHUNK_TOKENS, KV_HEADS, HEAD_DIM),
                           chunk_size=CHUNK_TOKENS)


def u8(obj: MemoryObj) -> torch.Tensor:
    return obj.raw_tensor.view(torch.uint8)[:obj.get_size()]


class Worker:
    """LMCache's backends for one variant, and the remote backend's calls, timed."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.metadata = engine_metadata(a.layers)
        self.connect_s = 0.0
        t0 = time.perf_counter()
        with self._timing_connection():
            self.backends = CreateStorageBackends(engine_config(a), self.metadata, self.loop,
                                                  dst_device="cpu")
        self.setup_s = time.perf_counter() - t0
        self.cpu = self.backends["LocalCPUBackend"]
        remotes = [b for n, b in self.backends.items() if n.startswith("RemoteBackend")]
        if not remotes or remotes[0].connection is None:
            raise RuntimeError(f"LMCache built no remote connection for {a.variant}: "
                               f"{list(self.backends)}")
        self.remote = remotes[0]
        self.sources = [self._source(i) for i in range(a.batch)]
        self._remove = self._remover()
        self.room = (RoomWaiter(a.room_master, a.batch * self.sources[0].get_size() + (1 << 20))
                     if a.room_master else None)

    @contextlib.contextmanager
    def _timing_connection(self) -> Iterator[None]:
        """Times the remote backend's ``init_connection`` (the connector's construction:
        connecting, registering the pool), apart from LMCache filling its CPU pool."""
        original = RemoteBackend.init_connection

        def init_connection(backend: RemoteBackend) -> None:
            t0 = time.perf_counter()
            try:
                original(backend)
            finally:
                self.connect_s += time.perf_counter() - t0

        RemoteBackend.init_connection = init_connection
        try:
            yield
        finally:
            RemoteBackend.init_connection = original

    def _source(self, i: int) -> MemoryObj:
        """A chunk of the CPU pool: random bytes (16 MiB tiled), a distinct head."""
        obj = self.cpu.allocate(self.metadata.get_shapes(), self.metadata.get_dtypes(), None)
        if obj is None:
            raise RuntimeError("LMCache's CPU pool is too small for the batch")
        dst = u8(obj)
        block = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(i))
        for off in range(0, dst.numel(), block.numel()):
            n = min(block.numel(), dst.numel() - off)
            dst[off:off + n].copy_(block[:n])
        dst[:64].fill_(i + 1)
        return obj

    def _remover(self) -> Callable[[list[CacheEngineKey]], None]:
        """Removes a round's keys afterwards (untimed: the store holds one batch at
        most), through the variant's own client; ``force`` passes the read lease."""
        conn = self.remote.connection.getWrappedConnector()
        if self.a.variant == "redis":
            import redis
            client = redis.Redis.from_url(self.a.redis_url)
            return lambda keys: client.delete(*[k.to_string() + s for k in keys
                                                for s in ("kv_bytes", "metadata")])
        if self.a.variant == "ours":
            return lambda keys: [conn.io.client.remove(conn.store_key(k), force=True)
                                 for k in keys]

        def remove(keys: list[CacheEngineKey]) -> None:
            for k in keys:
                rc = conn.store.remove(k.to_string(), True)
                if rc != 0:
                    raise RuntimeError(f"remove {k.to_string()}: {rc}")
        return remove

    def keys(self, round_: int) -> list[CacheEngineKey]:
        return [CacheEngineKey(MODEL, 1, 0, (self.a.seed << 32) | (round_ << 12) | i,
                               torch.bfloat16) for i in range(self.a.batch)]

    def put(self, keys: list[CacheEngineKey]) -> float:
        done: set[CacheEngineKey] = set()
        finished = threading.Event()

        def on_complete(k: CacheEngineKey) -> None:
            done.add(k)
            if len(done) == len(keys):
                finished.set()

        failed = self.remote.put_failed_count
        t0 = time.perf_counter()
        self.remote.batched_submit_put_task(keys, self.sources, on_complete_callback=on_complete)
        if not finished.wait(300):
            raise RuntimeError("LMCache's put tasks did not finish")
        took = time.perf_counter() - t0
        if self.remote.put_failed_count != failed:
            raise RuntimeError("LMCache counted a failed put")
        return took

    def contains(self, keys: list[CacheEngineKey]) -> float:
        t0 = time.perf_counter()
        hits = self.remote.batched_contains(keys)
        took = time.perf_counter() - t0
        hits = hits[0] if isinstance(hits, tuple) else hits
        if hits != len(keys):
            raise RuntimeError(f"contains found {hits} of {len(keys)} stored chunks")
        return took

    def get(self, keys: list[CacheEngineKey]) -> float:
        t0 = time.perf_counter()
        got = self.remote.batched_get_blocking(keys)
        took = time.perf_counter() - t0
        try:
            for i, (obj, src) in enumerate(zip(got, self.sources)):
                if obj is None:
                    raise RuntimeError(f"chunk {i} of {len(keys)} missing on get")
                if not torch.equal(u8(obj), u8(src)):
                    raise RuntimeError(f"chunk {i} read back different bytes")
        finally:
            for obj in got:
                if obj is not None:
                    obj.ref_count_down()
        return took

    def cold(self) -> dict[str, float]:
        keys = self.keys(0)
        r = {"setup_s": self.connect_s, "stack_setup_s": self.setup_s,
             "put_s": self.put(keys), "contains_s": self.contains(keys),
             "get_s": self.get(keys)}
        self._remove(keys)
        return r

    def _after_round(self, keys: list[CacheEngineKey]) -> None:
        self._remove(keys)
        if self.room is not None:
            self.room.wait()

    def warm(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"put_s": [], "contains_s": [], "get_s": []}
        for r in range(self.a.warmup + self.a.rounds):
            keys = self.keys(r + 1)
            times = {"put_s": self.put(keys), "contains_s": self.contains(keys),
                     "get_s": self.get(keys)}
            self._after_round(keys)
            if r >= self.a.warmup:
                for k, v in times.items():
                    out[k].append(v)
        if self.room is not None:
            out["room_wait_s"] = self.room.waited_s
        return out

    def close(self) -> None:
        if self.room is not None:
            self.room.close()
        for obj in self.sources:
            obj.ref_count_down()
        hung = False
        for backend in reversed(self.backends.values()):
            # LMCache 0.5.6's RedisConnector.close never returns: on the event loop it
            # blocks on a future (its pq_executor.shutdown) that needs that same loop
            closer = threading.Thread(target=backend.close, daemon=True)
            closer.start()
            closer.join(10)
            if closer.is_alive():
                hung = True
                print(f"{backend} did not close in 10 s (left to the process exit)",
                      file=sys.stderr, flush=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        if not hung:
            self._thread.join(10)


def main() -> None:
    ap = worker_parser(VARIANTS, batch=4)
    ap.add_argument("--redis-url", default="")
    ap.add_argument("--pool-gb", type=float, default=2.0)
    worker_main(Worker, ap.parse_args())


if __name__ == "__main__":
    main()
