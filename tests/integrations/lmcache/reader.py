"""A second LMCache worker process: builds its own storage backends with our connector,
looks up and fetches chunks another process stored, and prints one JSON line:
``{"contains": n, "digests": [sha256 or null, ...], "shapes": [...]}``.

Usage: ``python reader.py <master address> <nchunks> [<extra chunk index>...]``
"""

from __future__ import annotations

import json
import sys

import lmc


def main() -> None:
    address, n = sys.argv[1], int(sys.argv[2])
    extra = [int(x) for x in sys.argv[3:]]
    backends = lmc.Backends(lmc.config(["mooncake_plugins"], lmc.ours(address)))
    try:
        keys = [lmc.key(i) for i in list(range(n)) + extra]
        hits = backends.remote.batched_contains(keys)
        objs = backends.remote.batched_get_blocking(keys)
        out = {"contains": hits,
               "digests": [lmc.digest(o) if o is not None else None for o in objs],
               "shapes": [list(o.meta.shape) if o is not None else None for o in objs]}
        for o in objs:
            if o is not None:
                o.ref_count_down()
    finally:
        backends.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
