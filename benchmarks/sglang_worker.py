#!/usr/bin/env python3
"""One SGLang HiCache storage user of benchmarks/sglang_bench.py: its backend, timed.

Builds a real ``MHATokenToKVPoolHost`` on CPU of a Llama-2-7B shape (``--layers`` of 32
KV heads x 128, fp16, ``page_first``, 64-token pages: 32 MiB a page at 32 layers) and the
``--variant``'s backend through SGLang's own ``StorageBackendFactory``, then moves pages
the way SGLang's ``HiCacheController`` does for that backend: ``batch_set_v1`` /
``batch_get_v1`` straight from and into the pool's pages for the zero-copy backends
(ours through ``dynamic`` with ``interface_v1``, SGLang's in-tree ``mooncake``), and the
generic path for ``file`` (``get_data_page`` + ``batch_set``; ``batch_get`` into dummy
pages + ``set_from_flat_data_page``), with ``batch_exists`` between.

``--phase cold``: backend construction and attachment, then the first set, exists and get
of one batch of fresh keys, each timed once. ``--phase warm``: ``--warmup`` untimed
rounds, then ``--rounds`` timed ones over fresh keys, cleared afterwards (untimed; on our
store the worker then also waits, untimed, until the master has room for the next batch:
kv_stores.RoomWaiter). Every page read is compared byte for byte with the page written.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

# SGLang's pool import pulls torchvision, which the lean CPU venv lacks: the integration
# tests' stand-in (only for that import) is reused here.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integrations"
                       / "sglang"))
import pools  # noqa: E402,F401  (installs the torchvision stand-in)
from sglang.srt.mem_cache.device_pool_info import (KVBufferLayout, KVBuffers,  # noqa: E402
                                                   MHABufferInfo)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kv_stores import RoomWaiter, worker_main, worker_parser  # noqa: E402

PAGE = 64
KV_HEADS, HEAD_DIM = 32, 128  # Llama-2-7B
MODEL = "meta-llama/Llama-2-7b-shaped"
LAYOUT = "page_first"
VARIANTS = ("ours", "file", "intree")


def host_pool(layers: int, pages: int) -> MHATokenToKVPoolHost:
    """A host pool of ``pages`` pages (twice the "device" capacity, as SGLang's default
    ``--hicache-ratio 2``), its "device" tensors on CPU and never touched."""
    device_tokens = pages * PAGE // 2
    k = tuple(torch.empty(device_tokens + PAGE, KV_HEADS, HEAD_DIM, dtype=torch.float16)
              for _ in range(layers))
    v = tuple(torch.empty_like(t) for t in k)
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=PAGE, head_num=KV_HEADS, head_dim=HEAD_DIM,
                         v_head_dim=HEAD_DIM, dtype=torch.float16, device=torch.device("cpu"))
    pool = MHATokenToKVPoolHost(info, 2.0, 0, PAGE, LAYOUT, pin_memory=False, device="cpu",
                                device_capacity_tokens=device_tokens, start_layer=0,
                                end_layer=layers)
    pool._device_buffers = (k, v)  # keep the "device" tensors alive with the pool
    return pool


def extra_config(a: argparse.Namespace) -> dict[str, Any]:
    if a.variant == "ours":
        import mooncake_sglang
        return mooncake_sglang.dynamic_extra_config(
            master_server_address=a.master, metadata_server=a.metadata,
            global_segment_size=0, transfer_timeout_s=120.0)
    if a.variant == "file":
        return {"file_storage_path": a.file_dir}
    # SGLang's in-tree mooncake backend: it lends no memory (the mooncake_client does)
    return {"master_server_address": a.master, "metadata_server": a.metadata,
            "protocol": "tcp", "device_name": "", "global_segment_size": 0,
            "local_hostname": "127.0.0.1"}


class Worker:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        pages = 2 * a.batch
        self.pool = host_pool(a.layers, pages)
        self.src = self.pool.alloc(a.batch * PAGE)
        self.dst = self.pool.alloc(a.batch * PAGE)
        self._fill(self.src)
        cfg = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
            model_name=MODEL, extra_config=extra_config(a))
        name = {"ours": "dynamic", "file": "file", "intree": "mooncake"}[a.variant]
        t0 = time.perf_counter()
        self.backend = StorageBackendFactory.create_backend(name, cfg, self.pool)
        self.backend.register_mem_pool_host(self.pool)
        self.backend.on_host_pools_registered()
        self.setup_s = time.perf_counter() - t0
        self.zero_copy = a.variant != "file"
        self._clear = self._clearer()
        page_bytes = self.pool.get_size_per_token() * PAGE
        self.room = (RoomWaiter(a.room_master, a.batch * page_bytes + (1 << 20))
                     if a.room_master else None)

    def _fill(self, indices: torch.Tensor) -> None:
        """Random bytes (16 MiB tiled) in each page, a distinct head per page."""
        block = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(7))
        for n, start in enumerate(indices[::PAGE].tolist()):
            flat = self.pool.get_data_page(start, flat=True).contiguous()
            raw = flat.view(torch.uint8)
            for off in range(0, raw.numel(), block.numel()):
                m = min(block.numel(), raw.numel() - off)
                raw[off:off + m].copy_(block[:m])
            raw[:64].fill_(n + 1)
            self.pool.set_from_flat_data_page(start, flat)

    def _clearer(self) -> Callable[[], None]:
        """Empties the storage after a round (untimed), past read leases."""
        if self.a.variant == "ours":
            return lambda: self.backend.client.remove_all(force=True)
        if self.a.variant == "intree":
            return lambda: self.backend.store.remove_all(True)
        return self.backend.clear

    def keys(self, round_: int) -> list[str]:
        return [f"{self.a.seed}-{round_}-{i}" for i in range(self.a.batch)]

    def set(self, keys: list[str]) -> float:
        """Store the source pages, as the controller's page_set_func does."""
        t0 = time.perf_counter()
        if self.zero_copy:
            ok = all(self.backend.batch_set_v1(keys, self.src))
        else:
            ok = self.backend.batch_set(keys, [self.pool.get_data_page(s)
                                               for s in self.src[::PAGE].tolist()])
        took = time.perf_counter() - t0
        if not ok:
            raise RuntimeError("batch set failed")
        return took

    def exists(self, keys: list[str]) -> float:
        t0 = time.perf_counter()
        hits = self.backend.batch_exists(keys)
        took = time.perf_counter() - t0
        if hits != len(keys):
            raise RuntimeError(f"batch_exists found {hits} of {len(keys)} stored pages")
        return took

    def get(self, keys: list[str]) -> float:
        """Read the pages into the destination pages, as page_get_func does; compare."""
        starts = self.dst[::PAGE].tolist()
        for s in starts:  # no stale bytes can pass the comparison
            self._page(s).zero_()
        t0 = time.perf_counter()
        if self.zero_copy:
            got = sum(bool(r) for r in self.backend.batch_get_v1(keys, self.dst))
        else:
            pages = self.backend.batch_get(keys, [self.pool.get_dummy_flat_data_page()
                                                  for _ in keys])
            got = 0
            for page, s in zip(pages, starts):
                if page is None:
                    break
                self.pool.set_from_flat_data_page(s, page)
                got += 1
        took = time.perf_counter() - t0
        if got != len(keys):
            raise RuntimeError(f"read {got} of {len(keys)} pages")
        for i, (s, d) in enumerate(zip(self.src[::PAGE].tolist(), starts)):
            if not torch.equal(self._page(s), self._page(d)):
                raise RuntimeError(f"page {i} read back different bytes")
        return took

    def _page(self, start: int) -> torch.Tensor:
        """The page's bytes in the pool, in place (a view)."""
        return self.pool.get_data_page(start, flat=False).view(torch.uint8)

    def cold(self) -> dict[str, float]:
        keys = self.keys(0)
        r = {"setup_s": self.setup_s, "set_s": self.set(keys), "exists_s": self.exists(keys),
             "get_s": self.get(keys)}
        self._clear()
        return r

    def warm(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"set_s": [], "exists_s": [], "get_s": []}
        for r in range(self.a.warmup + self.a.rounds):
            keys = self.keys(r + 1)
            times = {"set_s": self.set(keys), "exists_s": self.exists(keys),
                     "get_s": self.get(keys)}
            self._clear()
            if self.room is not None:
                self.room.wait()
            if r >= self.a.warmup:
                for k, v in times.items():
                    out[k].append(v)
        if self.room is not None:
            out["room_wait_s"] = self.room.waited_s
        return out

    def close(self) -> None:
        if self.room is not None:
            self.room.close()
        if hasattr(self.backend, "close"):  # as SGLang's controller does (file has none)
            self.backend.close()


def main() -> None:
    ap = worker_parser(VARIANTS, batch=16)
    ap.add_argument("--file-dir", default="")
    worker_main(Worker, ap.parse_args())


if __name__ == "__main__":
    main()
