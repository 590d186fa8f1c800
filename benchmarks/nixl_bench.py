#!/usr/bin/env python3
"""NIXL transfers on our backend (MOONCAKE) against NIXL's own UCX backend.

Two processes on this host, DRAM, through NIXL's Python API exactly as its users drive it
(prep_xfer_dlist once, make_prepped_xfer once, then transfer + check_xfer_state, reposted):
  memcpy              numpy copyto of 64 MiB in one thread (the ceiling of a same-host copy)
  <backend> W/R 64x4M  64 descriptors of 4 MiB per request, WRITE then READ
  <backend> W/R 1024x4K  1024 descriptors of 4 KiB per request
(remote blocks in a scattered order, so NIXL cannot merge descriptors into one)
  <backend> first      a fresh agent's first 4 KiB READ (add_remote_agent included)
Our backend uses the engine's default transports (shm between processes of one host).
Run it with a Python that has NIXL (.ci/run makes .venv-nixl: numpy, nixl and nixl-cu12
1.5.1 without dependencies). Prints a table and writes benchmarks/results/nixl_bench.json.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer_bench import log, memcpy_gbps, write_results  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20
WORKLOADS = [(64, 4 * MIB), (1024, 4 * KIB)]


def make_agent(name: str, backend: str):
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    agent.create_backend(backend, {"ip_addr": "127.0.0.1"} if backend == "MOONCAKE" else {})
    return agent


def target(conn, backend: str, nbytes: int) -> None:
    """The passive side: registers a buffer, hands out its metadata, waits to be told."""
    agent = make_agent(f"target-{backend}", backend)
    buf = np.ones(nbytes, np.uint8)
    agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    conn.recv()  # until the initiator is done


def wait(agent, handle) -> None:
    while (state := agent.check_xfer_state(handle)) == "PROC":
        pass
    if state != "DONE":
        raise RuntimeError(f"transfer ended {state}")


def measure(agent, peer_name: str, local_addr: int, remote_addr: int, op: str, count: int,
            size: int, duration_s: float) -> dict:
    mine = agent.prep_xfer_dlist("", [(local_addr + i * size, size, 0) for i in range(count)],
                                 "DRAM")
    theirs = agent.prep_xfer_dlist(peer_name, [(remote_addr + i * size, size, 0)
                                               for i in range(count)], "DRAM")
    # remote blocks in a scattered order, as a KV cache's blocks are: NIXL merges runs of
    # descriptors contiguous on both sides into one, which would hide the per-descriptor cost
    ids = list(range(count))
    scattered = [(i * 7) % count for i in ids] if count % 7 else ids[::-1]
    handle = agent.make_prepped_xfer(op, mine, ids, theirs, scattered)
    agent.transfer(handle)  # warm-up
    wait(agent, handle)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < duration_s:
        agent.transfer(handle)
        wait(agent, handle)
        n += 1
    elapsed = time.perf_counter() - t0
    agent.release_xfer_handle(handle)
    agent.release_dlist_handle(mine)
    agent.release_dlist_handle(theirs)
    return {"gbps": n * count * size / elapsed / 1e9, "descs_per_s": n * count / elapsed,
            "requests": n}


def first_contact(backend: str, metadata: bytes, peer_name: str, remote_addr: int) -> float:
    """A fresh agent: add the peer, then one 4 KiB READ; seconds until it is done."""
    agent = make_agent(f"fresh-{backend}", backend)
    local = np.zeros(4 * KIB, np.uint8)
    agent.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
    t0 = time.perf_counter()
    agent.add_remote_agent(metadata)
    handle = agent.initialize_xfer(
        "READ", agent.get_xfer_descs([(local.ctypes.data, 4 * KIB, 0)], "DRAM"),
        agent.get_xfer_descs([(remote_addr, 4 * KIB, 0)], "DRAM"), peer_name)
    agent.transfer(handle)
    wait(agent, handle)
    elapsed = time.perf_counter() - t0
    agent.release_xfer_handle(handle)
    return elapsed


def run_backend(backend: str, duration_s: float) -> list[dict]:
    nbytes = max(c * s for c, s in WORKLOADS)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(theirs, backend, nbytes), daemon=True)
    proc.start()
    try:
        metadata, remote_addr = ours.recv()
        peer_name = f"target-{backend}"
        agent = make_agent(f"initiator-{backend}", backend)
        local = np.zeros(nbytes, np.uint8)
        agent.register_memory([(local.ctypes.data, nbytes, 0, "")], "DRAM")
        agent.add_remote_agent(metadata)
        rows = []
        for count, size in WORKLOADS:
            for op in ("WRITE", "READ"):
                log(f"{backend} {op} {count}x{size}")
                r = measure(agent, peer_name, local.ctypes.data, remote_addr, op, count, size,
                            duration_s)
                label = f"{count}x{size // MIB}M" if size >= MIB else f"{count}x{size // KIB}K"
                rows.append({"backend": backend, "op": op, "workload": label, **r})
        first = first_contact(backend, metadata, peer_name, remote_addr)
        rows.append({"backend": backend, "op": "first READ", "workload": "1x4K",
                     "seconds": first})
        return rows
    finally:
        ours.send("done")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per row")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" /
                                         "nixl_bench.json"))
    args = ap.parse_args()
    try:
        from mooncake_plugins.nixl.plugin_dir import plugin_dir
        os.environ["NIXL_PLUGIN_DIR"] = str(plugin_dir())
        import nixl  # noqa: F401
    except (ImportError, RuntimeError) as exc:
        print(f"nixl_bench needs NIXL: {exc} (run it with .venv-nixl/bin/python)",
              file=sys.stderr)
        return 2
    ceiling = memcpy_gbps(args.duration)
    rows = [{"backend": "memcpy", "op": "copy", "workload": "64M", "gbps": ceiling}]
    for backend in ("UCX", "MOONCAKE"):
        rows += run_backend(backend, args.duration)
    ucx = {(r["op"], r["workload"]): r for r in rows if r["backend"] == "UCX"}
    print(f"\n{'backend':10} {'op':10} {'workload':9} {'GB/s':>7} {'desc/s':>10} "
          f"{'first':>8} {'ours/UCX':>8}")
    for r in rows:
        base = ucx.get((r["op"], r["workload"]))
        if "seconds" in r:
            ratio = base["seconds"] / r["seconds"] if r["backend"] == "MOONCAKE" else None
            r["vs_ucx"] = ratio
            print(f"{r['backend']:10} {r['op']:10} {r['workload']:9} {'':>7} {'':>10} "
                  f"{r['seconds'] * 1e3:6.1f}ms {f'{ratio:.2f}x' if ratio else '':>8}")
            continue
        ratio = r["gbps"] / base["gbps"] if base and r["backend"] == "MOONCAKE" else None
        r["vs_ucx"] = ratio
        desc = f"{r['descs_per_s']:,.0f}" if "descs_per_s" in r else ""
        print(f"{r['backend']:10} {r['op']:10} {r['workload']:9} {r['gbps']:7.2f} {desc:>10} "
              f"{'':>8} {f'{ratio:.2f}x' if ratio else '':>8}")
    write_results(args.out, {"duration_s": args.duration, "workloads": WORKLOADS,
                             "nixl": "1.5.1"}, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
