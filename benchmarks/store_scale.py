#!/usr/bin/env python3
"""Mooncake Store at scale, with our real master, holder and client processes on this machine.

Sections, one table each:
  metadata   the master's RSS per object once it holds --objects objects, and a linear
             projection to 100M; its idle CPU at that size; metadata RPC throughput (exist,
             get_replicas, get, put; one key and --rpc-batch keys per call) from
             --rpc-workers processes x --rpc-threads threads, at --rpc-small objects and at
             --objects
  eviction   one holder filled past the high watermark: put rate and latency while
             evicting, against the same puts below the watermark
  scaling    H holders x C client processes (--scale-configs): aggregate put/get
             throughput for 4 KiB and 4 MiB objects
  failover   kill -9 of a master with --metadata_dir, restarted at once; kill -9 of the
             leader of an HA pair (etcd journal): time until a get and a put succeed again,
             objects recovered per second, and a sample of the objects read back
Holders are ``mooncake_client`` processes (mooncake_plugins.cli.client), clients are
benchmarks/store_scale_worker.py processes, masters ``mooncake-master``. Every process this
script starts is stopped when a section ends, on an error and on Ctrl-C or SIGTERM.
--quick runs every section small. Prints the tables and writes JSON to
benchmarks/results/store_scale.json (--quick: store_scale.quick.json, so a smoke run never
replaces the committed results; --out names another file).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterable

from tqdm import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from store_bench import free_port, spawn, wait_port  # noqa: E402
from transfer_bench import log, write_results  # noqa: E402

from mooncake_plugins.store.rpc import RpcClient  # noqa: E402

WORKER = str(HERE / "store_scale_worker.py")
MASTER = [sys.executable, "-m", "mooncake_plugins.cli.master"]
HOLDER = [sys.executable, "-m", "mooncake_plugins.cli.client"]
KB4, MB4 = 4 << 10, 4 << 20
ALIGN = 64                  # the master's allocation unit (store/allocation.py)
PROJECT_TO = 100_000_000
RPC_OPS = ("exist", "get_replicas", "get", "put")
_RECOVERED = re.compile(r"recovered (\d+) objects on \d+ segments from the metadata journal in ([\d.]+) s")
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


# -- processes ----------------------------------------------------------------------------------

class Child:
    """A process whose stdout lines go to ``events`` as ``(child, line)`` (None at EOF);
    stderr goes to a temporary file (:meth:`stderr_text`)."""

    def __init__(self, cmd: list[str], events: queue.Queue, stdin: bool = False) -> None:
        self.err = tempfile.TemporaryFile()
        self.proc = spawn(cmd, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.events = events
        self.name = " ".join(Path(w).name for w in cmd[1:4])
        self.address = ""   # a master's host:port, once it printed READY
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.events.put((self, line.rstrip("\n")))
        self.events.put((self, None))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stderr_text(self) -> str:
        self.err.seek(0)
        return self.err.read().decode("utf-8", "replace")

    def kill(self) -> None:
        """kill -9, as a crash."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def close_files(self) -> None:
        self._reader.join(5)
        for f in (self.proc.stdin, self.proc.stdout, self.err):
            if f is not None:
                f.close()


def stop(children: list[Child], grace_s: float) -> None:
    """End ``children``: stdin closed (workers then exit), SIGTERM after ``grace_s``,
    SIGKILL 10 s later."""
    for c in children:
        if c.proc.stdin is not None:
            try:
                c.proc.stdin.close()
            except OSError:
                pass
    for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        deadline = time.monotonic() + wait_s
        for c in children:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in children:
            c.signal(signum)
    for c in children:
        c.proc.wait()
        c.close_files()


def collect(children: list[Child], prefix: str, timeout_s: float,
            on_line: Callable[[Child, str], None] | None = None) -> list[str]:
    """Wait until each child printed a line starting with ``prefix``; returns the rest of
    those lines in ``children``'s order. Other lines go to ``on_line``. All children must
    share one events queue. Raises RuntimeError (a child exited, or the time ran out)."""
    got: dict[Child, str] = {}
    deadline = time.monotonic() + timeout_s
    events = children[0].events
    while len(got) < len(children):
        try:
            child, line = events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            waiting = [c.name for c in children if c not in got]
            raise RuntimeError(f"no {prefix} from {waiting} within {timeout_s:g} s") from None
        if line is None:
            raise RuntimeError(f"{child.name} (pid {child.pid}) exited with {child.proc.wait()}; "
                               f"stderr:\n{child.stderr_text()[-3000:]}")
        if line.startswith(prefix + " ") or line == prefix:
            got[child] = line[len(prefix):].strip()
        elif on_line is not None:
            on_line(child, line)
    return [got[c] for c in children]


class Cluster:
    """The processes of one section. ``close()`` (also on leaving the ``with``) stops
    clients, then holders (they unmount), then masters, then etcd."""

    def __init__(self) -> None:
        self._tiers: dict[int, list[Child]] = {}
        self._dirs: list[str] = []

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self, tier: int, cmd: list[str], events: queue.Queue, stdin: bool = False) -> Child:
        child = Child(cmd, events, stdin)
        self._tiers.setdefault(tier, []).append(child)
        return child

    def tempdir(self) -> str:
        self._dirs.append(tempfile.mkdtemp(prefix="mc-scale-"))
        return self._dirs[-1]

    def master(self, *flags: str, port: int = 0, wait: bool = True) -> Child:
        """A ``mooncake-master``; with ``wait``, once it printed READY (``.address`` is set)."""
        m = self._start(2, MASTER + ["--rpc_port", str(port), "--metrics_port", "0", *flags],
                        queue.Queue())
        if wait:
            self.ready(m)
        return m

    @staticmethod
    def ready(m: Child, timeout_s: float = 120) -> None:
        m.address = f"127.0.0.1:{collect([m], 'READY', timeout_s)[0]}"

    def holders(self, master: str, count: int, nbytes: int) -> list[Child]:
        events: queue.Queue = queue.Queue()
        hs = [self._start(1, HOLDER + ["--master_server_address", master, "--metadata_server",
                                       "P2PHANDSHAKE", "--global_segment_size", str(nbytes),
                                       "--port", "0", "--log_level", "WARNING"], events)
              for _ in range(count)]
        collect(hs, "READY", 120)
        return hs

    def workers(self, master: str, job: str, count: int, *flags: str) -> list[Child]:
        events: queue.Queue = queue.Queue()
        ws = [self._start(0, [sys.executable, WORKER, job, "--master", master, "--wid", str(i), *flags],
                          events, stdin=True) for i in range(count)]
        collect(ws, "READY", 120)
        return ws

    def etcd(self) -> str:
        """A single-member etcd in a temporary directory; its ``host:port``."""
        client, peer = free_port(), free_port()
        c, p = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
        self._start(3, [shutil.which("etcd"), "--name", "scale", "--data-dir", self.tempdir(),
                        "--listen-client-urls", c, "--advertise-client-urls", c,
                        "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                        "--initial-cluster", f"scale={p}", "--logger", "zap", "--log-outputs",
                        "stderr"], queue.Queue())
        wait_port(client)
        deadline = time.monotonic() + 30
        while b'"true"' not in _get(f"{c}/health"):
            if time.monotonic() > deadline:
                raise RuntimeError("etcd did not become healthy")
            time.sleep(0.1)
        return f"127.0.0.1:{client}"

    def close(self) -> None:
        for tier in sorted(self._tiers):
            stop(self._tiers[tier], 3.0 if tier == 0 else 0.0)
        self._tiers.clear()
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._dirs.clear()


def _get(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.read()
    except OSError:
        return b""


def stats(address: str) -> dict:
    host, port = address.rsplit(":", 1)
    rpc = RpcClient(host, int(port))
    try:
        return rpc.call("stats")
    finally:
        rpc.close()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def run_step(workers: list[Child], line: str, timeout_s: float,
             on_line: Callable[[Child, str], None] | None = None) -> list[dict]:
    """Send ``line`` to every worker; their results, in order."""
    for w in workers:
        w.send(line)
    return [json.loads(r) for r in collect(workers, "RESULT", timeout_s, on_line)]


def pct(sorted_us: list[int], q: float) -> float:
    """The q-quantile of sorted microseconds, in ms."""
    if not sorted_us:
        return float("nan")
    return sorted_us[min(len(sorted_us) - 1, int(q * len(sorted_us)))] / 1000


def latency(lat_us: Iterable[int]) -> dict:
    s = sorted(lat_us)
    return {"p50_ms": pct(s, 0.5), "p99_ms": pct(s, 0.99), "max_ms": s[-1] / 1000 if s else float("nan")}


def aligned_mean(lo: int, hi: int) -> float:
    return sum(math.ceil(n / ALIGN) * ALIGN for n in range(lo, hi + 1)) / (hi - lo + 1)


def table(head: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


def fill(workers: list[Child], first: int, count: int, desc: str, timeout_s: float) -> dict:
    """Put ``k<first>`` .. over the fill workers, with a progress bar; totals."""
    if count <= 0:
        raise ValueError(f"nothing to fill ({count} objects): raise --objects")
    share = math.ceil(count / len(workers))
    done = [0] * len(workers)
    index = {w: i for i, w in enumerate(workers)}
    with tqdm(total=count, desc=desc, unit="obj", file=sys.stderr, mininterval=1,
              disable=count < 20_000) as bar:
        def progress(w: Child, line: str) -> None:
            if line.startswith("P "):
                n = int(line[2:])
                bar.update(n - done[index[w]])
                done[index[w]] = n

        for i, w in enumerate(workers):
            lo = first + i * share
            w.send(f"go {lo} {max(0, min(share, first + count - lo))}")
        res = [json.loads(r) for r in collect(workers, "RESULT", timeout_s, progress)]
    out = {"objects": sum(r["objects"] for r in res), "bytes": sum(r["bytes"] for r in res),
           "errors": sum(r["errors"] for r in res), "seconds": max(r["seconds"] for r in res)}
    if out["errors"]:
        raise RuntimeError(f"fill: {out['errors']} puts failed, first: "
                           f"{next(r['first_error'] for r in res if r['first_error'])}")
    out["objects_per_s"] = out["objects"] / out["seconds"]
    return out


# -- sections -------------------------------------------------------------------------------------

def holders_for(objects: int, lo: int, hi: int, segment: int, hw: float = 0.95) -> int:
    """Holders of ``segment`` bytes that keep ``objects`` objects below ``hw`` with room to spare."""
    return max(1, math.ceil(objects * aligned_mean(lo, hi) / (0.8 * hw * segment)))


def idle_cpu(pid: int, seconds: float) -> float:
    """Share of one core the process used while nobody called it."""
    c0, t0 = cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_s(pid) - c0) / (time.monotonic() - t0)


def rpc_suite(workers: list[Child], m: Child, objects: int, a: argparse.Namespace) -> list[dict]:
    """Every op of RPC_OPS, one key and ``--rpc-batch`` keys per call, on keys ``k0`` ..
    ``k<objects-1>`` (puts: fresh keys, so the master grows by what they put)."""
    rows = []
    for op in RPC_OPS:
        for batch in (1, a.rpc_batch):
            held = stats(m.address)["objects"]
            c0 = cpu_s(m.pid)
            res = run_step(workers, f"go {op} {batch} {objects}", a.rpc_duration + 120)
            seconds = max(r["seconds"] for r in res)
            calls = sum(r["calls"] for r in res)
            keys = sum(r["keys"] for r in res)
            rows.append({"op": op, "batch": batch, "objects": held, "calls": calls, "keys": keys,
                         "failed": sum(r["failed"] for r in res), "seconds": seconds,
                         "calls_per_s": calls / seconds, "keys_per_s": keys / seconds,
                         "master_cpu": (cpu_s(m.pid) - c0) / seconds,
                         **latency(x for r in res for x in r["lat_us"])})
    return rows


def metadata_section(a: argparse.Namespace) -> dict:
    lo, hi = a.min_value, a.max_value
    size_flags = ["--min_nbytes", str(lo), "--max_nbytes", str(hi)]
    with Cluster() as cl:
        m = cl.master("--log_level", "WARNING")
        nh = holders_for(a.objects, lo, hi, a.holder_segment)
        log(f"metadata: master + {nh} holders x {a.holder_segment >> 20} MiB, {a.objects:,} objects "
            f"of {lo}..{hi} B")
        cl.holders(m.address, nh, a.holder_segment)
        fillers = cl.workers(m.address, "fill", a.fill_workers, *size_flags)
        rpcs = cl.workers(m.address, "rpc", a.rpc_workers, "--threads", str(a.rpc_threads),
                          "--duration", str(a.rpc_duration), *size_flags)
        out: dict = {"holders": nh, "holder_segment": a.holder_segment,
                     "idle_cpu_empty": idle_cpu(m.pid, a.idle_s), "rss_empty": rss_bytes(m.pid)}
        out["rpc"] = []
        filled = 0
        if a.rpc_small:
            out["fill_small"] = fill(fillers, 0, a.rpc_small, "fill", 3600)
            filled = a.rpc_small
            log(f"metadata: RPCs at {filled:,} objects ...")
            out["rpc"] += rpc_suite(rpcs, m, filled, a)
        # the suite's puts stay: fill up to --objects in all
        more = a.objects - stats(m.address)["objects"]
        out["fill"] = fill(fillers, filled, more, "fill", 3600)
        filled += more
        t0 = time.monotonic()
        s = stats(m.address)
        out["stats_rpc_s"] = time.monotonic() - t0   # it counts the objects under the lock
        out["objects"] = s["objects"]
        if s["objects"] != a.objects:
            raise RuntimeError(f"the master holds {s['objects']} objects, expected {a.objects}")
        out["idle_cpu_full"] = idle_cpu(m.pid, a.idle_s)   # also lets the heap settle
        out["rss_full"] = rss_bytes(m.pid)
        out["bytes_per_object"] = (out["rss_full"] - out["rss_empty"]) / s["objects"]
        out["projected_rss_100M"] = out["rss_empty"] + out["bytes_per_object"] * PROJECT_TO
        log(f"metadata: RPCs at {s['objects']:,} objects ...")
        out["rpc"] += rpc_suite(rpcs, m, filled, a)
    return out


def eviction_section(a: argparse.Namespace) -> dict:
    v = a.evict_value
    with Cluster() as cl:
        m = cl.master("--log_level", "WARNING")
        cl.holders(m.address, 1, a.evict_segment)
        w = cl.workers(m.address, "evict", 1, "--min_nbytes", str(v), "--max_nbytes", str(v))
        s = stats(m.address)
        per = math.ceil(v / ALIGN) * ALIGN
        capacity_objects = s["capacity_bytes"] // per
        below = int(0.9 * 0.95 * capacity_objects) - s["objects"]
        during = a.evict_rounds * capacity_objects
        log(f"eviction: {below} puts of {v} B below the watermark, then {during} past it")
        out = {"value": v, "segment": a.evict_segment, "capacity_objects": capacity_objects}
        phases = {}
        for name, count in (("below_watermark", below), ("evicting", during)):
            e0 = stats(m.address)["evicted"]
            r = run_step(w, f"go {count}", 3600)[0]
            evicted = stats(m.address)["evicted"] - e0
            if r["errors"]:
                raise RuntimeError(f"eviction: {r['errors']} puts failed, first: {r['first_error']}")
            phases[name] = {"puts": count, "seconds": r["seconds"], "puts_per_s": count / r["seconds"],
                            "evicted": evicted, **latency(r["lat_us"])}
        if phases["below_watermark"]["evicted"] or not phases["evicting"]["evicted"]:
            raise RuntimeError(f"eviction: unexpected eviction counts {phases}")
        out.update(phases)
    return out


def scaling_section(a: argparse.Namespace) -> dict:
    configs = []
    for spec in a.scale_configs.split(","):
        h, c = (int(x) for x in spec.lower().split("x"))
        with Cluster() as cl:
            m = cl.master("--log_level", "WARNING")
            cl.holders(m.address, h, a.scale_segment)
            ws = cl.workers(m.address, "stream", c, "--duration", str(a.scale_duration),
                            "--ring_nbytes", str(a.scale_ring))
            log(f"scaling: {h} holders x {c} clients ...")
            row = {"holders": h, "clients": c}
            for nbytes in (KB4, MB4):
                for mode in ("put", "get"):
                    c0 = cpu_s(m.pid)
                    res = run_step(ws, f"go {mode} {nbytes}", a.scale_duration + 120)
                    seconds = max(r["seconds"] for r in res)
                    tag = f"{mode}_{'4KiB' if nbytes == KB4 else '4MiB'}"
                    row[tag + "_ops"] = sum(r["ops"] / r["seconds"] for r in res)
                    row[tag + "_GBps"] = sum(r["bytes"] / r["seconds"] for r in res) / 1e9
                    row[tag + "_master_cpu"] = (cpu_s(m.pid) - c0) / seconds
            configs.append(row)
    return {"segment": a.scale_segment, "duration_s": a.scale_duration, "ring": a.scale_ring,
            "configs": configs}


def _recovery(m: Child) -> tuple[int, float]:
    found = _RECOVERED.findall(m.stderr_text())
    if not found:
        raise RuntimeError(f"the master did not report a recovery:\n{m.stderr_text()[-2000:]}")
    return int(found[-1][0]), float(found[-1][1])


def _crash_and_measure(cl: Cluster, victim: Child, restart: Callable[[], Child], master: str,
                       objects: int, a: argparse.Namespace, flags: list[str]) -> dict:
    """kill -9 ``victim``; ``restart()`` returns the master that takes over (READY); the
    probe times the first get and put that succeed, then reads a sample back."""
    probe = cl.workers(master, "probe", 1, *flags)
    killed = time.monotonic()
    victim.kill()
    probe[0].send("go wait")
    successor = restart()
    ready = time.monotonic()
    ok = json.loads(collect(probe, "RESULT", 300)[0])
    recovered, load_s = _recovery(successor)
    check = run_step(probe, f"go verify {objects} {a.verify_sample}", 600)[0]
    if check["missing"] or check["wrong"]:
        raise RuntimeError(f"failover lost objects: {check}")
    return {"objects": objects, "recovered": recovered, "journal_load_s": load_s,
            "recovered_per_s": recovered / load_s if load_s else float("inf"),
            "kill_to_ready_s": ready - killed, "kill_to_get_s": ok["get_ok"] - killed,
            "kill_to_put_s": ok["put_ok"] - killed, "verified": check}


def failover_section(a: argparse.Namespace) -> dict:
    lo, hi = a.min_value, a.max_value
    flags = ["--min_nbytes", str(lo), "--max_nbytes", str(hi)]
    out: dict = {}
    with Cluster() as cl:
        port, meta = free_port(), cl.tempdir()
        master_flags = ["--metadata_dir", meta, "--log_level", "INFO"]
        m = cl.master(*master_flags, port=port)
        cl.holders(m.address, holders_for(a.failover_objects, lo, hi, a.holder_segment), a.holder_segment)
        log(f"failover: file journal, {a.failover_objects:,} objects ...")
        out["file_fill"] = fill(cl.workers(m.address, "fill", a.fill_workers, *flags), 0,
                                a.failover_objects, "fill (file journal)", 3600)
        out["file"] = _crash_and_measure(cl, m, lambda: cl.master(*master_flags, port=port),
                                         m.address, a.failover_objects, a, flags)
    if shutil.which("etcd") is None:
        out["ha"] = {"skipped": "no etcd on PATH"}
        return out
    with Cluster() as cl:
        endpoints = cl.etcd()
        master = f"etcd://{endpoints}"
        ha = ["--enable_ha", "--etcd_endpoints", endpoints, "--log_level", "INFO"]
        leader = cl.master(*ha, port=free_port())
        standby = cl.master(*ha, port=free_port(), wait=False)
        cl.holders(master, holders_for(a.ha_objects, lo, hi, a.holder_segment), a.holder_segment)
        log(f"failover: HA + etcd journal, {a.ha_objects:,} objects ...")
        out["ha_fill"] = fill(cl.workers(master, "fill", a.fill_workers, *flags), 0, a.ha_objects,
                              "fill (HA, etcd journal)", 3600)

        def takeover() -> Child:
            cl.ready(standby, 300)
            return standby

        out["ha"] = _crash_and_measure(cl, leader, takeover, master, a.ha_objects, a, flags)
    return out


# -- report ---------------------------------------------------------------------------------------

def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def report(raw: dict, a: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    loads = ", ".join(f"{k.replace('_', ' ')} {v[0]:.2f}" for k, v in raw["load_average"].items())
    print(f"\n{os.cpu_count()} cores, shared by every master, holder and client process (and "
          f"whatever else runs here: 1-minute load average {loads}), so throughput flattens on "
          "CPU, not on the store.\n")
    md = raw.get("metadata")
    if md:
        print(f"### Master metadata: {md['objects']:,} objects of {a.min_value}..{a.max_value} B "
              f"on {md['holders']} holders\n")
        mrows = [["master RSS, empty", mib(md["rss_empty"])],
                 [f"master RSS, {md['objects']:,} objects", mib(md["rss_full"])],
                 ["bytes per object", f"{md['bytes_per_object']:,.0f}"],
                 [f"projection to {PROJECT_TO:,} objects (linear, not measured)",
                  f"{md['projected_rss_100M'] / 2**30:,.1f} GiB"],
                 ["master CPU while idle, empty / full", f"{md['idle_cpu_empty']:.1%} / "
                                                         f"{md['idle_cpu_full']:.1%} of a core"],
                 [f"one stats RPC at {md['objects']:,} objects", f"{md['stats_rpc_s'] * 1000:,.0f} ms"],
                 ["fill rate (batches of 256 puts)", f"{md['fill']['objects_per_s']:,.0f} objects/s"]]
        table(["metric", "value"], mrows)
        rows += [{"section": "metadata", "metric": k, "value": md[k]} for k in
                 ("objects", "rss_empty", "rss_full", "bytes_per_object", "projected_rss_100M",
                  "idle_cpu_empty", "idle_cpu_full", "stats_rpc_s")]
        print(f"\nMetadata RPCs, {a.rpc_workers} client processes x {a.rpc_threads} threads, "
              f"{a.rpc_duration:g} s each (put: new keys, {a.min_value}..{a.max_value} B, "
              "bytes moved too; get: lookup + read)\n")
        table(["op", "keys/call", "objects in master", "calls/s", "keys/s", "p50 ms", "p99 ms",
               "max ms", "master CPU"],
              [[r["op"], str(r["batch"]), f"{r['objects']:,}", f"{r['calls_per_s']:,.0f}",
                f"{r['keys_per_s']:,.0f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
                f"{r['max_ms']:.1f}", f"{r['master_cpu']:.0%}"] for r in md["rpc"]])
        rows += [{"section": "metadata_rpc", **r} for r in md["rpc"]]
    ev = raw.get("eviction")
    if ev:
        print(f"\n### Eviction: one holder of {mib(ev['segment'])}, {ev['value']:,} B puts "
              f"(about {ev['capacity_objects']:,} fit), one client, sequential puts\n")
        erows = []
        for name in ("below_watermark", "evicting"):
            p = ev[name]
            erows.append([name.replace("_", " "), f"{p['puts']:,}", f"{p['evicted']:,}",
                          f"{p['puts_per_s']:,.0f}", f"{p['p50_ms']:.2f}", f"{p['p99_ms']:.2f}",
                          f"{p['max_ms']:.1f}"])
            rows.append({"section": "eviction", "phase": name, **p})
        table(["phase", "puts", "evicted", "puts/s", "p50 ms", "p99 ms", "max ms"], erows)
    sc = raw.get("scaling")
    if sc:
        print(f"\n### Scaling: holders x client processes ({mib(sc['segment'])} segments, "
              f"{sc['duration_s']:g} s per cell, 1 thread per client), aggregate\n")
        base = sc["configs"][0]
        srows = []
        for r in sc["configs"]:
            cells = [f"{r['holders']} x {r['clients']}"]
            for tag, unit in (("put_4KiB", "ops"), ("get_4KiB", "ops"), ("put_4MiB", "GBps"),
                              ("get_4MiB", "GBps")):
                v, b = r[f"{tag}_{unit}"], base[f"{tag}_{unit}"]
                cells.append((f"{v:,.0f}" if unit == "ops" else f"{v:.2f}") + f" ({v / b:.2f}x)")
            srows.append(cells)
            rows.append({"section": "scaling", **r})
        table(["holders x clients", "put 4 KiB ops/s", "get 4 KiB ops/s", "put 4 MiB GB/s",
               "get 4 MiB GB/s"], srows)
    fo = raw.get("failover")
    if fo:
        print("\n### Failover: kill -9 of the master under no load, then a client's first get "
              "and put\n")
        frows = []
        for key, label in (("file", "restart, --metadata_dir"), ("ha", "HA leader, etcd journal")):
            f = fo.get(key, {})
            if "skipped" in f:
                frows.append([label, f["skipped"], "", "", "", "", ""])
                continue
            frows.append([label, f"{f['objects']:,}", f"{f['journal_load_s']:.2f}",
                          f"{f['recovered_per_s']:,.0f}", f"{f['kill_to_ready_s']:.2f}",
                          f"{f['kill_to_get_s']:.2f} / {f['kill_to_put_s']:.2f}",
                          f"{f['verified']['checked']:,} ok"])
            rows.append({"section": "failover", "setup": key,
                         **{k: v for k, v in f.items() if k != "verified"}})
        table(["failover", "objects", "journal load + rebuild s", "objects/s", "kill -> READY s",
               "kill -> get / put ok s", "read back"], frows)
    return rows


SECTIONS = {"metadata": metadata_section, "eviction": eviction_section, "scaling": scaling_section,
            "failover": failover_section}

QUICK = dict(objects=5000, rpc_small=0, rpc_duration=0.4, rpc_workers=2, rpc_threads=1,
             fill_workers=1, idle_s=0.3, holder_segment=64 << 20, evict_segment=4 << 20,
             evict_rounds=2, scale_configs="1x1,2x2", scale_segment=32 << 20, scale_duration=0.3,
             scale_ring=8 << 20,
             failover_objects=2000, ha_objects=1000, verify_sample=200)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="every section small: " +
                    ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    g = ap.add_argument_group("metadata")
    g.add_argument("--objects", type=int, default=1_000_000)
    g.add_argument("--min-value", type=int, default=64, help="smallest object (bytes)")
    g.add_argument("--max-value", type=int, default=1024, help="largest object (bytes)")
    g.add_argument("--holder-segment", type=int, default=512 << 20, help="bytes per holder")
    g.add_argument("--fill-workers", type=int, default=2)
    g.add_argument("--rpc-small", type=int, default=10_000,
                   help="also measure RPCs at this many objects (0: only at --objects)")
    g.add_argument("--rpc-workers", type=int, default=4, help="client processes")
    g.add_argument("--rpc-threads", type=int, default=2, help="threads per client process")
    g.add_argument("--rpc-batch", type=int, default=128, help="keys per batched call")
    g.add_argument("--rpc-duration", type=float, default=5.0, help="seconds per op")
    g.add_argument("--idle-s", type=float, default=5.0, help="seconds to sample idle CPU")
    g = ap.add_argument_group("eviction")
    g.add_argument("--evict-segment", type=int, default=64 << 20)
    g.add_argument("--evict-value", type=int, default=16 << 10)
    g.add_argument("--evict-rounds", type=int, default=3, help="puts past the watermark, in segment fills")
    g = ap.add_argument_group("scaling")
    g.add_argument("--scale-configs", default="1x1,2x2,4x4,8x4", help="holders x clients, ...")
    g.add_argument("--scale-segment", type=int, default=256 << 20)
    g.add_argument("--scale-duration", type=float, default=4.0, help="seconds per cell")
    g.add_argument("--scale-ring", type=int, default=32 << 20,
                   help="bytes each client keeps stored (puts upsert a ring of keys)")
    g = ap.add_argument_group("failover")
    g.add_argument("--failover-objects", type=int, default=100_000, help="with --metadata_dir")
    g.add_argument("--ha-objects", type=int, default=100_000, help="with HA + etcd")
    g.add_argument("--verify-sample", type=int, default=2000, help="objects read back after")
    ap.add_argument("--out", default=None, help="JSON results (default: results/"
                    "store_scale.json, with --quick results/store_scale.quick.json)")
    a = ap.parse_args(argv)
    if a.out is None:
        a.out = str(HERE / "results" / ("store_scale.quick.json" if a.quick else "store_scale.json"))
    if a.quick:
        defaults = {k: ap.get_default(k) for k in QUICK}
        for k, v in QUICK.items():
            if getattr(a, k) == defaults[k]:   # an explicit flag wins over --quick
                setattr(a, k, v)
    unknown = set(a.sections.split(",")) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {list(SECTIONS)}")
    if not 0 < a.min_value <= a.max_value or a.max_value > 1 << 20:
        ap.error("need 0 < --min-value <= --max-value <= 1 MiB")
    if a.objects < 1 or not 0 <= a.rpc_small < a.objects:
        ap.error("need --objects >= 1 and 0 <= --rpc-small < --objects")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: every Cluster closes
    raw: dict = {"load_average": {"start": os.getloadavg()}}
    t0 = time.monotonic()
    try:
        for name in a.sections.split(","):
            raw[name] = SECTIONS[name](a)
            raw["load_average"][f"after_{name}"] = os.getloadavg()
    except KeyboardInterrupt:   # the section's processes are stopped by now
        log("interrupted")
        sys.exit(130)
    raw["wall_s"] = time.monotonic() - t0
    rows = report(raw, a)
    write_results(a.out, vars(a), rows, raw)


if __name__ == "__main__":
    main()
