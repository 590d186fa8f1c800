"""What benchmarks/lmcache_bench.py and sglang_bench.py share: the servers their KV goes
to (a Mooncake store of ours or of the original wheel, a redis-server), each started
fresh and stopped on exit, and how a worker process is run and its figures summed up."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compat_bench import start_master  # noqa: E402
from store_bench import free_port, spawn, stop_all, wait_port  # noqa: E402
from transfer_bench import log  # noqa: E402
from vllm_bench import ORIG_MODULES  # noqa: E402

QUIET = {"GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR", "LMCACHE_LOG_LEVEL": "WARNING"}


@dataclass
class Store:
    address: str
    metadata: str
    env: dict[str, str] = field(default_factory=dict)
    """What a framework process needs in its environment to use this store's package."""


@contextlib.contextmanager
def mooncake_store(system: str, segment: int, orig_py: Path | None = None
                   ) -> Iterator[Store]:
    """A master and a ``mooncake_client`` lending ``segment`` bytes (the documented
    setup: the KV outlives the framework processes), of ``system`` ``ours`` or
    ``original`` (benchmarks/.venv-orig's, whose Python files the framework process then
    finds first on its PYTHONPATH)."""
    py = sys.executable if system == "ours" else str(orig_py)
    procs: list[subprocess.Popen] = []
    try:
        master, address, metadata = start_master(system, py)
        procs.append(master)
        cmd = [str(Path(py).parent / "mooncake_client"), f"--master_server_address={address}",
               f"--metadata_server={metadata}", "--host=127.0.0.1",
               f"--global_segment_size={segment}"]
        env = {**os.environ, **QUIET}
        if system == "ours":
            holder = spawn(cmd + ["--port=0", "--log_level=WARNING"], stdout=subprocess.PIPE,
                           env=env, text=True)
            procs.append(holder)
            if not holder.stdout.readline().startswith("READY"):
                raise RuntimeError("our mooncake_client did not start")
            yield Store(address, metadata)
        else:
            port = free_port()
            procs.append(spawn(cmd + [f"--port={port}"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=env))
            wait_port(port)  # it listens once its segment is mounted
            yield Store(address, metadata, {"PYTHONPATH": str(ORIG_MODULES)})
    finally:
        stop_all(procs)


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A local redis-server on a free port, without persistence; its URL."""
    port = free_port()
    proc = spawn(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                  "--appendonly", "no", "--loglevel", "warning"],
                 stdout=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    try:
        wait_port(port)
        yield f"redis://127.0.0.1:{port}"
    finally:
        stop_all([proc])


def run_worker(cmd: list[str], env: dict[str, str], what: str, timeout_s: float = 600) -> dict:
    """Run a worker outside the repository (so that the only ``mooncake`` it finds is the
    installed one, or the original's files on its PYTHONPATH); its last JSON line."""
    p = subprocess.run(cmd, cwd=tempfile.gettempdir(), capture_output=True, text=True,
                       timeout=timeout_s, env={**os.environ, **QUIET, **env})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        raise RuntimeError(f"{what} failed (rc {p.returncode}):\n{p.stdout[-1500:]}\n"
                           f"{p.stderr[-3000:]}")
    return json.loads(lines[-1])


def per_call(samples: list[float], items_per_call: int) -> dict:
    """Items/s over all calls, and per-call latency percentiles (nearest rank: with
    fewer than 100 calls, p99 is the slowest call)."""
    ordered = sorted(samples)

    def pct(p: float) -> float:
        return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]

    return {"per_s": items_per_call * len(samples) / sum(samples), "p50_s": pct(50),
            "p99_s": pct(99), "calls": len(samples)}


def load_average() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def summarize(cold_rounds: list[dict], warm: dict, write: str, probe: str,
              per_call_items: int) -> dict:
    """One variant's figures: the median cold round, and the warm calls' rates."""
    keys = ("setup_s", f"{write}_s", f"{probe}_s", "get_s")
    out = {"cold": {k: statistics.median(r[k] for r in cold_rounds) for k in keys},
           "cold_rounds": cold_rounds, "warm_samples": warm,
           write: per_call(warm[f"{write}_s"], per_call_items),
           "get": per_call(warm["get_s"], per_call_items),
           f"{probe}_p50_s": statistics.median(warm[f"{probe}_s"])}
    if "mooncake_store" in warm:
        out["mooncake_store"] = warm["mooncake_store"]
    return out


def tables(results: dict[str, dict], write: str, probe: str, unit: str, item_bytes: int,
           per_call_items: int, rounds: int, cold_rounds: int, setup: str) -> list[dict]:
    """Print the warm and cold tables (Markdown); their rows. Ratios are ours over the
    row's (rates) or the row's over ours (latencies): > 1 means ours leads."""
    ours = results.get("ours")

    def vs(name: str, get: Callable[[dict], float], rate: bool) -> float | None:
        if ours is None or name == "ours":
            return None
        return get(ours) / get(results[name]) if rate else get(results[name]) / get(ours)

    def pair(a: float | None, b: float | None) -> str:
        return "" if a is None else f"{a:.2f}x / {b:.2f}x"

    rows = []
    mib = item_bytes / (1 << 20)
    print(f"\nwarm: {rounds} calls each, "
          f"{per_call_items} {unit} of {mib:.0f} MiB per call; latency per call; "
          "'ours vs' > 1 means ours leads")
    print(f"\n| connector | {write} {unit}/s | {write} GB/s | {write} p50 (ms) | "
          f"{write} p99 (ms) | get {unit}/s | get GB/s | get p50 (ms) | get p99 (ms) | "
          f"{probe} p50 (ms) | ours vs ({write} / get) |")
    print("|---|" + "---:|" * 9 + "---|")
    for name, r in results.items():
        w, g = r[write], r["get"]
        gbs = lambda m: m["per_s"] * item_bytes / 1e9  # noqa: E731
        vw = vs(name, lambda x: x[write]["per_s"], True)
        vg = vs(name, lambda x: x["get"]["per_s"], True)
        rows.append({"phase": "warm", "connector": name, write: w, "get": g,
                     f"{write}_GBps": gbs(w), "get_GBps": gbs(g),
                     f"{probe}_p50_s": r[f"{probe}_p50_s"], f"ours_vs_{write}": vw,
                     "ours_vs_get": vg})
        print(f"| {name} | {w['per_s']:.1f} | {gbs(w):.2f} | {w['p50_s'] * 1e3:.0f} | "
              f"{w['p99_s'] * 1e3:.0f} | {g['per_s']:.1f} | {gbs(g):.2f} | "
              f"{g['p50_s'] * 1e3:.0f} | {g['p99_s'] * 1e3:.0f} | "
              f"{r[f'{probe}_p50_s'] * 1e3:.2f} | {pair(vw, vg)} |")
    print(f"\ncold: fresh servers, fresh process, fresh keys; median of {cold_rounds} "
          f"rounds; first calls over {per_call_items} {unit}")
    print(f"\n| connector | {setup} (ms) | first {write} (ms) | first {probe} (ms) | "
          f"first get (ms) | ours vs ({write} / get) |")
    print("|---|---:|---:|---:|---:|---|")
    for name, r in results.items():
        c = r["cold"]
        vw = vs(name, lambda x: x["cold"][f"{write}_s"], False)
        vg = vs(name, lambda x: x["cold"]["get_s"], False)
        rows.append({"phase": "cold", "connector": name, **c, f"ours_vs_{write}": vw,
                     "ours_vs_get": vg})
        print(f"| {name} | {c['setup_s'] * 1e3:.0f} | {c[f'{write}_s'] * 1e3:.0f} | "
              f"{c[f'{probe}_s'] * 1e3:.2f} | {c['get_s'] * 1e3:.0f} | {pair(vw, vg)} |")
    return rows


class RoomWaiter:
    """Waits (untimed, between rounds) until our master has room for the next batch.

    Our master reuses the space of a force-removed object only once its read lease (5 s)
    has ended; the original frees it at once. Rounds faster than that would fill the
    segment with space waiting for leases, and puts would fail for want of room."""

    def __init__(self, master: str, need_bytes: int) -> None:
        from mooncake_plugins.store.client import StoreClient
        self.client = StoreClient(master, global_segment_size=0)
        self.need = need_bytes
        self.waited_s = 0.0

    def wait(self, timeout_s: float = 30) -> None:
        t0 = time.perf_counter()
        while True:
            s = self.client.stats()
            if s["capacity_bytes"] - s["used_bytes"] >= self.need:
                break
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"no room for {self.need} bytes after {timeout_s} s: {s}")
            time.sleep(0.05)
        self.waited_s += time.perf_counter() - t0

    def close(self) -> None:
        self.client.close()


def cold_then_warm(variant: str, a: Any, worker: Callable[[str, int], dict], write: str,
                   probe: str) -> dict:
    """``a.cold_rounds`` cold worker runs (fresh servers and keys each), then one warm run,
    summed up by :func:`summarize`."""
    cold = []
    for i in range(a.cold_rounds):
        log(f"{variant}: cold round {i + 1}/{a.cold_rounds}")
        cold.append(worker("cold", 100 + i))
    log(f"{variant}: warm ({a.warmup} + {a.rounds} rounds)")
    return summarize(cold, worker("warm", 1), write, probe, a.batch)


def chosen_variants(ap: Any, a: Any, variants: tuple[str, ...]) -> list[str]:
    """``a.variants`` as a list, after checking it and the sizes (argparse errors)."""
    chosen = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = sorted(set(chosen) - set(variants))
    if unknown or min(a.layers, a.batch, a.rounds, a.cold_rounds) < 1 or a.warmup < 0:
        ap.error(f"unknown variants {unknown}" if unknown else "sizes must be >= 1")
    return chosen


def worker_main(make: Callable[[Any], Any], a: Any) -> None:
    """A worker process's body: run ``make(a)``'s cold or warm phase, print its figures as
    one JSON line, and exit without waiting for the frameworks' threads."""
    try:
        w = make(a)
        try:
            out: dict[str, Any] = w.cold() if a.phase == "cold" else w.warm()
        finally:
            w.close()
        if a.variant == "intree":
            import mooncake.store
            out["mooncake_store"] = mooncake.store.__file__  # which package served it
        print(json.dumps(out), flush=True)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)  # the original's threads can hang interpreter shutdown


def driver_parser(doc: str | None, out: str, layers_help: str, batch: int, batch_help: str,
                  quick_batch: int, quick_help: str, variants: tuple[str, ...]
                  ) -> argparse.ArgumentParser:
    """The options both benchmark drivers take (sizes, rounds, variants, --quick, --out)."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32, help=layers_help)
    ap.add_argument("--batch", type=int, default=batch, help=batch_help)
    ap.add_argument("--rounds", type=int, default=16, help="timed warm rounds")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cold-rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(variants),
                    help=f"comma-separated, of: {', '.join(variants)}")
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--out", default=out)
    ap.set_defaults(quick_batch=quick_batch)
    return ap


def parse_driver(ap: argparse.ArgumentParser, variants: tuple[str, ...]
                 ) -> tuple[argparse.Namespace, list[str]]:
    """Parsed options (``--quick`` applied) and the chosen variants, checked."""
    a = ap.parse_args()
    if a.quick:
        a.layers, a.batch, a.rounds, a.warmup, a.cold_rounds = 8, a.quick_batch, 4, 1, 1
    return a, chosen_variants(ap, a, variants)


def worker_command(worker: str, args: list[str], phase: str, seed: int,
                   a: argparse.Namespace) -> list[str]:
    """A worker process's command line: ``args`` (servers) plus the driver's sizes."""
    return [sys.executable, worker, *args, "--phase", phase, "--layers", str(a.layers),
            "--batch", str(a.batch), "--rounds", str(a.rounds), "--warmup", str(a.warmup),
            "--seed", str(seed)]


def worker_parser(variants: tuple[str, ...], batch: int) -> argparse.ArgumentParser:
    """The options every worker takes (what :func:`worker_command` passes)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=variants, required=True)
    ap.add_argument("--phase", choices=["cold", "warm"], required=True)
    ap.add_argument("--master", default="")
    ap.add_argument("--metadata", default="P2PHANDSHAKE")
    ap.add_argument("--room-master", default="",
                    help="our master: wait between rounds until it has room for a batch")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    return ap
