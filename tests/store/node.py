"""A store client in its own process, driven over stdin/stdout by the tests.

Prints ``READY <json>`` (segment name) once its segment is mounted, then answers one line
per command: ``put <key> <seed> <nbytes> [replicas]``, ``get <key>`` (sha256 or
``error <Type>``), ``exists <key>``, ``remove <key>``, ``begin <key> <nbytes>`` (put_start
only: the put stays in flight), ``stats``, ``quit``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys

from mooncake_plugins.store.client import ReplicateConfig, StoreClient


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--master", required=True)
    ap.add_argument("--segment", type=int, default=32 << 20)
    ap.add_argument("--metadata", default="P2PHANDSHAKE")
    ap.add_argument("--cluster_id", default="mooncake")
    args = ap.parse_args()
    client = StoreClient(args.master, metadata_server=args.metadata, global_segment_size=args.segment,
                         cluster_id=args.cluster_id)
    print("READY " + json.dumps({"segment": client.segment_name}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        try:
            if cmd[0] == "put":
                data = random.Random(int(cmd[2])).randbytes(int(cmd[3]))
                replicas = int(cmd[4]) if len(cmd) > 4 else 1
                client.put(cmd[1], data, ReplicateConfig(replica_num=replicas))
                print("ok", flush=True)
            elif cmd[0] == "get":
                print(hashlib.sha256(client.get(cmd[1])).hexdigest(), flush=True)
            elif cmd[0] == "exists":
                print(int(client.exists(cmd[1])), flush=True)
            elif cmd[0] == "remove":
                client.remove(cmd[1])
                print("ok", flush=True)
            elif cmd[0] == "begin":
                code, info = client.call_master(
                    "put_start", client_id=client.client_id, keys=[cmd[1]], sizes=[int(cmd[2])],
                    config=ReplicateConfig().to_wire(False))[0]
                print("ok" if code == 0 else f"error {info}", flush=True)
            elif cmd[0] == "stats":
                print(json.dumps(client.stats()), flush=True)
            elif cmd[0] == "quit":
                break
        except Exception as exc:  # report to the test, keep serving
            print(f"error {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
    client.close()


if __name__ == "__main__":
    main()
