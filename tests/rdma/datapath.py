"""The rdma transport on real hardware: bytes equal and bandwidth, one process and two.

Run by tests/rdma/run.sh where libibverbs lists a device with an ACTIVE port (a NIC, or
the Soft-RoCE device run.sh made). Loopback: two engines of this process, transports
``rdma`` only (tcp carries nothing but the handshake), WRITE then READ of ``--nbytes``;
two processes: the same against ``tests/transfer/peer.py``, its buffer's sha256 checked
and its tcp server's byte counters proving no data went over tcp. Writes one JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "transfer"))

from mooncake_plugins.config import EngineConfig  # noqa: E402
from mooncake_plugins.transfer import TransferEngine, verbs  # noqa: E402


def engine() -> TransferEngine:
    return TransferEngine("127.0.0.1", config=EngineConfig(transports=["rdma"]))


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def loopback(nbytes: int) -> dict:
    with engine() as a, engine() as b:
        dst, src, back = a.allocate(nbytes), b.allocate(nbytes), b.allocate(nbytes)
        data = os.urandom(nbytes)
        src.view()[:] = data
        w = timed(b.write, a.segment_name, src.address, dst.address, nbytes)
        r = timed(b.read, a.segment_name, back.address, dst.address, nbytes)
        ok = bytes(dst.view()) == data and bytes(back.view()) == data
        return {"bytes_equal": ok, "write_GBps": nbytes / w / 1e9, "read_GBps": nbytes / r / 1e9,
                "tcp_bytes_served": a.stats, "paths": b.path_stats(),
                "nics": [list(n) for n in a.descriptor().rdma]}


def two_process(nbytes: int) -> dict:
    child = subprocess.Popen([sys.executable, str(ROOT / "tests/transfer/peer.py"), "--transports",
                              "rdma", "--nbytes", str(nbytes)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)

    def ask(line: str) -> str:
        child.stdin.write(line + "\n")
        child.stdin.flush()
        return child.stdout.readline().strip()

    try:
        info = json.loads(child.stdout.readline().split(" ", 1)[1])
        with engine() as b:
            buf = b.allocate(nbytes)
            data = os.urandom(nbytes)
            buf.view()[:] = data
            w = timed(b.write, info["segment"], buf.address, info["address"], nbytes)
            written = ask("sha") == hashlib.sha256(data).hexdigest()
            ask("fill 9")
            r = timed(b.read, info["segment"], buf.address, info["address"], nbytes)
            from peer import pattern
            read = bytes(buf.view()) == pattern(9, nbytes)
            stats = json.loads(ask("stats"))
        ask("quit")
        return {"bytes_equal": written and read, "write_GBps": nbytes / w / 1e9,
                "read_GBps": nbytes / r / 1e9, "peer_tcp_bytes_served": stats}
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--nbytes", type=int, default=256 << 20)
    args = ap.parse_args()
    result: dict = {"available": verbs.available(), "why": verbs.why_unavailable()}
    if verbs.available():
        for name, fn in (("loopback", loopback), ("two_process", two_process)):
            try:
                result[name] = fn(args.nbytes)
            except Exception as exc:  # record and go on: the JSON is the report
                result[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(name, json.dumps(result[name])[:400], flush=True)
    else:
        print("rdma data path not run:", result["why"])
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
