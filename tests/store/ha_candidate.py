"""A master candidate in its own process, for the HA tests.

Campaigns for leadership of ``--cluster`` in etcd, prints ``READY 0`` once leader, then waits
until it is killed (SIGTERM resigns first; SIGKILL leaves the lease to expire). Exits 3 if it
loses leadership.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

from mooncake_plugins.store.ha import LeaderElection


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoints", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--address", required=True)
    ap.add_argument("--ttl", type=float, default=1.0)
    args = ap.parse_args()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    election = LeaderElection(args.endpoints, args.cluster, args.address, ttl_s=args.ttl)
    election.on_lost(lambda: os._exit(3))
    try:
        if not election.campaign(stop=done):
            return
        print("READY 0", flush=True)
        done.wait()
    finally:
        election.close()


if __name__ == "__main__":
    main()
