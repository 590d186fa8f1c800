#!/usr/bin/env python3
"""GPU memory through the engine, against the copy ceilings of the same GPU, one run.

Rows (two processes on one host, 64 MiB buffers, WRITE in 4 MiB requests, 16 per batch):
  cudaMemcpy D2D      cuda.copy device to device in this process (the cuda_ipc ceiling)
  cuda_ipc gpu->gpu   into the peer's device memory through its IPC handle
  tcp host->host      the host-memory baseline of the staged tcp rows
  tcp gpu->host       local device memory staged through pinned memory
  tcp gpu->gpu        staged on both sides (the peer's tcp server stages too)
  shm host->host      the host-memory baseline of the staged shm row
  shm gpu->host       local device memory staged, then process_vm
Goals (issue 23): cuda_ipc >= 0.8x D2D; staged tcp >= 0.8x host tcp.
Needs a CUDA GPU (else one sentence and exit 2). Prints a table and writes
benchmarks/results/gpu_bench.json (or --out).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests" / "gpu"))

from mooncake_plugins.config import EngineConfig  # noqa: E402
from mooncake_plugins.transfer import TransferEngine, cuda  # noqa: E402
from mooncake_plugins.transfer.batch import OpCode, TransferRequest  # noqa: E402
from peers import TARGET, Target  # noqa: E402  (the GPU tests' target process)
from transfer_bench import log, write_results  # noqa: E402

MIB = 1 << 20
TOTAL = 64 * MIB
REQUEST = 4 * MIB


ROWS = [  # label, transports, local kind, remote kind
    ("cuda_ipc gpu->gpu", ["cuda_ipc"], "gpu", "gpu"),
    ("tcp host->host", ["tcp"], "host", "host"),
    ("tcp gpu->host", ["tcp"], "gpu", "host"),
    ("tcp gpu->gpu", ["tcp"], "gpu", "gpu"),
    ("shm host->host", ["shm"], "host", "host"),
    ("shm gpu->host", ["shm"], "gpu", "host"),
]


def d2d_gbps(duration_s: float) -> float:
    with cuda.DeviceBuffer(TOTAL) as a, cuda.DeviceBuffer(TOTAL) as b:
        cuda.copy(b.address, a.address, TOTAL)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < duration_s:
            cuda.copy(b.address, a.address, TOTAL)
            n += 1
        return n * TOTAL / (time.perf_counter() - t0) / 1e9


def row(transports: list[str], local_kind: str, remote_kind: str, duration_s: float) -> float:
    with Target(TARGET % (transports, TOTAL, remote_kind == "gpu")) as target, \
            TransferEngine(config=EngineConfig(transports=transports)) as eng:
        dev = cuda.DeviceBuffer(TOTAL) if local_kind == "gpu" else None
        host = bytearray(TOTAL)
        local = eng.register_address(dev.address, TOTAL).address if dev \
            else eng.register(host).address
        reqs = [TransferRequest(OpCode.WRITE, local + off, target.address + off, REQUEST)
                for off in range(0, TOTAL, REQUEST)]
        eng.submit(target.segment, reqs).wait(120)  # warm-up: connections, handles, buffers
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < duration_s:
            eng.submit(target.segment, reqs).wait(120)
            n += 1
        gbps = n * TOTAL / (time.perf_counter() - t0) / 1e9
        eng.unregister(local)
        if dev:
            dev.close()
    return gbps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=2.0, help="seconds per row")
    ap.add_argument("--out", default=str(HERE / "results" / "gpu_bench.json"))
    a = ap.parse_args()
    if not cuda.available():
        print(f"gpu_bench needs a CUDA GPU: {cuda.why_unavailable()}", file=sys.stderr)
        return 2
    rows = [{"row": "cudaMemcpy D2D", "gbps": d2d_gbps(a.duration)}]
    for label, transports, local_kind, remote_kind in ROWS:
        log(label)
        rows.append({"row": label, "gbps": row(transports, local_kind, remote_kind, a.duration)})
    by = {r["row"]: r["gbps"] for r in rows}
    ratios = {"cuda_ipc / D2D": by["cuda_ipc gpu->gpu"] / by["cudaMemcpy D2D"],
              "staged tcp gpu->host / tcp host->host": by["tcp gpu->host"] / by["tcp host->host"],
              "staged tcp gpu->gpu / tcp host->host": by["tcp gpu->gpu"] / by["tcp host->host"],
              "staged shm gpu->host / shm host->host": by["shm gpu->host"] / by["shm host->host"]}
    print(f"\n{'row':22} {'GB/s':>8}")
    for r in rows:
        print(f"{r['row']:22} {r['gbps']:8.2f}")
    for k, v in ratios.items():
        print(f"{k:40} {v:.2f}x")
    write_results(a.out, {"total": TOTAL, "request": REQUEST, "duration_s": a.duration,
                          "device": cuda.device_name(0)}, rows, {"ratios": ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main())
