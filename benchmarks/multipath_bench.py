#!/usr/bin/env python3
"""tcp multi-path: one transfer over 1, 2 and 4 rate-limited links, and its recovery from
a link going down. Needs root, iproute2 and tc (network namespaces, veth pairs, tbf).

Two network namespaces joined by N veth pairs, each limited to --rate-mbit on the
initiator's side with tc tbf; a target engine in one publishes an address per link
(MC_TCP_PATHS), an initiator in the other WRITEs --size from one buffer into the
target's, and the target's bytes are hashed and compared. Rows: GB/s per link count
against the sum of the links' rates (the ceiling), and the bytes each link carried.
Recovery: two links, link 1 taken down once --size/16 has arrived; the time lost against
the rest going over the one link left from that moment on, against the slice timeout
(MC_TRANSFER_TIMEOUT) that detects the dead link.
Goals (issue 26): aggregate >= 0.9x the links' sum; recovery within one slice timeout.
Prints a table and writes benchmarks/results/multipath_bench.json (or --out).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "transfer"))
sys.path.insert(0, str(HERE))

from helpers import LineChild  # noqa: E402
from peer import pattern  # noqa: E402  (what the peers fill their buffers with)
from links import Links, usable  # noqa: E402
from transfer_bench import log, write_results  # noqa: E402

PEER = str(REPO / "tests" / "transfer" / "peer.py")
SLICE_TIMEOUT_S = 2.0


def peer(links: Links, side: str, hostname: str, nbytes: int, seed: int,
         env: dict[str, str]) -> LineChild:
    cmd = links.prefix(side) + [sys.executable, PEER, "--hostname", hostname, "--nbytes",
                                str(nbytes), "--transports", "tcp", "--seed", str(seed)]
    return LineChild(cmd, env={**os.environ, "PYTHONPATH": str(REPO), **env}, timeout_s=60)


def pair(links: Links, nbytes: int) -> tuple[LineChild, LineChild]:
    target = peer(links, "b", links.addr_b[0], nbytes, 5,
                  {"MC_TCP_PATHS": ",".join(links.addr_b[1:])})
    workers = str(max(4, 2 * len(links.addr_b)))
    initiator = peer(links, "a", links.addr_a[0], nbytes, 6,
                     {"MC_WORKERS": workers, "MC_TCP_CONNECTIONS": workers,
                      "MC_TRANSFER_TIMEOUT": str(SLICE_TIMEOUT_S), "MC_CONNECT_TIMEOUT": "1",
                      "MC_PATH_PAUSE": "1", "MC_RETRIES": "3"})
    return target, initiator


def check(target: LineChild, nbytes: int) -> None:
    want = hashlib.sha256(pattern(6, nbytes)).hexdigest()
    if target.ask("sha") != want:
        raise SystemExit("multipath_bench: the target's bytes differ from what was written")


def aggregate(n_links: int, nbytes: int, rate_mbit: int) -> dict:
    log(f"{n_links} link(s) of {rate_mbit} Mbit/s, {nbytes >> 20} MiB")
    with Links(n_links, rate_mbit) as links:
        target, initiator = pair(links, nbytes)
        try:
            t0 = time.monotonic()
            reply = initiator.ask(f"write {target.info['segment']} {target.info['address']} "
                                  f"{nbytes}", timeout_s=600)
            seconds = time.monotonic() - t0
            if reply != "ok":
                raise SystemExit(f"multipath_bench: the write failed: {reply}")
            check(target, nbytes)
            stats = json.loads(initiator.ask("paths"))
            port = target.info["port"]
            per_link = [stats.get(f"{a}:{port}", {}).get("bytes", nbytes if n_links == 1 else 0)
                        for a in links.addr_b]
        finally:
            initiator.close()
            target.close()
    ceiling = n_links * rate_mbit * 1e6 / 8
    return {"row": f"{n_links} link(s)", "links": n_links, "gbps": nbytes / seconds / 1e9,
            "ceiling_gbps": ceiling / 1e9, "x_ceiling": nbytes / seconds / ceiling,
            "seconds": seconds, "bytes_per_link": per_link}


def recovery(nbytes: int, rate_mbit: int) -> dict:
    log(f"recovery: 2 links, link 1 down after {nbytes // 16 >> 20} MiB")
    with Links(2, rate_mbit) as links:
        target, initiator = pair(links, nbytes)
        try:
            initiator.proc.stdin.write(f"write {target.info['segment']} "
                                       f"{target.info['address']} {nbytes}\n".encode())
            initiator.proc.stdin.flush()
            timeline: list[tuple[float, int]] = []
            down_at = None
            t0 = time.monotonic()
            while True:
                got = json.loads(target.ask("stats"))["bytes_in"]
                now = time.monotonic() - t0
                timeline.append((now, got))
                if down_at is None and got >= nbytes // 16:
                    links.down(1)
                    down_at = now
                if got >= nbytes or now > 600:
                    break
                time.sleep(0.05)
            reply = initiator.readline(timeout_s=120)
            if reply != "ok":
                raise SystemExit(f"multipath_bench: the write failed after the link went "
                                 f"down: {reply}")
            check(target, nbytes)
        finally:
            initiator.close()
            target.close()
    one_link = rate_mbit * 1e6 / 8
    at_down = next(b for t, b in timeline if t >= down_at)
    total = timeline[-1][0]
    # at best the rest goes at one link's rate from the moment the link went down
    ideal = down_at + (nbytes - at_down) / one_link
    return {"row": "recovery (2 links, 1 down)", "lost_s": max(0.0, total - ideal),
            "slice_timeout_s": SLICE_TIMEOUT_S, "total_s": total, "ideal_s": ideal,
            "down_at_s": down_at}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1024", help="MiB per transfer (default 1024)")
    ap.add_argument("--rate-mbit", type=int, default=500, help="each link's rate")
    ap.add_argument("--links", default="1,2,4")
    ap.add_argument("--out", default=str(HERE / "results" / "multipath_bench.json"))
    a = ap.parse_args()
    why = usable()
    if why:
        print(f"multipath_bench {why}", file=sys.stderr)
        return 2
    nbytes = int(a.size) << 20
    rows = [aggregate(int(n), nbytes, a.rate_mbit) for n in a.links.split(",")]
    rec = recovery(nbytes, a.rate_mbit)
    print(f"\n{'links':>6} {'GB/s':>7} {'ceiling':>8} {'x ceiling':>9}  bytes per link (MiB)")
    for r in rows:
        print(f"{r['links']:>6} {r['gbps']:7.3f} {r['ceiling_gbps']:8.3f} {r['x_ceiling']:9.2f}  "
              + " ".join(f"{b >> 20}" for b in r["bytes_per_link"]))
    print(f"\nrecovery: link 1 down at {rec['down_at_s']:.1f} s; the transfer took "
          f"{rec['total_s']:.1f} s against {rec['ideal_s']:.1f} s had the rest gone over one "
          f"link from that moment: {rec['lost_s']:.2f} s lost (slice timeout "
          f"{rec['slice_timeout_s']:.0f} s)")
    write_results(a.out, {"size_mib": int(a.size), "rate_mbit": a.rate_mbit,
                          "slice_timeout_s": SLICE_TIMEOUT_S}, rows + [rec])
    return 0


if __name__ == "__main__":
    sys.exit(main())
