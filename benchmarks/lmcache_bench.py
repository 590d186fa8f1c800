#!/usr/bin/env python3
"""LMCache's remote backend on CPU: 256-token KV chunks of a 7B-shaped model, one run.

Run with the LMCache venv's python (``.ci/run`` makes ``.venv-lmcache``)::

    .venv-lmcache/bin/python benchmarks/lmcache_bench.py [--quick]

Each chunk is one LMCache memory object of Llama-2-7B's shape (32 layers, K and V, 256
tokens, 32 KV heads x 128, bf16: 128 MiB; ``--layers`` scales it). A worker process
(benchmarks/lmcache_worker.py) builds LMCache's own storage stack with
``CreateStorageBackends`` from an ``LMCacheEngineConfig`` and drives its remote backend:
batched put (waited for), batched contains, batched get, each call over ``--batch``
chunks, every chunk read compared byte for byte. Variants, each on fresh servers:

  ours                 our MooncakePluginsConnector (remote_storage_plugins), our master
                       and a mooncake_client lending the memory (the documented setup)
  redis                LMCache's Redis connector (remote_url redis://), a local
                       redis-server started on a free port (no persistence)
  in-tree on ours      LMCache's in-tree mooncakestore connector (remote_storage_plugins,
                       zero-copy mode: save_chunk_meta false) on our drop-in package
  in-tree on original  the same on mooncake-transfer-engine-non-cuda==0.3.13.post1: its
                       files first on the worker's PYTHONPATH, its own mooncake_master and
                       mooncake_client from benchmarks/.venv-orig

Cold phase: ``--cold-rounds`` rounds, each with fresh servers, a fresh worker process and
fresh keys: the connector's setup (LMCache's remote backend connecting; LMCache filling
its CPU pool, the same for all, is left out), then the first put, contains and get of one
batch, each timed once; the table shows the median round. Warm phase: one worker, ``--warmup``
untimed rounds, then ``--rounds`` timed rounds over fresh keys (removed after each round,
untimed). Prints tables; writes benchmarks/results/lmcache_bench.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from kv_stores import (cold_then_warm, driver_parser, load_average, mooncake_store,  # noqa: E402
                       parse_driver, redis_server, run_worker, tables, worker_command)
from transfer_bench import ensure_original, log, write_results  # noqa: E402
from vllm_bench import ensure_original_modules  # noqa: E402

WORKER = str(HERE / "lmcache_worker.py")
VARIANTS = ("ours", "redis", "in-tree on ours", "in-tree on original")


def chunk_bytes(layers: int) -> int:
    return 2 * layers * 256 * 32 * 128 * 2


@contextlib.contextmanager
def servers(variant: str, a: argparse.Namespace, orig_py: Path | None
            ) -> Iterator[tuple[list[str], dict[str, str]]]:
    """Fresh servers for ``variant``: the worker's arguments and environment."""
    if variant == "redis":
        with redis_server() as url:
            yield ["--variant", "redis", "--redis-url", url], {}
        return
    system = "original" if variant.endswith("original") else "ours"
    with mooncake_store(system, a.segment, orig_py) as s:
        args = ["--variant", "ours" if variant == "ours" else "intree", "--master", s.address,
                "--metadata", s.metadata]
        yield args + (["--room-master", s.address] if system == "ours" else []), s.env


def bench(variant: str, a: argparse.Namespace, orig_py: Path | None) -> dict:
    def worker(phase: str, seed: int) -> dict:
        with servers(variant, a, orig_py) as (args, env):
            cmd = worker_command(WORKER, args, phase, seed, a) + ["--pool-gb", f"{a.pool_gb:.2f}"]
            return run_worker(cmd, env, f"{variant} {phase} worker")

    return cold_then_warm(variant, a, worker, "put", "contains")


def main() -> None:
    ap = driver_parser(__doc__, str(HERE / "results" / "lmcache_bench.json"),
                       "32: Llama-2-7B, 128 MiB chunks", 4,
                       "chunks per call (4: 1024 tokens)", 2,
                       "8 layers (32 MiB chunks), 2 chunks per call, 4 rounds, 1 cold round",
                       VARIANTS)
    a, chosen = parse_driver(ap, VARIANTS)
    size = chunk_bytes(a.layers)
    # LMCache's pool holds the batch written and the batch read. The store's segment
    # has room for 8 batches: ours reuses a removed chunk's space only once its 5 s read
    # lease has ended (a put finding no room would fail)
    a.pool_gb = (2 * a.batch + 2) * size / 1e9 + 0.25
    a.segment = max(1 << 30, 8 * a.batch * size)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanups
    a.load_start = load_average()
    log(f"start: {a.load_start}")
    orig_py = None
    if "in-tree on original" in chosen:
        orig_py = ensure_original()
        if orig_py is None or not ensure_original_modules():
            log("original wheel unavailable: skipping 'in-tree on original'")
            chosen.remove("in-tree on original")
    results = {v: bench(v, a, orig_py) for v in chosen}
    a.load_end = load_average()
    print(f"\n{os.cpu_count()} cores; Llama-2-7B-shaped chunks: {a.layers} layers x K,V x 256 "
          f"tokens x 32 heads x 128 x bf16 = {size / (1 << 20):.0f} MiB; LMCache 0.5.6 "
          f"remote backend, CPU pool {a.pool_gb:.2f} GB, store segment "
          f"{a.segment / (1 << 30):.1f} GiB\nload at start: {a.load_start}\n"
          f"load at end:   {a.load_end}")
    rows = tables(results, "put", "contains", "chunks", size, a.batch, a.rounds,
                  a.cold_rounds, "connector setup")
    write_results(a.out, vars(a), rows, results)


if __name__ == "__main__":
    main()
