#!/usr/bin/env python3
"""What pricing a request against the store costs the router and the master: the
Conductor's store view following the master's KV events against the same view asking the
master per request (``--store-poll``), on one real master process.

The master (``mooncake-master --enable_kv_events``) holds --blocks block keys of one model
(our connector's layout, TP --tp), written through its RPC by this script (no bytes move:
pricing reads metadata only). The view then prices --requests prompts of --prompt-blocks
blocks each, half of them held in full, the rest not at all, in each mode:

  events   the view lists the master's keys once, then follows its events
  poll     one ``peek`` RPC per request (the view before events)

For each: the latency of one pricing (p50, p99) and the master's CPU time per request
(utime + stime from /proc over the phase), and in events mode the time from the view's
start until its feed is synced (the listing: a cold start). Then, with the view synced,
--churn more blocks are written and removed at once: how long until the view says so
(event latency). Prints a table and writes JSON to benchmarks/results/store_view_bench.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from store_bench import free_port, spawn, wait_port  # noqa: E402
from transfer_bench import log, write_results  # noqa: E402

from mooncake_plugins.conductor.router.store_view import StoreView  # noqa: E402
from mooncake_plugins.conductor.router.vllm_hashes import VllmBlockHashes  # noqa: E402
from mooncake_plugins.store import block_keys  # noqa: E402
from mooncake_plugins.store.rpc import RpcClient  # noqa: E402

BLOCK = 16
BASE = "vllm/bench-model/cpu-FullAttentionSpec-float16-bs16-kvh8-hd128-L32-pp1"
PUT_CONFIG = {"replica_num": 1, "preferred_segments": [], "with_soft_pin": False,
              "upsert": False}
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` so far (seconds)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(blocks * BLOCK + 1)]


def keys_of(hashes: VllmBlockHashes, tokens: list[int], tp: int) -> list[str]:
    return block_keys.all_ranks(BASE, [h.hex() for h in hashes.of(tokens)], tp)


def put(rpc: RpcClient, keys: list[str]) -> None:
    for at in range(0, len(keys), 512):
        chunk = keys[at:at + 512]
        rpc.call("put_start", client_id="bench", keys=chunk, sizes=[64] * len(chunk),
                 config=PUT_CONFIG)
        rpc.call("put_end", client_id="bench", keys=chunk)


def price(view: StoreView, prompts: list[list[int]]) -> list[float]:
    """Seconds of each pricing."""
    out = []
    for tokens in prompts:
        t0 = time.perf_counter()
        view.prefix_blocks(tokens)
        out.append(time.perf_counter() - t0)
    return out


def run_mode(mode: str, address: str, pid: int, prompts: list[list[int]],
             want: list[int]) -> dict:
    hashes = VllmBlockHashes(BLOCK)
    t0 = time.perf_counter()
    view = StoreView(address, hashes, events=mode == "events")
    try:
        view.prefix_blocks(prompts[0])           # first contact (starts the feed)
        synced_s = None
        if mode == "events":
            while view.feed is None or not view.feed.synced:
                if time.perf_counter() - t0 > 120:
                    raise RuntimeError("the view's event feed did not sync in 120 s")
                time.sleep(0.005)
            synced_s = time.perf_counter() - t0
        got = [view.prefix_blocks(p) for p in prompts[:50]]
        if got != want[:50]:
            raise RuntimeError(f"{mode}: the view priced {got[:8]}..., expected {want[:8]}...")
        before = cpu_s(pid)
        times = price(view, prompts)
        master_cpu = cpu_s(pid) - before
        return {"mode": mode, "requests": len(prompts),
                "p50_us": statistics.median(times) * 1e6,
                "p99_us": sorted(times)[int(0.99 * (len(times) - 1))] * 1e6,
                "master_cpu_us_per_request": master_cpu / len(prompts) * 1e6,
                "cold_sync_s": synced_s}
    finally:
        view.close()


def churn_latency(address: str, rpc: RpcClient, n: int, tp: int) -> dict:
    """With the view synced: write ``n`` new prompts' blocks, then remove them; seconds
    until the view prices each change."""
    hashes = VllmBlockHashes(BLOCK)
    view = StoreView(address, hashes)
    try:
        view.prefix_blocks(prompt(0, 1))
        while view.feed is None or not view.feed.synced:
            time.sleep(0.005)
        stored, removed = [], []
        for i in range(n):
            tokens = prompt(10_000_000 + i, 4)
            keys = keys_of(hashes, tokens, tp)
            t0 = time.perf_counter()
            put(rpc, keys)
            while view.prefix_blocks(tokens) != 4:
                time.sleep(0.0005)
            stored.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            rpc.call("remove", keys=keys, force=True)
            while view.prefix_blocks(tokens) != 0:
                time.sleep(0.0005)
            removed.append(time.perf_counter() - t0)
        return {"stored_p50_ms": statistics.median(stored) * 1e3,
                "removed_p50_ms": statistics.median(removed) * 1e3,
                "stored_max_ms": max(stored) * 1e3, "removed_max_ms": max(removed) * 1e3}
    finally:
        view.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=200_000, help="block keys the master holds")
    ap.add_argument("--tp", type=int, default=2, help="ranks per block (keys per block)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--prompt-blocks", type=int, default=16)
    ap.add_argument("--churn", type=int, default=50)
    ap.add_argument("--out", default=str(HERE / "results" / "store_view_bench.json"))
    a = ap.parse_args()
    port, mport, eport = free_port(), free_port(), free_port()
    master = spawn([sys.executable, "-m", "mooncake_plugins.cli.master", "--rpc_port",
                    str(port), "--metrics_port", str(mport), "--enable_kv_events",
                    f"--kv_events_bind_endpoint=tcp://127.0.0.1:{eport}",
                    "--enable_metric_reporting=false"],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        address = f"127.0.0.1:{port}"
        rpc = RpcClient("127.0.0.1", port, 30.0)
        rpc.call("register_client", client_id="bench", host_id="bench")
        rpc.call("mount_segment", client_id="bench", segment="seg", base=1 << 44,
                 nbytes=1 << 32)
        hashes = VllmBlockHashes(BLOCK)
        held_prompts = a.blocks // (a.tp * a.prompt_blocks)
        log(f"writing {held_prompts * a.prompt_blocks * a.tp} block keys "
            f"({held_prompts} prompts x {a.prompt_blocks} blocks x TP {a.tp})")
        t0 = time.perf_counter()
        for i in range(held_prompts):
            put(rpc, keys_of(hashes, prompt(i, a.prompt_blocks), a.tp))
        log(f"written in {time.perf_counter() - t0:.1f} s")
        rng = random.Random(7)
        prompts, want = [], []
        for r in range(a.requests):
            held = r % 2 == 0
            seed = rng.randrange(held_prompts) if held else 1_000_000 + r
            prompts.append(prompt(seed, a.prompt_blocks))
            want.append(a.prompt_blocks if held else 0)
        rows = [run_mode(mode, address, master.pid, prompts, want)
                for mode in ("poll", "events")]
        churn = churn_latency(address, rpc, a.churn, a.tp)
        rpc.close()
    finally:
        master.terminate()
        master.wait(30)
    print(f"\nstore view pricing, {a.blocks} block keys held (TP {a.tp}), "
          f"{a.requests} requests of {a.prompt_blocks} blocks, one master process")
    print(f"{'mode':8} {'p50 us':>9} {'p99 us':>9} {'master CPU us/req':>18} {'cold sync s':>12}")
    for r in rows:
        sync = "-" if r["cold_sync_s"] is None else f"{r['cold_sync_s']:.2f}"
        print(f"{r['mode']:8} {r['p50_us']:9.1f} {r['p99_us']:9.1f} "
              f"{r['master_cpu_us_per_request']:18.1f} {sync:>12}")
    print(f"event latency over {a.churn} prompts: stored p50 {churn['stored_p50_ms']:.2f} ms "
          f"(max {churn['stored_max_ms']:.2f}), removed p50 {churn['removed_p50_ms']:.2f} ms "
          f"(max {churn['removed_max_ms']:.2f})")
    write_results(a.out, vars(a), rows, {"churn": churn})
    return 0


if __name__ == "__main__":
    sys.exit(main())
