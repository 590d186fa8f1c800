"""A second SGLang server's storage side: builds our backend through SGLang's factory
over a fresh host pool, looks up and reads pages another process stored, and prints one
JSON line: ``{"hits": n, "ok": [bool, ...], "digests": [sha256, ...]}``.

Usage: ``python reader.py <master address> <layout> <key> [<key>...]``
"""

from __future__ import annotations

import json
import sys

import pools
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

import mooncake_sglang


def main() -> None:
    address, layout, keys = sys.argv[1], sys.argv[2], sys.argv[3:]
    extra = mooncake_sglang.dynamic_extra_config(master_server_address=address,
                                                 global_segment_size=0,
                                                 interface_v1=int(layout != "layer_first"))
    pool = pools.host_pool(layout)
    backend = StorageBackendFactory.create_backend("dynamic", pools.storage_config(extra, layout),
                                                   pool)
    try:
        backend.register_mem_pool_host(pool)
        backend.on_host_pools_registered()
        hits = backend.batch_exists(keys)
        pool.alloc(8)  # other pages than the writer used
        dst = pool.alloc(len(keys) * pools.PAGE)
        ok = pools.read_pages(backend, pool, keys, dst)
        print(json.dumps({"hits": hits, "ok": ok, "digests": pools.page_digests(pool, dst)}),
              flush=True)
    finally:
        backend.close()


if __name__ == "__main__":
    main()
