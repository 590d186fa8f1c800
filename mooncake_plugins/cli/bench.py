"""``mooncake-transfer-bench``: the original transfer_engine_bench, on our engine.

Target: ``--mode target`` allocates ``--buffer_size`` bytes, prints ``READY <port>`` then
``segment <name>``
and serves until SIGTERM/SIGINT. Initiator: ``--mode initiator --segment_id <segment>``
runs ``--threads`` threads, each submitting batches of ``--batch_size`` blocks of
``--block_size`` bytes for ``--duration`` seconds, then prints throughput and the
latency percentiles of one batch.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

from ..config import EngineConfig
from ..errors import MooncakeError
from ..transfer import OpCode, TransferEngine, TransferRequest
from ._args import ArgumentParser

UNITS = {"GB": 1e9, "GiB": 2 ** 30, "Gb": 1e9 / 8, "MB": 1e6, "MiB": 2 ** 20, "Mb": 1e6 / 8,
         "KB": 1e3, "KiB": 2 ** 10, "Kb": 1e3 / 8}


def _size(text: str) -> int:
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:].lower(), 1)
    return int(text[:-1] if mult > 1 else text) * mult


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="mooncake-transfer-bench", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["target", "initiator"], required=True)
    ap.add_argument("--metadata_server", default="P2PHANDSHAKE",
                    help="P2PHANDSHAKE, http://h:p/metadata, etcd://h:p or redis://h:p")
    ap.add_argument("--local_server_name", default="127.0.0.1",
                    help="host[:port] this process serves on")
    ap.add_argument("--segment_id", help="initiator: the target's segment name")
    ap.add_argument("--protocol", default="tcp", choices=["tcp", "shm"],
                    help="tcp forces sockets; shm uses shared memory for same-host peers")
    ap.add_argument("--operation", default="read", choices=["read", "write"])
    ap.add_argument("--block_size", type=_size, default=65536, help="bytes per request (4M ok)")
    ap.add_argument("--batch_size", type=int, default=128)
    ap.add_argument("--buffer_size", type=_size, default=1 << 30)
    ap.add_argument("--threads", type=int, default=4, help="submitting threads")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds")
    ap.add_argument("--report_unit", default="GB", choices=sorted(UNITS))
    ap.add_argument("--report_precision", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    return ap


def _config(protocol: str) -> EngineConfig:
    cfg = EngineConfig.from_env()
    cfg.transports = ["tcp"] if protocol == "tcp" else ["shm", "tcp"]
    return cfg


def run_target(args: argparse.Namespace) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with TransferEngine(args.local_server_name, args.metadata_server,
                        config=_config(args.protocol)) as engine:
        engine.allocate(args.buffer_size)
        print(f"READY {engine.rpc_port}", flush=True)
        print(f"segment {engine.segment_name}", flush=True)
        stop.wait()
        stats = engine.stats
    print(f"target served {stats['bytes_out']} bytes read, {stats['bytes_in']} bytes written",
          flush=True)
    return 0


def run_initiator(args: argparse.Namespace) -> dict:
    """Run the load and return the measured figures (also printed by ``main``)."""
    if not args.segment_id:
        raise SystemExit("--segment_id is required in initiator mode")
    per_batch = args.block_size * args.batch_size
    if per_batch * args.threads > args.buffer_size:
        raise SystemExit(f"--buffer_size {args.buffer_size} is smaller than threads x batch_size"
                         f" x block_size = {per_batch * args.threads}")
    op = OpCode.READ if args.operation == "read" else OpCode.WRITE
    with TransferEngine(args.local_server_name, args.metadata_server,
                        config=_config(args.protocol)) as engine:
        local = engine.allocate(args.buffer_size)
        remote = engine.open_segment(args.segment_id).descriptor.regions[0]
        if remote.nbytes < per_batch * args.threads:
            raise SystemExit(f"target buffer ({remote.nbytes} bytes) is too small")
        latencies: list[float] = []
        moved = [0]
        lock = threading.Lock()
        deadline = time.monotonic() + args.duration

        def worker(t: int) -> None:
            base = t * per_batch
            reqs = [TransferRequest(op, local.address + base + i * args.block_size,
                                    remote.address + base + i * args.block_size, args.block_size)
                    for i in range(args.batch_size)]
            mine: list[float] = []
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                engine.submit(args.segment_id, reqs).wait(120)
                mine.append(time.perf_counter() - t0)
            with lock:
                latencies.extend(mine)
                moved[0] += len(mine) * per_batch

        start = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(args.threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        elapsed = time.perf_counter() - start
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e6 if latencies else 0.0

    return {"operation": args.operation, "protocol": args.protocol, "block_size": args.block_size,
            "batch_size": args.batch_size, "threads": args.threads, "seconds": elapsed,
            "bytes": moved[0], "throughput": moved[0] / elapsed / UNITS[args.report_unit],
            "unit": args.report_unit + "/s", "batches": len(latencies),
            "batch_latency_us": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.mode == "target":
            return run_target(args)
        r = run_initiator(args)
    except MooncakeError as exc:  # a bad address, an unreachable target or metadata server
        print(f"mooncake-transfer-bench: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(r))
    else:
        p = args.report_precision
        lat = r["batch_latency_us"]
        print(f"{r['operation']} over {r['protocol']}: {r['throughput']:.{p}f} {r['unit']} "
              f"({r['bytes']} bytes in {r['seconds']:.{p}f} s, {r['batches']} batches of "
              f"{r['batch_size']} x {r['block_size']} B, {r['threads']} threads); batch latency "
              f"p50 {lat['p50']:.0f} us, p90 {lat['p90']:.0f} us, p99 {lat['p99']:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
