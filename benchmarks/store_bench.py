#!/usr/bin/env python3
"""Mooncake Store throughput: ours vs the original wheel vs Redis, in one run on this machine.

Each system gets a master (Redis: redis-server), a holder process contributing the
memory, and a client process running benchmarks/store_workload.py through the original
``MooncakeDistributedStore`` API (Redis: SET/GET/MGET/EXISTS). Prints a table and writes
JSON to benchmarks/results/store_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from transfer_bench import ensure_original, log, stop, write_results  # noqa: E402

WORKLOAD = str(HERE / "store_workload.py")
METRICS = [("put_4MiB_GBps", "put 4 MiB, put_from (GB/s)"), ("get_4MiB_GBps", "get 4 MiB, get_into (GB/s)"),
           ("put_bytes_4MiB_GBps", "put 4 MiB, bytes (GB/s)"), ("get_bytes_4MiB_GBps", "get 4 MiB, bytes (GB/s)"),
           ("get_bytes_4MiB_fresh_GBps", "get 4 MiB, bytes, 32 objects once, results held (GB/s)"),
           ("get_4KiB_ops", "get 4 KiB, get_into (ops/s)"), ("get_bytes_4KiB_ops", "get 4 KiB, bytes (ops/s)"),
           ("put_bytes_4KiB_ops", "put 4 KiB, bytes, fresh keys (ops/s; Redis: SET)"),
           ("batch_get_4KiBx64_objs", "batch get 64 x 4 KiB (objects/s)"), ("exist_ops", "is_exist (ops/s)")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def spawn(cmd: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(cmd, start_new_session=True, **kw)


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.stdin:
            try:
                p.stdin.close()
            except OSError:
                pass
        stop(p)


def run_system(py: str, impl: str, master: str, metadata: str, a: argparse.Namespace,
               extra: list[str]) -> dict:
    base = [py, WORKLOAD, "--impl", impl, "--master", master, "--metadata", metadata, *extra]
    procs = []
    try:
        if impl != "redis":
            holder = spawn(base + ["--role", "holder", "--segment", str(a.segment)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            procs.append(holder)
            if not holder.stdout.readline().startswith(b"READY"):
                raise RuntimeError(f"{impl} holder did not start")
        out = subprocess.run(base + ["--role", "client", "--duration", str(a.duration)],
                             capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"{impl} client failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        stop_all(procs)


def bench_ours(a: argparse.Namespace) -> dict:
    master = spawn([sys.executable, "-m", "mooncake_plugins.cli.master", "--rpc_port", "0",
                    "--metrics_port", "0", "--log_level", "WARNING"], stdout=subprocess.PIPE)
    try:
        port = int(master.stdout.readline().split()[1])
        return run_system(sys.executable, "ours", f"127.0.0.1:{port}", "P2PHANDSHAKE", a, [])
    finally:
        stop(master)


def bench_original(py: Path, a: argparse.Namespace) -> dict:
    rpc, http = free_port(), free_port()
    binary = str(py.parent / "mooncake_master")
    env = {**os.environ, "GLOG_minloglevel": "2"}
    master = spawn([binary, f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                    f"--http_metadata_server_port={http}"], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env=env)
    try:
        wait_port(rpc)
        wait_port(http)
        return run_system(str(py), "original", f"127.0.0.1:{rpc}",
                          f"http://127.0.0.1:{http}/metadata", a, [])
    finally:
        stop(master)


def bench_redis(a: argparse.Namespace) -> dict | None:
    binary = shutil.which("redis-server")
    if binary is None:
        log("redis-server not installed: skipping the Redis column")
        return None
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        server = spawn([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                        "--appendonly", "no", "--dir", d], stdout=subprocess.DEVNULL)
        try:
            wait_port(port)
            return run_system(sys.executable, "redis", "", "", a, ["--redis-port", str(port)])
        finally:
            stop(server)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per timed metric")
    ap.add_argument("--segment", type=int, default=512 << 20, help="holder's segment bytes")
    ap.add_argument("--skip-original", action="store_true")
    ap.add_argument("--skip-redis", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results" / "store_bench.json"))
    a = ap.parse_args()
    results: dict[str, dict | None] = {}
    log("ours ...")
    results["ours"] = bench_ours(a)
    py = None if a.skip_original else ensure_original()
    if py:
        log("original ...")
        results["original"] = bench_original(py, a)
    if not a.skip_redis:
        log("redis ...")
        results["redis"] = bench_redis(a)
    cols = [c for c in ("ours", "original", "redis") if results.get(c)]
    # a first-hour machine pays more for memory it never used (issue 22): say which this is
    uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    print(f"\n{os.cpu_count()} cores, {a.duration:g} s per metric, master + holder + client "
          f"processes, machine up {uptime_s / 60:.0f} min\n")
    head = "| metric | " + " | ".join(cols) + " | x original | x redis |"
    print(head)
    print("|" + "---|" * (len(cols) + 3))
    rows = []
    for key, label in METRICS:
        vals = {c: results[c][key] for c in cols}
        xo = vals["ours"] / vals["original"] if "original" in vals else None
        xr = vals["ours"] / vals["redis"] if "redis" in vals else None
        rows.append({"metric": key, **vals, "x_original": xo, "x_redis": xr})
        fmt = "{:.2f}" if key.endswith("GBps") else "{:,.0f}"
        cells = [fmt.format(vals[c]) for c in cols]
        cells += [f"{x:.2f}" if x is not None else "" for x in (xo, xr)]
        print(f"| {label} | " + " | ".join(cells) + " |")
    write_results(a.out, {**vars(a), "uptime_s": uptime_s}, rows, results)


if __name__ == "__main__":
    main()
