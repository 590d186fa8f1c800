#!/usr/bin/env python3
"""The frameworks' calls through ``mooncake.store``: our drop-in vs the original wheel, one run.

Each system gets its master, a holder process contributing a 1 GiB segment and a client
process running benchmarks/compat_workload.py, the same script for both (the original in
its own venv, benchmarks/.venv-orig). Cold phase: a fresh master, holder and client per
round, fresh keys, no warm-up; each first call timed once, the median of ``--cold-rounds``
rounds reported. Warm phase: timed loops after a warm-up. Prints a table and writes JSON to
benchmarks/results/compat_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from store_bench import free_port, spawn, stop_all, wait_port  # noqa: E402
from transfer_bench import ensure_original, log, write_results  # noqa: E402

WORKLOAD = str(HERE / "compat_workload.py")
COLD = [("put_bytes_4MiB_s", "first put 4 MiB, bytes (ms)"),
        ("get_bytes_4MiB_s", "first get 4 MiB, bytes (ms)"),
        ("put_from_4MiB_s", "first put_from 4 MiB (ms)"),
        ("get_into_4MiB_s", "first get_into 4 MiB (ms)"),
        ("batch_put_multi_s", "first batch_put_from_multi_buffers 64 keys x 32 layers (ms)"),
        ("batch_is_exist_64_s", "first batch_is_exist 64 keys (ms)"),
        ("batch_get_multi_s", "first batch_get_into_multi_buffers 64 keys x 32 layers (ms)"),
        ("put_tensor_64MiB_s", "first put_tensor 64 MiB (ms)"),
        ("get_tensor_64MiB_s", "first get_tensor 64 MiB (ms)")]
WARM = [("put_from_4MiB_GBps", "put_from 4 MiB (GB/s)"),
        ("get_into_4MiB_GBps", "get_into 4 MiB (GB/s)"),
        ("put_bytes_4MiB_GBps", "put 4 MiB, bytes (GB/s)"),
        ("get_bytes_4MiB_GBps", "get 4 MiB, bytes, results held (GB/s)"),
        ("get_into_4KiB_ops", "get_into 4 KiB (ops/s)"),
        ("get_bytes_4KiB_ops", "get 4 KiB, bytes (ops/s)"),
        ("batch_get_into_64x4KiB_objs", "batch_get_into 64 x 4 KiB (objects/s)"),
        ("batch_is_exist_64_objs", "batch_is_exist 64 keys (keys/s)"),
        ("batch_put_multi_GBps", "batch_put_from_multi_buffers 64 x 32 x 16 KiB (GB/s)"),
        ("batch_get_multi_GBps", "batch_get_into_multi_buffers 64 x 32 x 16 KiB (GB/s)"),
        ("put_tensor_64MiB_GBps", "put_tensor 64 MiB (GB/s)"),
        ("get_tensor_64MiB_GBps", "get_tensor 64 MiB (GB/s)")]


def start_master(system: str, py: str) -> tuple[subprocess.Popen, str, str]:
    """(master process, master address, metadata URL)."""
    if system == "ours":
        master = spawn([py, "-m", "mooncake_plugins.cli.master", "--rpc_port", "0",
                        "--metrics_port", "0", "--log_level", "WARNING"],
                       stdout=subprocess.PIPE)
        port = int(master.stdout.readline().split()[1])
        return master, f"127.0.0.1:{port}", "P2PHANDSHAKE"
    rpc, http, metrics = free_port(), free_port(), free_port()
    master = spawn([str(Path(py).parent / "mooncake_master"), f"--rpc_port={rpc}",
                    "--enable_http_metadata_server=true", f"--http_metadata_server_port={http}",
                    f"--metrics_port={metrics}"], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env={**os.environ, "GLOG_minloglevel": "2"})
    wait_port(rpc)
    wait_port(http)
    return master, f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"


def run_round(system: str, py: str, phase: str, a: argparse.Namespace) -> dict:
    # outside the repository, so that the original's python never imports our ./mooncake
    cwd = tempfile.gettempdir()
    env = {**os.environ, "GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}
    master, address, metadata = start_master(system, py)
    procs = [master]
    try:
        base = [py, WORKLOAD, "--master", address, "--metadata", metadata]
        holder = spawn(base + ["--role", "holder", "--segment", str(a.segment)], cwd=cwd,
                       env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL)
        procs.append(holder)
        if not holder.stdout.readline().startswith(b"READY"):
            raise RuntimeError(f"{system} holder did not start")
        out = subprocess.run(base + ["--role", "client", "--phase", phase, "--duration",
                                     str(a.duration)], cwd=cwd, env=env, capture_output=True,
                             text=True, timeout=900)
        if out.returncode != 0:
            raise RuntimeError(f"{system} {phase} client failed: {out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        stop_all(procs)


def bench(system: str, py: str, a: argparse.Namespace) -> dict:
    cold_rounds = []
    for i in range(a.cold_rounds):
        log(f"{system}: cold round {i + 1}/{a.cold_rounds}")
        cold_rounds.append(run_round(system, py, "cold", a))
    cold = {k: statistics.median(r[k] for r in cold_rounds) for k in cold_rounds[0]}
    log(f"{system}: warm")
    return {"cold": cold, "cold_rounds": cold_rounds, "warm": run_round(system, py, "warm", a)}


def table(results: dict[str, dict]) -> list[dict]:
    cols = list(results)
    rows = []
    print("\n| phase | metric | " + " | ".join(cols) + " | ours vs original |")
    print("|---|---|" + "---:|" * (len(cols) + 1))
    for phase, metrics in (("cold", COLD), ("warm", WARM)):
        for key, label in metrics:
            vals = {c: results[c][phase].get(key) for c in cols}
            if all(v is None for v in vals.values()):
                continue
            lead = None
            if vals.get("ours") and vals.get("original"):
                # cold rows are seconds (lower is better), warm rows are rates
                lead = (vals["original"] / vals["ours"] if phase == "cold"
                        else vals["ours"] / vals["original"])
            rows.append({"phase": phase, "metric": key, **vals, "x_original": lead})

            def fmt(v: float | None) -> str:
                if v is None:
                    return "n/a"
                if phase == "cold":
                    return f"{v * 1e3:.1f}"
                return f"{v:.2f}" if key.endswith("GBps") else f"{v:,.0f}"
            cells = [fmt(vals[c]) for c in cols] + [f"{lead:.2f}x" if lead else ""]
            print(f"| {phase} | {label} | " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=2.0, help="seconds per warm metric")
    ap.add_argument("--segment", type=int, default=1 << 30, help="holder's segment bytes")
    ap.add_argument("--cold-rounds", type=int, default=3)
    ap.add_argument("--skip-original", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results" / "compat_bench.json"))
    a = ap.parse_args()
    results = {"ours": bench("ours", sys.executable, a)}
    py = None if a.skip_original else ensure_original()
    if py:
        results["original"] = bench("original", str(py), a)
    print(f"\n{os.cpu_count()} cores; master, holder ({a.segment >> 20} MiB segment) and client "
          f"processes; cold: median of {a.cold_rounds} fresh rounds; warm: {a.duration:g} s "
          "per metric; 'ours vs original' > 1 means ours leads")
    rows = table(results)
    write_results(a.out, vars(a), rows, results)


if __name__ == "__main__":
    main()
