#!/usr/bin/env python3
"""SGLang's HiCache storage (L3) on CPU: 64-token KV pages of a 7B-shaped model, one run.

Run with the SGLang venv's python (``.ci/run`` makes ``.venv-sglang``)::

    .venv-sglang/bin/python benchmarks/sglang_bench.py [--quick]

A worker process (benchmarks/sglang_worker.py) builds a real ``MHATokenToKVPoolHost`` on
CPU (Llama-2-7B's shape: 32 layers, 32 KV heads x 128, fp16, ``page_first``, 64-token
pages of 32 MiB; ``--layers`` scales it) and the backend through SGLang's own
``StorageBackendFactory``, and moves ``--batch`` pages per call as SGLang's
``HiCacheController`` does for that backend: set, ``batch_exists``, get, every page read
compared byte for byte. Variants, each on fresh servers:

  ours                 our MooncakePluginsHiCache through ``dynamic`` (``interface_v1``:
                       batch_set_v1/batch_get_v1 on the pool's pages), our master and a
                       mooncake_client lending the memory (examples/sglang_hicache.sh)
  file                 SGLang's HiCacheFile in a fresh directory under the system temp
                       dir (a disk file system: writes land in the page cache), through
                       the controller's generic page path
  in-tree on ours      SGLang's in-tree ``mooncake`` backend (zero-copy v1) on our
                       drop-in ``mooncake`` package
  in-tree on original  the same on mooncake-transfer-engine-non-cuda==0.3.13.post1: its
                       files first on the worker's PYTHONPATH, its own mooncake_master and
                       mooncake_client from benchmarks/.venv-orig

Cold phase: ``--cold-rounds`` rounds, each with fresh servers (or directory), a fresh
worker process and fresh keys: the backend's construction and attachment to the pool,
then the first set, exists and get of one batch, each timed once; the table shows the
median round. Warm phase: one worker, ``--warmup`` untimed rounds, then ``--rounds``
timed rounds over fresh keys (cleared after each round, untimed). Prints tables; writes
benchmarks/results/sglang_bench.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from kv_stores import (cold_then_warm, driver_parser, load_average, mooncake_store,  # noqa: E402
                       parse_driver, run_worker, tables, worker_command)
from transfer_bench import ensure_original, log, write_results  # noqa: E402
from vllm_bench import ensure_original_modules  # noqa: E402

WORKER = str(HERE / "sglang_worker.py")
VARIANTS = ("ours", "file", "in-tree on ours", "in-tree on original")
PAGE = 64


def page_bytes(layers: int) -> int:
    return 2 * layers * PAGE * 32 * 128 * 2


@contextlib.contextmanager
def servers(variant: str, a: argparse.Namespace, orig_py: Path | None
            ) -> Iterator[tuple[list[str], dict[str, str]]]:
    """Fresh storage for ``variant``: the worker's arguments and environment."""
    if variant == "file":
        d = tempfile.mkdtemp(prefix="sglang-bench-hicache-")
        try:
            yield ["--variant", "file", "--file-dir", d], {}
        finally:
            shutil.rmtree(d, ignore_errors=True)
        return
    system = "original" if variant.endswith("original") else "ours"
    with mooncake_store(system, a.segment, orig_py) as s:
        args = ["--variant", "ours" if variant == "ours" else "intree", "--master", s.address,
                "--metadata", s.metadata]
        yield args + (["--room-master", s.address] if system == "ours" else []), s.env


def bench(variant: str, a: argparse.Namespace, orig_py: Path | None) -> dict:
    def worker(phase: str, seed: int) -> dict:
        with servers(variant, a, orig_py) as (args, env):
            cmd = worker_command(WORKER, args, phase, seed, a)
            return run_worker(cmd, env, f"{variant} {phase} worker")

    return cold_then_warm(variant, a, worker, "set", "exists")


def main() -> None:
    ap = driver_parser(__doc__, str(HERE / "results" / "sglang_bench.json"),
                       "32: Llama-2-7B, 32 MiB pages", 16,
                       "pages per call (16: 1024 tokens)", 8,
                       "8 layers (8 MiB pages), 8 pages per call, 4 rounds, 1 cold round",
                       VARIANTS)
    a, chosen = parse_driver(ap, VARIANTS)
    size = page_bytes(a.layers)
    # room for 8 batches: ours reuses a removed page's space once its 5 s read lease ended
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
    print(f"\n{os.cpu_count()} cores; Llama-2-7B-shaped pages: {a.layers} layers x K,V x "
          f"{PAGE} tokens x 32 heads x 128 x fp16 = {size / (1 << 20):.0f} MiB; SGLang "
          f"0.5.23 host pool (page_first) on CPU, store segment "
          f"{a.segment / (1 << 30):.1f} GiB\nload at start: {a.load_start}\n"
          f"load at end:   {a.load_end}")
    rows = tables(results, "set", "exists", "pages", size, a.batch, a.rounds, a.cold_rounds,
                  "backend setup")
    write_results(a.out, vars(a), rows, results)


if __name__ == "__main__":
    main()
