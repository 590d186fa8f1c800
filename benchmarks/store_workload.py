#!/usr/bin/env python3
"""One side of benchmarks/store_bench.py, run by any interpreter (ours, the original's venv).

``--role holder`` contributes a segment and waits for stdin to close; ``--role client``
runs the timed workloads through the original ``MooncakeDistributedStore`` API (ours:
``mooncake_plugins.compat.store``; original: ``mooncake.store``; or redis-py) and prints
one JSON line of results. Only the standard library is needed besides the store itself.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import sys
import time

MB4 = 4 << 20
KB4 = 4096


def store_class(impl: str):
    if impl == "ours":
        from mooncake_plugins.compat.store import MooncakeDistributedStore
    else:
        from mooncake.store import MooncakeDistributedStore
    return MooncakeDistributedStore


class Buffer:
    """Page-aligned memory with a stable address (registered with the store)."""

    def __init__(self, nbytes: int) -> None:
        self._raw = ctypes.create_string_buffer(nbytes + 4096)
        self.address = (ctypes.addressof(self._raw) + 4095) & ~4095
        self.nbytes = nbytes
        ctypes.memset(self.address, 0x5A, nbytes)


class RedisAdapter:
    """The same calls on a Redis server: SET/GET/MGET/EXISTS."""

    def __init__(self, port: int) -> None:
        import redis

        self.r = redis.Redis(port=port)

    def register_buffer(self, address: int, nbytes: int) -> int:
        return 0

    def put_from(self, key: str, address: int, nbytes: int) -> int:
        self.r.set(key, ctypes.string_at(address, nbytes))
        return 0

    def get_into(self, key: str, address: int, nbytes: int) -> int:
        data = self.r.get(key)
        ctypes.memmove(address, data, len(data))
        return len(data)

    def put(self, key: str, value: bytes) -> int:
        self.r.set(key, value)
        return 0

    def get(self, key: str) -> bytes:
        return self.r.get(key)

    def batch_get_into(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        out = []
        for data, address in zip(self.r.mget(keys), addresses):
            ctypes.memmove(address, data, len(data))
            out.append(len(data))
        return out

    def is_exist(self, key: str) -> int:
        return int(self.r.exists(key))

    def remove(self, key: str) -> int:
        self.r.delete(key)
        return 0

    def close(self) -> int:
        return 0


def timed(fn, duration_s: float) -> tuple[int, float]:
    n, t0 = 0, time.perf_counter()
    while True:
        fn(n)
        n += 1
        el = time.perf_counter() - t0
        if el >= duration_s:
            return n, el


def check(rc, what):
    if (isinstance(rc, int) and rc < 0) or (isinstance(rc, list) and any(x < 0 for x in rc)):
        raise RuntimeError(f"{what} failed: {rc}")


def run_client(store, duration_s: float) -> dict:
    res = {}
    big = Buffer(MB4 * 8)
    check(store.register_buffer(big.address, big.nbytes), "register_buffer")
    nbig = 32
    # warm-up, untimed for every system: connections, segment lookups and mappings
    check(store.put_from("warmup", big.address, MB4), "warm-up put")
    check(store.get_into("warmup", big.address, MB4), "warm-up get")
    store.remove("warmup")
    # 4 MiB put (zero-copy from registered memory): a fresh key per put
    t0 = time.perf_counter()
    for i in range(nbig):
        check(store.put_from(f"big{i}", big.address + (i % 8) * MB4, MB4), "put_from")
    res["put_4MiB_GBps"] = nbig * MB4 / (time.perf_counter() - t0) / 1e9
    n, el = timed(lambda i: check(store.get_into(f"big{i % nbig}", big.address + (i % 8) * MB4, MB4),
                                  "get_into"), duration_s)
    res["get_4MiB_GBps"] = n * MB4 / el / 1e9
    # the bytes API (what a Python user without registered buffers calls)
    value = b"\xa5" * MB4
    for i in range(nbig):
        store.remove(f"big{i}")
    t0 = time.perf_counter()
    for i in range(nbig):
        check(store.put(f"bb{i}", value), "put")
    res["put_bytes_4MiB_GBps"] = nbig * MB4 / (time.perf_counter() - t0) / 1e9
    # every object once, every result kept: each get needs memory never used before
    # (a user's first requests on a fresh node; issue 22 found this path bimodal)
    held = []
    t0 = time.perf_counter()
    for i in range(nbig):
        held.append(store.get(f"bb{i}"))
    res["get_bytes_4MiB_fresh_GBps"] = nbig * MB4 / (time.perf_counter() - t0) / 1e9
    if any(len(h) != MB4 for h in held):
        raise RuntimeError("a held 4 MiB get came back short")
    del held
    n, el = timed(lambda i: store.get(f"bb{i % nbig}"), duration_s)
    res["get_bytes_4MiB_GBps"] = n * MB4 / el / 1e9
    for i in range(nbig):
        store.remove(f"bb{i}")
    # small objects
    small = Buffer(KB4 * 64)
    check(store.register_buffer(small.address, small.nbytes), "register_buffer")
    keys = [f"s{i}" for i in range(256)]
    for i, k in enumerate(keys):
        check(store.put_from(k, small.address + (i % 64) * KB4, KB4), "put_from 4K")
    rng = random.Random(1)
    n, el = timed(lambda i: check(store.get_into(keys[rng.randrange(256)], small.address, KB4),
                                  "get_into 4K"), duration_s)
    res["get_4KiB_ops"] = n / el
    n, el = timed(lambda i: store.get(keys[rng.randrange(256)]), duration_s)
    res["get_bytes_4KiB_ops"] = n / el
    small_value = b"\x5a" * KB4   # single puts of fresh keys (Redis: SET)
    n, el = timed(lambda i: check(store.put(f"p4k{i}", small_value), "put 4K"), duration_s)
    res["put_bytes_4KiB_ops"] = n / el
    addrs = [small.address + j * KB4 for j in range(64)]

    def batch(i: int) -> None:
        base = (i * 64) % 256
        check(store.batch_get_into(keys[base:base + 64], addrs, [KB4] * 64), "batch_get_into")

    n, el = timed(batch, duration_s)
    res["batch_get_4KiBx64_objs"] = n * 64 / el
    n, el = timed(lambda i: store.is_exist(keys[i % 256]), duration_s)
    res["exist_ops"] = n / el
    for k in keys:
        store.remove(k)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["ours", "original", "redis"], required=True)
    ap.add_argument("--role", choices=["holder", "client"], required=True)
    ap.add_argument("--master", default="127.0.0.1:50051")
    ap.add_argument("--metadata", default="P2PHANDSHAKE")
    ap.add_argument("--redis-port", type=int, default=6379)
    ap.add_argument("--segment", type=int, default=512 << 20)
    ap.add_argument("--duration", type=float, default=3.0)
    a = ap.parse_args()
    if a.impl == "redis":
        store = RedisAdapter(a.redis_port)
    else:
        store = store_class(a.impl)()
        seg = a.segment if a.role == "holder" else 0
        rc = store.setup("127.0.0.1", a.metadata, seg, 64 << 20, "tcp", "", a.master)
        if rc != 0:
            raise SystemExit(f"setup failed: {rc}")
    if a.role == "holder":
        print("READY 0", flush=True)
        sys.stdin.read()
    else:
        print(json.dumps(run_client(store, a.duration)), flush=True)
    store.close()
    os._exit(0)  # the original's threads can hang interpreter shutdown


if __name__ == "__main__":
    main()
