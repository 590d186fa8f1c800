"""Share a checkpoint peer to peer: a trainer registers shards, reader processes fetch them.

Runs with no setup (it starts an in-process HTTP metadata server):

    python examples/p2p_checkpoint.py --readers 4 --shards 4 --shard-mib 8

Each reader fetches the shards in a different order, verifies their sha256 and then serves
them, so later readers read from earlier ones instead of the trainer. Engines use tcp only
so that the bytes each node serves are counted in ``engine.stats``.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp

import numpy as np

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.p2p import P2PStore
from mooncake_plugins.transfer import TransferEngine
from mooncake_plugins.transfer.metadata import MetadataServer


def open_store(url: str) -> tuple[P2PStore, TransferEngine]:
    engine = TransferEngine("127.0.0.1", url, config=EngineConfig(transports=["tcp"]))
    return P2PStore(url, engine=engine), engine


def digest(parts: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.data.cast("B"))
    return h.hexdigest()


def reader(rank: int, url: str, checksums: dict[str, str], results: mp.Queue,
           done: mp.Event) -> None:
    store, engine = open_store(url)
    try:
        names = sorted(checksums)
        for name in names[rank % len(names):] + names[:rank % len(names)]:
            info = store.describe(name)
            parts = [np.empty(n, dtype=np.uint8) for n in info.part_nbytes]
            report = store.get_replica(name, parts)  # then serves them (serve=True)
            if digest(parts) != checksums[name]:
                results.put(f"reader {rank}: checksum mismatch on {name}")
                return
            print(f"reader {rank}: {name} ok, read from {sorted(report.read_from)}", flush=True)
        results.put(rank)
        done.wait(120)  # keep serving until every reader has its copy
        results.put((rank, engine.stats["bytes_out"]))
    finally:
        store.close()
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--shard-mib", type=int, default=8)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    with MetadataServer() as server:
        trainer, engine = open_store(server.url)
        rng = np.random.default_rng(0)
        shards, checksums = {}, {}
        for i in range(args.shards):  # a shard: one weight matrix and its bias, as numpy
            weight = rng.standard_normal((args.shard_mib * 256, 1024), dtype=np.float32)
            bias = rng.standard_normal(1024, dtype=np.float32)
            name = f"checkpoint/step-1000/shard-{i}"
            shards[name] = [weight, bias]
            trainer.register(name, [weight, bias])
            checksums[name] = digest([weight, bias])
        print("trainer registered", trainer.list("checkpoint/"), flush=True)
        results, done = ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=reader, args=(r, server.url, checksums, results, done))
                 for r in range(args.readers)]
        for p in procs:
            p.start()
        try:
            for _ in procs:  # every reader has verified all shards (or one failed)
                if isinstance(failed := results.get(timeout=300), str):
                    raise SystemExit(failed)
            done.set()  # now readers report what they served, and stop
            served = dict(results.get(timeout=60) for _ in procs)
        finally:
            done.set()
            for p in procs:
                p.join(60)
        total = sum(w.nbytes + b.nbytes for w, b in shards.values())
        out = engine.stats["bytes_out"]
        print(f"checkpoint: {total / 2**20:.1f} MiB; trainer sent {out / 2**20:.1f} MiB "
              f"({out / total:.2f}x) for {args.readers} readers "
              f"(readers x size = {args.readers * total / 2**20:.1f} MiB); readers served "
              f"{ {r: round(v / 2**20, 1) for r, v in sorted(served.items())} } MiB")
        trainer.close()
        engine.close()


if __name__ == "__main__":
    main()
