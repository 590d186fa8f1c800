#!/usr/bin/env python3
"""One client process of benchmarks/store_scale.py: a ``StoreClient`` without a segment.

``store_scale_worker.py --master ADDR JOB [flags]`` prints ``READY`` once set up, then runs
one step per ``go ...`` line on stdin and answers each with ``RESULT <json>``; ``fill``
also prints ``P <objects put so far>`` lines. EOF on stdin ends the process.

Jobs (the step each ``go`` line runs):
  fill    ``go <first> <count>``: put keys ``k<first>`` .. ``k<first+count-1>`` in batches
  rpc     ``go <op> <batch> <objects>``: ``--threads`` threads call one op (exist,
          get_replicas, get, put) on ``batch`` random keys of ``k0`` .. ``k<objects-1>``
          (puts: fresh keys) at a time, for ``--duration``
  stream  ``go put|get <nbytes>``: upserts into a ring of keys, or gets the keys put
          before, for ``--duration``
  evict   ``go <count>``: that many sequential puts of fresh keys, each one timed
  probe   ``go wait``: get and put until both succeed (the master was just killed);
          ``go verify <objects> <sample>``: read a sample of the filled keys back, byte for byte
Object ``k<i>`` has a size and bytes that are functions of ``i`` (:func:`value_nbytes`,
:func:`value_offset` into a fixed random pattern), so any process can check it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_workload import Buffer  # noqa: E402

from mooncake_plugins.errors import MooncakeError  # noqa: E402
from mooncake_plugins.store.client import StoreClient  # noqa: E402

PATTERN_NBYTES = 8 << 20
_PATTERN = random.Random(7).randbytes(PATTERN_NBYTES)


def value_nbytes(i: int, lo: int, hi: int) -> int:
    """Size of object ``k<i>`` when sizes run from ``lo`` to ``hi`` bytes."""
    return lo + (i * 2654435761 % (1 << 32)) % (hi - lo + 1)


def value_offset(i: int, nbytes: int) -> int:
    """Where object ``k<i>``'s bytes start in the pattern."""
    return (i * 4099) % (PATTERN_NBYTES - nbytes + 1)


class Worker:
    """The client, the registered pattern and the steps of every job."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.pattern = Buffer(PATTERN_NBYTES)
        ctypes.memmove(self.pattern.address, _PATTERN, PATTERN_NBYTES)
        self.client = StoreClient(a.master, cluster_id=a.cluster_id, global_segment_size=0,
                                  failover_timeout_s=120)
        self.client.register_buffer(self.pattern.address, self.pattern.nbytes)
        self._seq = 0    # evict: the next fresh key
        self._steps = 0  # steps run (rpc: part of the fresh keys' names)
        self._stored: dict[int, int] = {}   # stream: ring keys put, by size
        self._get_buffers: dict[tuple[int, int], Buffer] = {}   # rpc get: per thread and batch

    # -- fill -------------------------------------------------------------------------------
    def fill(self, first: int, count: int) -> dict:
        a, t0, done, errors, nbytes, first_error = self.a, time.perf_counter(), 0, 0, 0, ""
        for start in range(first, first + count, a.batch):
            ids = range(start, min(start + a.batch, first + count))
            sizes = [value_nbytes(i, a.min_nbytes, a.max_nbytes) for i in ids]
            addrs = [self.pattern.address + value_offset(i, n) for i, n in zip(ids, sizes)]
            res = self.client.batch_put_from([f"k{i}" for i in ids], addrs, sizes)
            for err, n in zip(res, sizes):
                if err is None:
                    done, nbytes = done + 1, nbytes + n
                else:
                    errors += 1
                    first_error = first_error or f"{type(err).__name__}: {err}"
            print(f"P {done + errors}", flush=True)
        return {"objects": done, "bytes": nbytes, "errors": errors, "first_error": first_error,
                "seconds": time.perf_counter() - t0}

    # -- rpc --------------------------------------------------------------------------------
    def _op(self, op: str, batch: int, objects: int, rng: random.Random, tid: int,
            tag: str) -> Callable[[int], tuple[int, int]]:
        """A callable doing one call of ``op``: returns (keys handled, keys that failed)."""
        c, a, base = self.client, self.a, self.pattern.address
        lo, hi = a.min_nbytes, a.max_nbytes
        pick = lambda: [f"k{rng.randrange(objects)}" for _ in range(batch)]  # noqa: E731

        def new(seq: int) -> tuple[list[str], list[int], list[int]]:
            ids = range(seq * batch, (seq + 1) * batch)
            sizes = [value_nbytes(i, lo, hi) for i in ids]
            return ([f"{tag}-{i}" for i in ids], [base + value_offset(i, n) for i, n in zip(ids, sizes)],
                    sizes)

        if op == "exist":
            return lambda seq: (batch, batch - sum(c.batch_exists(pick())))
        if op == "get_replicas":
            return lambda seq: (batch, sum(isinstance(r, Exception) for r in c.replicas(pick())))
        if op == "get":
            into = self._get_buffers.get((tid, batch))
            if into is None:  # kept registered (and alive) until the process ends
                into = self._get_buffers[(tid, batch)] = Buffer(hi * batch)
                c.register_buffer(into.address, into.nbytes)
            addrs, room = [into.address + j * hi for j in range(batch)], [hi] * batch
            return lambda seq: (batch, sum(isinstance(r, Exception)
                                           for r in c.batch_get_into(pick(), addrs, room)))
        if op == "put":
            return lambda seq: (batch, sum(e is not None for e in c.batch_put_from(*new(seq))))
        raise SystemExit(f"unknown rpc op {op!r}")

    def rpc(self, op: str, batch: int, objects: int) -> dict:
        """``--threads`` threads calling ``op`` (on keys ``k0`` .. ``k<objects-1>``, or fresh
        ones for puts) back to back for ``--duration`` seconds."""
        a = self.a
        results: list[tuple[int, int, int, list[int]]] = []
        lock = threading.Lock()
        start = threading.Barrier(a.threads)

        def run(tid: int) -> None:
            call = self._op(op, batch, objects, random.Random(a.wid * 1000 + tid), tid,
                            f"{op}{batch}-{a.wid}-{tid}-{self._steps}")
            lat, calls, keys, failed = [], 0, 0, 0
            for seq in range(-10, 0):  # untimed: connections, buffers, the first mappings
                call(seq)
            start.wait()
            deadline = time.perf_counter() + a.duration
            while (t := time.perf_counter()) < deadline:
                n, bad = call(calls)
                lat.append(int((time.perf_counter() - t) * 1e6))
                calls, keys, failed = calls + 1, keys + n, failed + bad
            with lock:
                results.append((calls, keys, failed, lat))

        t0 = time.perf_counter()
        threads = [threading.Thread(target=run, args=(i,)) for i in range(a.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return {"calls": sum(r[0] for r in results), "keys": sum(r[1] for r in results),
                "failed": sum(r[2] for r in results), "seconds": time.perf_counter() - t0,
                "lat_us": [x for r in results for x in r[3]]}

    # -- stream -----------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Contact every holder once (random placement: 64 puts reach 8 holders almost surely)."""
        keys = [f"warm-{self.a.wid}-{i}" for i in range(64)]
        addr = self.pattern.address
        self._check(self.client.batch_put_from(keys, [addr] * len(keys), [4096] * len(keys)), "warm-up put")
        for k in keys:
            self.client.get(k)
        self.client.batch_remove(keys, force=True)

    def stream(self, mode: str, nbytes: int) -> dict:
        c, a = self.client, self.a
        ring = max(2, min(1024, a.ring_nbytes // nbytes))
        keys = [f"s{nbytes}-{a.wid}-{i}" for i in range(ring)]
        slots = [self.pattern.address + (i * nbytes) % (PATTERN_NBYTES - nbytes + 1) for i in range(ring)]
        rng = random.Random(a.wid)
        stored = self._stored.get(nbytes, 0)
        if mode == "get" and not stored:
            raise RuntimeError(f"get {nbytes}: no put of that size ran before")
        n, t0 = 0, time.perf_counter()
        deadline = t0 + a.duration
        while time.perf_counter() < deadline:
            if mode == "put":
                i = n % ring
                c.put_from(keys[i], slots[i], nbytes, upsert=True)
            else:
                i = rng.randrange(stored)
                c.get_into(keys[i], slots[i], nbytes)
            n += 1
        if mode == "put":
            self._stored[nbytes] = max(stored, min(n, ring))
        return {"ops": n, "bytes": n * nbytes, "seconds": time.perf_counter() - t0}

    # -- evict ------------------------------------------------------------------------------
    def evict(self, count: int) -> dict:
        c, a = self.client, self.a
        lat, errors, first_error = [], 0, ""
        t0 = time.perf_counter()
        for _ in range(count):
            i, self._seq = self._seq, self._seq + 1
            n = value_nbytes(i, a.min_nbytes, a.max_nbytes)
            t = time.perf_counter()
            try:
                c.put_from(f"e{i}", self.pattern.address + value_offset(i, n), n)
            except MooncakeError as exc:
                errors += 1
                first_error = first_error or f"{type(exc).__name__}: {exc}"
            lat.append(int((time.perf_counter() - t) * 1e6))
        return {"puts": count, "errors": errors, "first_error": first_error,
                "seconds": time.perf_counter() - t0, "lat_us": lat}

    # -- probe ------------------------------------------------------------------------------
    def wait_serving(self) -> dict:
        """Monotonic times at which a get of ``k0`` and a fresh put first succeeded."""
        c, ok, tries = self.client, {}, 0
        while len(ok) < 2:
            tries += 1
            if "get" not in ok:
                try:
                    c.get("k0")
                    ok["get"] = time.monotonic()
                except MooncakeError:
                    pass
            if "put" not in ok:
                try:
                    c.put(f"probe-{tries}", b"p" * 512)
                    ok["put"] = time.monotonic()
                except MooncakeError:
                    pass
            if len(ok) < 2:
                time.sleep(0.01)  # a failed call against a dead master returns at once
        return {"get_ok": ok["get"], "put_ok": ok["put"], "tries": tries}

    def verify(self, objects: int, sample: int) -> dict:
        a, rng = self.a, random.Random(3)
        missing = wrong = 0
        for i in rng.sample(range(objects), min(sample, objects)):
            n = value_nbytes(i, a.min_nbytes, a.max_nbytes)
            off = value_offset(i, n)
            try:
                data = self.client.get(f"k{i}")
            except MooncakeError:
                missing += 1
                continue
            wrong += data != _PATTERN[off:off + n]
        return {"checked": min(sample, objects), "missing": missing, "wrong": wrong}

    @staticmethod
    def _check(errors: list, what: str) -> None:
        bad = [e for e in errors if e is not None]
        if bad:
            raise RuntimeError(f"{what}: {len(bad)} failed, first: {bad[0]!r}")

    def step(self, words: list[str]) -> dict:
        job = self.a.job
        self._steps += 1
        if job == "fill":
            return self.fill(int(words[0]), int(words[1]))
        if job == "rpc":
            return self.rpc(words[0], int(words[1]), int(words[2]))
        if job == "stream":
            return self.stream(words[0], int(words[1]))
        if job == "evict":
            return self.evict(int(words[0]))
        if words[0] == "wait":
            return self.wait_serving()
        return self.verify(int(words[1]), int(words[2]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job", choices=["fill", "rpc", "stream", "evict", "probe"])
    ap.add_argument("--master", required=True, help="host:port, or etcd://host:port (HA)")
    ap.add_argument("--cluster_id", default="mooncake")
    ap.add_argument("--wid", type=int, default=0, help="this worker's number (keys, seeds)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--min_nbytes", type=int, default=64)
    ap.add_argument("--max_nbytes", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--ring_nbytes", type=int, default=32 << 20)
    a = ap.parse_args()
    w = Worker(a)
    try:
        if a.job in ("stream", "evict"):
            w.warm_up()
        print("READY", flush=True)
        for line in sys.stdin:
            words = line.split()
            if words and words[0] == "go":
                print("RESULT " + json.dumps(w.step(words[1:])), flush=True)
    finally:
        w.client.close()
    os._exit(0)


if __name__ == "__main__":
    main()
