"""A transfer-engine peer in its own process, driven over stdin/stdout by the tests.

Prints ``READY <json>`` (segment name, rpc port, buffer address and size) once serving,
then answers one line per command: ``sha`` (sha256 of the buffer), ``stats`` (bytes
served, JSON), ``paths`` (bytes and state per tcp path, JSON), ``fill <seed>``
(deterministic bytes), ``write <segment> <remote_address> <nbytes>`` and
``read <segment> <remote_address> <nbytes>`` (from/into the start of its own buffer),
``realloc`` (free the buffer and allocate one of the same size; prints its address),
``quit``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.transfer import TransferEngine


def pattern(seed: int, nbytes: int) -> bytes:
    """``random.Random(seed).randbytes(nbytes)``, made in pieces (one call is limited to
    less than 256 MiB; the pieces join to the same bytes)."""
    r, piece = random.Random(seed), 64 << 20
    return b"".join(r.randbytes(min(piece, nbytes - at)) for at in range(0, nbytes, piece))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hostname", default="127.0.0.1")
    ap.add_argument("--metadata", default="P2PHANDSHAKE")
    ap.add_argument("--nbytes", type=int, default=1 << 20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--plain", action="store_true", help="register a bytearray, not a memfd buffer")
    args = ap.parse_args()
    cfg = EngineConfig.from_env()
    cfg.transports = args.transports.split(",")
    engine = TransferEngine(args.hostname, args.metadata, config=cfg)
    if args.plain:  # realloc needs a managed buffer
        keep = bytearray(args.nbytes)
        address = engine.register(keep).address
    else:
        address = engine.allocate(args.nbytes).address
    view = engine.local_view(address, args.nbytes)
    view[:] = pattern(args.seed, args.nbytes)
    print("READY " + json.dumps({"segment": engine.segment_name, "port": engine.rpc_port,
                                 "address": address, "nbytes": args.nbytes}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        try:
            if cmd[0] == "sha":
                print(hashlib.sha256(view).hexdigest(), flush=True)
            elif cmd[0] == "stats":
                print(json.dumps(engine.stats), flush=True)
            elif cmd[0] == "paths":
                print(json.dumps(engine.path_stats()), flush=True)
            elif cmd[0] == "fill":
                view[:] = pattern(int(cmd[1]), args.nbytes)
                print("ok", flush=True)
            elif cmd[0] in ("write", "read"):
                fn = engine.write if cmd[0] == "write" else engine.read
                fn(cmd[1], address, int(cmd[2]), int(cmd[3]), timeout_s=60)
                print("ok", flush=True)
            elif cmd[0] == "realloc":
                view.release()
                engine.free(address)
                address = engine.allocate(args.nbytes).address
                view = engine.local_view(address, args.nbytes)
                print(address, flush=True)
            elif cmd[0] == "quit":
                break
        except Exception as exc:  # report to the test, keep serving
            print(f"error {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
