"""A real store master in this process, with one client and segment that puts objects
(no bytes move: the master only records them), for tests of what the router sees."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mooncake_plugins.store.kv_events import KvEventConfig
from mooncake_plugins.store.master import MasterConfig
from mooncake_plugins.store.rpc import RpcClient
from mooncake_plugins.store.server import MasterServer, ServerOptions

PUT_CONFIG = {"replica_num": 1, "preferred_segments": [], "with_soft_pin": False,
              "upsert": False}


@contextlib.contextmanager
def running_master(events: bool = False) -> Iterator[tuple[MasterServer, RpcClient]]:
    """The master and an RPC client registered as the writer ``put`` uses; ``events``:
    it publishes KV events, and serves its admin HTTP (where they are listed first)."""
    server = MasterServer(MasterConfig(), ServerOptions(
        rpc_port=0, metrics_port=0 if events else None,
        kv_events=KvEventConfig("tcp://127.0.0.1:*", "") if events else None))
    server.start()
    rpc = RpcClient("127.0.0.1", server.port)
    rpc.call("register_client", client_id="writer", host_id="h")
    rpc.call("mount_segment", client_id="writer", segment="seg", base=1 << 32, nbytes=1 << 24)
    try:
        yield server, rpc
    finally:
        rpc.close()
        server.close()


def put(rpc: RpcClient, keys: list[str]) -> None:
    """Record ``keys`` as complete objects of 64 bytes."""
    rpc.call("put_start", client_id="writer", keys=keys, sizes=[64] * len(keys),
             config=PUT_CONFIG)
    rpc.call("put_end", client_id="writer", keys=keys)
