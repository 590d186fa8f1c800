"""The remote side of the engine state machine: a segment whose memory the test drives.

Prints ``READY <json>`` (segment name, pid), then answers one JSON line per command line:
``alloc N`` / ``reg N`` (a managed buffer / a registered bytearray; answers the address),
``free A`` / ``unreg A``, ``fill A SEED`` (the process's own write into its region),
``sha A`` (sha256 of the region), ``reset`` (release everything), ``count`` (regions and
open fds), ``quit``. Errors answer ``{"error": "<type>: <message>"}`` and keep serving.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.transfer import TransferEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transports", default="shm,tcp")
    args = ap.parse_args()
    engine = TransferEngine("127.0.0.1", config=EngineConfig(transports=args.transports.split(",")))
    managed: dict[int, object] = {}
    plain: dict[int, tuple[object, bytearray]] = {}
    print("READY " + json.dumps({"segment": engine.segment_name, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        try:
            op = cmd[0]
            if op == "quit":
                break
            if op == "alloc":
                buf = engine.allocate(int(cmd[1]))
                managed[buf.address] = buf
                out: object = buf.address
            elif op == "reg":
                data = bytearray(int(cmd[1]))
                region = engine.register(data)
                plain[region.address] = (region, data)
                out = region.address
            elif op == "free":
                engine.free(managed.pop(int(cmd[1])))
                out = "ok"
            elif op == "unreg":
                region, _ = plain.pop(int(cmd[1]))
                engine.unregister(region)
                out = "ok"
            elif op in ("fill", "sha"):
                address = int(cmd[1])
                nbytes = managed[address].nbytes if address in managed else len(plain[address][1])
                with engine.local_view(address, nbytes) as view:
                    if op == "fill":
                        view[:] = random.Random(int(cmd[2])).randbytes(nbytes)
                        out = "ok"
                    else:
                        out = hashlib.sha256(view).hexdigest()
            elif op == "reset":
                for address in list(managed):
                    engine.free(managed.pop(address))
                for address in list(plain):
                    engine.unregister(plain.pop(address)[0])
                out = "ok"
            elif op == "count":
                out = {"regions": len(engine.regions()), "fds": len(os.listdir("/proc/self/fd"))}
            else:
                raise ValueError(f"unknown command {op!r}")
            print(json.dumps({"ok": out}), flush=True)
        except Exception as exc:  # report to the test, keep serving
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
