#!/usr/bin/env python3
"""Transfer Engine throughput, two processes on loopback, against ceilings and the original.

Rows, all measured in this one run with the same block size, batch size and threads:
  memcpy         numpy copyto of 64 MiB in one thread (the ceiling of any same-host copy)
  raw tcp        one Python-socket connection, sendall/recv_into of blocks (tcp ceiling)
  ours tcp/shm   mooncake-transfer-bench target + initiator processes
  original tcp   mooncake-transfer-engine-non-cuda==0.3.13.post1 in its own venv
                 (benchmarks/.venv-orig, created on first use; needs Debian libibverbs1)
  api tcp 16x4M  ours through the original's API (mooncake.engine), MC_TRANSPORTS=tcp:
                 batch_transfer_sync_write of 16 blocks of 4 MiB, one thread, against
                 the raw tcp row of the same run. --only api-tcp runs just these two and
                 a raw tcp row whose blocks rotate through 64 MiB as the API row's do
                 (the raw row reuses one 4 MiB buffer, which stays in cache)
Prints a table and writes JSON to benchmarks/results/transfer_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ORIG_VENV = HERE / ".venv-orig"
ORIG_WHEEL = "mooncake-transfer-engine-non-cuda==0.3.13.post1"


def write_results(path: str, params: dict, rows: list, raw: dict | None = None) -> None:
    """The run's table rows (and raw figures) as JSON, with when and where it ran."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
           "cpus": os.cpu_count(), "params": params, "rows": rows}
    if raw is not None:
        doc["raw"] = raw
    out.write_text(json.dumps(doc, indent=2))
    print(f"\nwrote {out}")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def memcpy_gbps(duration_s: float) -> float:
    src = np.random.randint(0, 255, 64 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < duration_s:
        np.copyto(dst, src)
        n += src.nbytes
    return n / (time.perf_counter() - t0) / 1e9


RAW_RECEIVER = textwrap.dedent("""
    import socket, sys
    block, span = int(sys.argv[1]), int(sys.argv[2])
    srv = socket.create_server(("127.0.0.1", 0))
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    whole = memoryview(bytearray(span))
    total = 0
    while True:
        off = total % span
        buf = whole[off:off + block]
        got = 0
        while got < block:
            n = conn.recv_into(buf[got:], block - got)
            if n == 0:
                print(total, flush=True)
                sys.exit(0)
            got += n
        total += got
""")


def raw_tcp_gbps(block: int, duration_s: float, span: int = 0) -> float:
    """One connection sending ``block`` after ``block``; with ``span``, the blocks rotate
    through ``span`` bytes on both sides (the memory footprint of a workload's blocks)."""
    span = span or block
    rx = subprocess.Popen([sys.executable, "-c", RAW_RECEIVER, str(block), str(span)],
                          stdout=subprocess.PIPE, text=True)
    try:
        port = int(rx.stdout.readline())
        data = memoryview(bytearray(b"\x5a" * span))
        with socket.create_connection(("127.0.0.1", port)) as s:
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < duration_s:
                off = n % span
                s.sendall(data[off:off + block])
                n += block
            s.shutdown(socket.SHUT_WR)
            received = int(rx.stdout.readline())
            elapsed = time.perf_counter() - t0
        return received / elapsed / 1e9
    finally:
        rx.kill()
        rx.wait()


def start_ready(cmd: list[str], env: dict | None = None) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("READY"):
            return proc, line.split()[1:]
    proc.kill()
    raise RuntimeError(f"{cmd[:3]} did not become ready")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def ours_gbps(protocol: str, op: str, a: argparse.Namespace) -> dict:
    bench = [sys.executable, "-m", "mooncake_plugins.cli.bench"]
    target, (port,) = start_ready(bench + ["--mode", "target", "--protocol", protocol,
                                           "--buffer_size", str(a.buffer)])
    segment = f"127.0.0.1:{port}"
    try:
        out = subprocess.run(bench + ["--mode", "initiator", "--segment_id", segment,
                                      "--protocol", protocol, "--operation", op,
                                      "--block_size", str(a.block), "--batch_size", str(a.batch),
                                      "--threads", str(a.threads), "--duration", str(a.duration),
                                      "--buffer_size", str(a.buffer), "--json"],
                             check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    finally:
        stop(target)


# A target through the original API: the original wheel, or our drop-in (whichever
# `mooncake` the interpreter imports).
API_TARGET = textwrap.dedent("""
    import sys, time
    from mooncake.engine import TransferEngine
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    addr = te.allocate_managed_buffer(int(sys.argv[1]))
    assert addr
    print("READY", te.get_rpc_port(), addr, flush=True)
    while True:
        time.sleep(3600)
""")

ORIG_INITIATOR = textwrap.dedent("""
    import json, sys, threading, time
    from mooncake.engine import TransferEngine
    port, raddr, buf, block, batch, threads, duration, op = sys.argv[1:9]
    raddr, buf, block, batch, threads = int(raddr), int(buf), int(block), int(batch), int(threads)
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    local = te.allocate_managed_buffer(buf)
    seg = "127.0.0.1:" + port
    fn = te.batch_transfer_sync_read if op == "read" else te.batch_transfer_sync_write
    per = block * batch
    moved = [0]
    lock = threading.Lock()
    deadline = time.monotonic() + float(duration)
    def work(t):
        srcs = [local + t * per + i * block for i in range(batch)]
        dsts = [raddr + t * per + i * block for i in range(batch)]
        n = 0
        while time.monotonic() < deadline:
            assert fn(seg, srcs, dsts, [block] * batch) == 0
            n += per
        with lock:
            moved[0] += n
    t0 = time.perf_counter()
    ths = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    [x.start() for x in ths]
    [x.join() for x in ths]
    print(json.dumps({"bytes": moved[0], "seconds": time.perf_counter() - t0}))
""")


API_INITIATOR = textwrap.dedent("""
    import json, sys, time
    from mooncake.engine import TransferEngine
    port, raddr, block, count, duration = sys.argv[1:6]
    raddr, block, count = int(raddr), int(block), int(count)
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    local = te.allocate_managed_buffer(block * count)
    seg = "127.0.0.1:" + port
    srcs = [local + i * block for i in range(count)]
    dsts = [raddr + i * block for i in range(count)]
    assert te.batch_transfer_sync_write(seg, srcs, dsts, [block] * count) == 0  # warm-up
    n, t0 = 0, time.perf_counter()
    deadline = t0 + float(duration)
    while time.perf_counter() < deadline:
        assert te.batch_transfer_sync_write(seg, srcs, dsts, [block] * count) == 0
        n += block * count
    print(json.dumps({"bytes": n, "seconds": time.perf_counter() - t0}))
""")


def api_tcp_gbps(a: argparse.Namespace, block: int = 4 << 20, count: int = 16) -> float:
    """Ours through mooncake.engine's API, tcp only: ``count`` writes of ``block`` per call."""
    env = {**os.environ, "MC_TRANSPORTS": "tcp"}
    target, (port, raddr) = start_ready([sys.executable, "-c", API_TARGET, str(block * count)], env)
    try:
        out = subprocess.run([sys.executable, "-c", API_INITIATOR, port, raddr, str(block),
                              str(count), str(a.duration)], check=True, capture_output=True,
                             text=True, env=env, timeout=a.duration * 10 + 60).stdout
        r = json.loads(out.strip().splitlines()[-1])
        return r["bytes"] / r["seconds"] / 1e9
    finally:
        stop(target)


def ensure_original() -> Path | None:
    py = ORIG_VENV / "bin" / "python"
    check = [str(py), "-c", "import mooncake.engine, numpy"]
    if py.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return py
    log(f"installing {ORIG_WHEEL} into {ORIG_VENV} ...")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(ORIG_VENV)], check=True)
        # numpy for the workloads, the CPU torch (the wheel on disk) for the tensor rows;
        # not on top of this environment, whose editable install has a `mooncake` too
        subprocess.run([str(py), "-m", "pip", "install", "-q", ORIG_WHEEL, "numpy",
                        "torch==2.13.0"], check=True, capture_output=True)
        subprocess.run(check, check=True, capture_output=True)
    except subprocess.CalledProcessError as exc:
        log(f"original wheel unavailable: {exc.stderr.decode()[-500:] if exc.stderr else exc}")
        return None
    return py


def original_gbps(py: Path, op: str, a: argparse.Namespace) -> float:
    env = {**os.environ, "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}
    target, (port, raddr) = start_ready([str(py), "-c", API_TARGET, str(a.buffer)], env)
    try:
        out = subprocess.run([str(py), "-c", ORIG_INITIATOR, port, raddr, str(a.buffer),
                              str(a.block), str(a.batch), str(a.threads), str(a.duration), op],
                             check=True, capture_output=True, text=True, env=env,
                             timeout=a.duration * 10 + 60).stdout
        r = json.loads(out.strip().splitlines()[-1])
        return r["bytes"] / r["seconds"] / 1e9
    finally:
        stop(target)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block", type=int, default=4 << 20, help="bytes per request (default 4 MiB)")
    ap.add_argument("--batch", type=int, default=4, help="requests per batch")
    ap.add_argument("--threads", type=int, default=2, help="submitting threads")
    ap.add_argument("--buffer", type=int, default=256 << 20, help="registered bytes per side")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per row")
    ap.add_argument("--skip-original", action="store_true")
    ap.add_argument("--only", choices=["api-tcp"],
                    help="api-tcp: just the raw tcp and api tcp 16x4M rows")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/transfer_bench.json, "
                    "or transfer_bench_api_tcp.json with --only api-tcp)")
    a = ap.parse_args()
    if a.out is None:
        a.out = str(HERE / "results" / ("transfer_bench.json" if a.only is None
                                        else "transfer_bench_api_tcp.json"))

    rows: list[dict] = []
    full = a.only is None
    if full:
        log("memcpy ...")
        rows.append({"name": "memcpy (numpy, 1 thread)", "op": "copy",
                     "gbps": memcpy_gbps(a.duration)})
    log("raw tcp ...")
    raw_row = {"name": "raw tcp (python socket, 1 conn)", "op": "write",
               "gbps": raw_tcp_gbps(a.block, a.duration)}
    rows.append(raw_row)
    if not full:
        log("raw tcp, 64 MiB footprint ...")
        rows.append({"name": "raw tcp (blocks rotate in 64 MiB)", "op": "write",
                     "gbps": raw_tcp_gbps(4 << 20, a.duration, span=64 << 20)})
    log("ours api tcp 16x4M write ...")
    rows.append({"name": "ours api tcp 16x4MiB (1 thread)", "op": "write",
                 "gbps": api_tcp_gbps(a)})
    for proto in ("tcp", "shm") if full else ():
        for op in ("read", "write"):
            log(f"ours {proto} {op} ...")
            r = ours_gbps(proto, op, a)
            rows.append({"name": f"ours {proto}", "op": op, "gbps": r["bytes"] / r["seconds"] / 1e9,
                         "batch_latency_us": r["batch_latency_us"]})
    py = None if a.skip_original or not full else ensure_original()
    orig: dict[str, float] = {}
    if py:
        for op in ("read", "write"):
            log(f"original tcp {op} ...")
            orig[op] = original_gbps(py, op, a)
            rows.append({"name": "original 0.3.13.post1 tcp", "op": op, "gbps": orig[op]})
    memcpy = rows[0]["gbps"] if full else 0.0
    raw = raw_row["gbps"]
    for r in rows:
        if r["name"].startswith("ours"):
            ceiling = raw if "tcp" in r["name"] else memcpy
            r["vs_ceiling"] = r["gbps"] / ceiling
            if r["op"] in orig:
                r["vs_original_tcp"] = r["gbps"] / orig[r["op"]]

    print(f"\nblock {a.block} B, batch {a.batch}, threads {a.threads}, {a.duration:g} s per row, "
          f"{os.cpu_count()} cores\n")
    print(f"| {'path':34} | {'op':5} | {'GB/s':>6} | {'x ceiling':>9} | {'x original tcp':>14} |")
    print(f"|{'-' * 36}|{'-' * 7}|{'-' * 8}|{'-' * 11}|{'-' * 16}|")
    for r in rows:
        vc = f"{r['vs_ceiling']:.2f}" if "vs_ceiling" in r else ""
        vo = f"{r['vs_original_tcp']:.2f}" if "vs_original_tcp" in r else ""
        print(f"| {r['name']:34} | {r['op']:5} | {r['gbps']:6.2f} | {vc:>9} | {vo:>14} |")
    write_results(a.out, vars(a), rows)


if __name__ == "__main__":
    main()
