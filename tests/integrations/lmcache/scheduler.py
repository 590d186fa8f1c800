"""LMCache's scheduler process, built as LMCache's vLLM service factory builds it for role
``scheduler``: with ``enable_scheduler_bypass_lookup`` an ``LMCacheEngine`` (no GPU
connector, pass-through broadcasts) and its ``post_init`` (storage manager and backends);
then the lookup client ``LookupClientFactory`` picks for the config (the bypass client
over that engine, or an ``external_lookup_client``).

Usage: ``python scheduler.py <json config fields>`` (``LMCacheEngineConfig`` fields on
top of ``lmc.config``'s). Prints ``READY {"backends", "connector", "lookup_only",
"registered", "mounted"}`` (the engine's backends, its remote connector's class, whether
that is lookup-only, how many buffers it registered, whether it lent the store a
segment; null without an engine), then answers ``lookup <token,...>`` with the number of
leading tokens the store holds, and exits on ``quit``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import lmc
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.lookup_client.factory import LookupClientFactory

ENGINE = "lmcache-scheduler"


def describe(engine: LMCacheEngine | None) -> dict[str, Any]:
    if engine is None:
        return {"backends": None, "connector": None, "lookup_only": None,
                "registered": None, "mounted": None}
    backends = engine.storage_manager.storage_backends
    remote = backends.get("RemoteBackend")
    conn = remote.connection.getWrappedConnector() if remote and remote.connection else None
    io = getattr(conn, "io", None)
    return {"backends": list(backends), "connector": type(conn).__name__,
            "lookup_only": getattr(conn, "lookup_only", None),
            "registered": io.region_count if io else None,
            "mounted": io.client._segment is not None if io else None}


def main() -> None:
    fields = json.loads(sys.argv[1])
    cfg = lmc.config(fields.pop("remote_storage_plugins", []), fields.pop("extra_config"),
                     **fields)
    md = lmc.metadata(role="scheduler")
    engine = None
    if cfg.enable_scheduler_bypass_lookup:
        engine = LMCacheEngineBuilder.get_or_create(ENGINE, cfg, md, None, lambda t, src: t,
                                                    lambda o, src: o)
    try:
        if engine is not None:
            engine.post_init()
        client = LookupClientFactory.create_lookup_client(cfg, md, engine)
        print("READY " + json.dumps(describe(engine)), flush=True)
        for n, line in enumerate(sys.stdin):
            cmd = line.split()
            if cmd == ["quit"]:
                break
            tokens = [int(t) for t in cmd[1].split(",")]
            print(client.lookup(tokens, lookup_id=f"req-{n}"), flush=True)
            if engine is not None:
                engine.lookup_unpin(f"req-{n}")
        client.close()
    finally:
        if engine is not None:
            LMCacheEngineBuilder.destroy(ENGINE)


if __name__ == "__main__":
    main()
