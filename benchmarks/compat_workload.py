#!/usr/bin/env python3
"""One side of benchmarks/compat_bench.py: the same script for ours and the original.

Imports ``mooncake.store`` whichever package the interpreter has (our drop-in, or the
original wheel in its own venv). ``--role holder`` contributes a segment and waits for
stdin to close; ``--role client`` runs the cold phase (first calls on a fresh holder with
fresh keys, no warm-up, one sample each) then the warm phase (timed loops), and prints one
JSON line. Needs numpy; the tensor rows also need torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

MB4 = 4 << 20
KB4 = 4096
LAYERS, KEYS, LAYER_NBYTES = 32, 64, 16 << 10  # vLLM/SGLang shape: one buffer per layer


class Region:
    """Page-aligned numpy memory registered with the store."""

    def __init__(self, store, nbytes: int) -> None:
        raw = np.empty(nbytes + 4096, dtype=np.uint8)
        start = (-raw.ctypes.data) % 4096
        self.array = raw[start:start + nbytes]
        self.array.fill(0x5A)
        self.address = self.array.ctypes.data
        check(store.register_buffer(self.address, nbytes), "register_buffer")


def check(rc, what: str):
    if rc is None or (isinstance(rc, int) and rc < 0) or \
            (isinstance(rc, list) and any(isinstance(x, int) and x < 0 for x in rc)):
        raise RuntimeError(f"{what} failed: {rc}")
    return rc


def once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed(fn, duration_s: float, min_n: int = 3) -> tuple[int, float]:
    n, t0 = 0, time.perf_counter()
    while True:
        fn(n)
        n += 1
        el = time.perf_counter() - t0
        if el >= duration_s and n >= min_n:
            return n, el


class Workload:
    def __init__(self, store, tag: str) -> None:
        self.store, self.tag = store, tag
        self.big = Region(store, MB4 * 8)
        self.small = Region(store, KB4 * 64)
        self.layers = [Region(store, LAYER_NBYTES * KEYS) for _ in range(LAYERS)]
        self.value = b"\xa5" * MB4

    def key(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def multi_args(self, prefix: str) -> tuple[list[str], list[list[int]], list[list[int]]]:
        keys = [self.key(f"{prefix}{k}") for k in range(KEYS)]
        ptrs = [[layer.address + k * LAYER_NBYTES for layer in self.layers] for k in range(KEYS)]
        sizes = [[LAYER_NBYTES] * LAYERS for _ in range(KEYS)]
        return keys, ptrs, sizes

    # -- one call each: the cold rows ------------------------------------------------
    def cold(self, torch) -> dict[str, float]:
        s, r = self.store, {}
        r["put_bytes_4MiB_s"] = once(lambda: check(s.put(self.key("c0"), self.value), "put"))
        r["get_bytes_4MiB_s"] = once(lambda: check(len(s.get(self.key("c0"))) == MB4 or -1, "get"))
        r["put_from_4MiB_s"] = once(lambda: check(s.put_from(self.key("c1"), self.big.address,
                                                             MB4), "put_from"))
        r["get_into_4MiB_s"] = once(lambda: check(s.get_into(self.key("c1"), self.big.address
                                                             + MB4, MB4), "get_into"))
        keys, ptrs, sizes = self.multi_args("cm")
        r["batch_put_multi_s"] = once(lambda: check(
            s.batch_put_from_multi_buffers(keys, ptrs, sizes), "batch_put_from_multi_buffers"))
        r["batch_is_exist_64_s"] = once(lambda: check(s.batch_is_exist(keys), "batch_is_exist"))
        r["batch_get_multi_s"] = once(lambda: check(
            s.batch_get_into_multi_buffers(keys, ptrs, sizes), "batch_get_into_multi_buffers"))
        if torch is not None:
            t = torch.ones(16 << 20, dtype=torch.float32)
            r["put_tensor_64MiB_s"] = once(lambda: check(s.put_tensor(self.key("ct"), t),
                                                         "put_tensor"))
            r["get_tensor_64MiB_s"] = once(lambda: check(s.get_tensor(self.key("ct")),
                                                         "get_tensor"))
        return r

    # -- timed loops: the warm rows -----------------------------------------------------
    def warm(self, torch, duration_s: float) -> dict[str, float]:
        s, r, nbig = self.store, {}, 16
        for i in range(nbig):  # warm-up writes, not timed
            check(s.put_from(self.key(f"w{i}"), self.big.address, MB4), "put_from")
        t0 = time.perf_counter()
        for i in range(nbig):
            check(s.put_from(self.key(f"p{i}"), self.big.address + (i % 8) * MB4, MB4), "put_from")
        r["put_from_4MiB_GBps"] = nbig * MB4 / (time.perf_counter() - t0) / 1e9
        n, el = timed(lambda i: check(s.get_into(self.key(f"p{i % nbig}"), self.big.address
                                                 + (i % 8) * MB4, MB4), "get_into"), duration_s)
        r["get_into_4MiB_GBps"] = n * MB4 / el / 1e9
        t0 = time.perf_counter()
        for i in range(nbig):
            check(s.put(self.key(f"b{i}"), self.value), "put")
        r["put_bytes_4MiB_GBps"] = nbig * MB4 / (time.perf_counter() - t0) / 1e9
        held = []  # results kept, so every get needs fresh memory (as a user's would)
        n, el = timed(lambda i: held.append(s.get(self.key(f"b{i % nbig}"))), duration_s)
        r["get_bytes_4MiB_GBps"] = n * MB4 / el / 1e9
        del held
        for i in range(nbig):
            for p in ("w", "p", "b"):
                s.remove(self.key(f"{p}{i}"), True)
        keys = [self.key(f"s{i}") for i in range(256)]
        for i, k in enumerate(keys):
            check(s.put_from(k, self.small.address + (i % 64) * KB4, KB4), "put_from 4K")
        n, el = timed(lambda i: check(s.get_into(keys[(i * 7) % 256], self.small.address, KB4),
                                      "get_into 4K"), duration_s)
        r["get_into_4KiB_ops"] = n / el
        n, el = timed(lambda i: s.get(keys[(i * 7) % 256]), duration_s)
        r["get_bytes_4KiB_ops"] = n / el
        addrs = [self.small.address + j * KB4 for j in range(64)]
        n, el = timed(lambda i: check(s.batch_get_into(keys[(i * 64) % 256:][:64], addrs,
                                                       [KB4] * 64), "batch_get_into"), duration_s)
        r["batch_get_into_64x4KiB_objs"] = n * 64 / el
        n, el = timed(lambda i: check(s.batch_is_exist(keys[(i * 64) % 256:][:64]),
                                      "batch_is_exist"), duration_s)
        r["batch_is_exist_64_objs"] = n * 64 / el
        for k in keys:
            s.remove(k, True)
        nrounds = 12  # fresh keys each round; 12 x 32 MiB stays well inside the segment
        batches = [self.multi_args(f"m{i}-") for i in range(nrounds)]
        t0 = time.perf_counter()
        for keys, ptrs, sizes in batches:
            check(s.batch_put_from_multi_buffers(keys, ptrs, sizes), "batch_put_multi")
        el = time.perf_counter() - t0
        r["batch_put_multi_GBps"] = nrounds * KEYS * LAYERS * LAYER_NBYTES / el / 1e9
        keys, ptrs, sizes = self.multi_args("m0-")
        n, el = timed(lambda i: check(s.batch_get_into_multi_buffers(keys, ptrs, sizes),
                                      "batch_get_multi"), duration_s)
        r["batch_get_multi_GBps"] = n * KEYS * LAYERS * LAYER_NBYTES / el / 1e9
        for ks, _, _ in batches:
            for k in ks:
                s.remove(k, True)
        if torch is not None:
            t = torch.ones(16 << 20, dtype=torch.float32)
            n, el = timed(lambda i: (s.remove(self.key("t"), True) if i else 0,
                                     check(s.put_tensor(self.key("t"), t), "put_tensor")),
                          duration_s)
            r["put_tensor_64MiB_GBps"] = n * t.nbytes / el / 1e9
            n, el = timed(lambda i: check(s.get_tensor(self.key("t")), "get_tensor"), duration_s)
            r["get_tensor_64MiB_GBps"] = n * t.nbytes / el / 1e9
            s.remove(self.key("t"), True)
        return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["holder", "client"], required=True)
    ap.add_argument("--phase", choices=["cold", "warm"], default="warm")
    ap.add_argument("--master", default="127.0.0.1:50051")
    ap.add_argument("--metadata", default="P2PHANDSHAKE")
    ap.add_argument("--segment", type=int, default=1 << 30)
    ap.add_argument("--duration", type=float, default=2.0)
    ap.add_argument("--tag", default="k")
    a = ap.parse_args()
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    seg = a.segment if a.role == "holder" else 0
    rc = store.setup("127.0.0.1", a.metadata, seg, 256 << 20, "tcp", "", a.master)
    if rc != 0:
        raise SystemExit(f"setup failed: {rc}")
    if a.role == "holder":
        print("READY 0", flush=True)
        sys.stdin.read()
    else:
        try:
            import torch
        except ImportError:
            torch = None
        work = Workload(store, a.tag)
        out = work.cold(torch) if a.phase == "cold" else work.warm(torch, a.duration)
        print(json.dumps(out), flush=True)
    store.close()
    os._exit(0)  # the original's threads can hang interpreter shutdown


if __name__ == "__main__":
    main()
