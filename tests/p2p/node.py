"""A P2P store node in its own process, driven by the tests over stdin/stdout.

Prints ``READY {"segment": ...}`` once serving, then answers each JSON command line with
one JSON line, ``{"ok": true, ...}`` or ``{"ok": false, "error": <type>, "message": ...}``:

- ``{"cmd": "register", "name": N, "parts": [nbytes, ...], "seed": S}`` -> ``sha``
- ``{"cmd": "get", "name": N, "serve": true, "parts": [...]?}`` -> ``sha``, ``read_from``,
  ``failed`` (``parts`` defaults to the published layout)
- ``{"cmd": "unregister", "name": N}``, ``{"cmd": "list", "prefix": P}`` -> ``names``,
  ``{"cmd": "holders", "name": N}`` -> ``segments``, ``{"cmd": "stats"}``, ``{"cmd": "quit"}``

The engine uses tcp only, so the bytes it serves are counted in ``stats``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import numpy as np

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.p2p import P2PStore
from mooncake_plugins.transfer import TransferEngine


def make_parts(sizes: list[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=n, dtype=np.uint8) for n in sizes]


def sha(parts: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.data)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--metadata", required=True)
    ap.add_argument("--chunk-nbytes", type=int, default=256 << 10)
    args = ap.parse_args()
    engine = TransferEngine("127.0.0.1", args.metadata,
                            config=EngineConfig(transports=["tcp"], slice_nbytes=256 << 10))
    store = P2PStore(args.metadata, engine=engine, chunk_nbytes=args.chunk_nbytes)
    keep: dict[str, list[np.ndarray]] = {}
    print("READY " + json.dumps({"segment": store.segment}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        cmd, name = msg["cmd"], msg.get("name", "")
        try:
            out: dict = {}
            if cmd == "register":
                parts = make_parts(msg["parts"], msg["seed"])
                store.register(name, parts)
                keep[name] = parts
                out["sha"] = sha(parts)
            elif cmd == "get":
                sizes = msg.get("parts") or list(store.describe(name).part_nbytes)
                parts = [np.zeros(n, dtype=np.uint8) for n in sizes]
                report = store.get_replica(name, parts, serve=msg.get("serve", True))
                if msg.get("serve", True):
                    keep[name] = parts
                out.update(sha=sha(parts), read_from=report.read_from, failed=report.failed)
            elif cmd == "unregister":
                store.unregister(name)
                keep.pop(name, None)
            elif cmd == "list":
                out["names"] = store.list(msg.get("prefix", ""))
            elif cmd == "holders":
                out["segments"] = [h.segment for h in store.describe(name).holders]
            elif cmd == "stats":
                out.update(engine.stats)
            elif cmd == "quit":
                break
            print(json.dumps({"ok": True, **out}), flush=True)
        except Exception as exc:  # report to the test, keep serving
            print(json.dumps({"ok": False, "error": type(exc).__name__, "message": str(exc)}),
                  flush=True)
    store.close()
    engine.close()


if __name__ == "__main__":
    main()
