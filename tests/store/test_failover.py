"""A client following an HA master: one thread fails over, no lock is held while it waits."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Callable, Iterator

import pytest
from helpers import free_port

from mooncake_plugins.errors import MooncakeError
from mooncake_plugins.store.client import StoreClient
from mooncake_plugins.store.ha import LeaderWaitTimeout
from mooncake_plugins.store.master import MasterConfig
from mooncake_plugins.store.server import MasterServer, ServerOptions

FAILOVER_TIMEOUT_S = 4.0


class _Call:
    """``fn()`` in a thread: ``result`` (value or exception) and when it ended."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.result: object = None
        self.ended = 0.0
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            self.result = fn()
        except Exception as exc:
            self.result = exc
        self.ended = time.monotonic()

    def join(self, timeout_s: float) -> object:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"call still running after {timeout_s} s"
        return self.result


@pytest.fixture
def ha_masters(etcd_server: str) -> Iterator[Callable[[], MasterServer]]:
    """Factory of in-process HA masters of one fresh cluster (``.endpoints``, ``.cluster``)."""
    endpoints = etcd_server.split("://", 1)[1]
    cluster = f"failover-{uuid.uuid4().hex[:8]}"
    started: list[MasterServer] = []

    def start() -> MasterServer:
        server = MasterServer(MasterConfig(), ServerOptions(
            rpc_port=free_port(), enable_ha=True, etcd_endpoints=endpoints, cluster_id=cluster))
        started.append(server)
        assert server.start()
        return server

    start.endpoints, start.cluster = endpoints, cluster  # type: ignore[attr-defined]
    yield start
    for server in started:
        server.close()


@pytest.mark.etcd
def test_failover_is_shared_and_does_not_hold_up_close(ha_masters) -> None:
    first = ha_masters()
    client = StoreClient(f"etcd://{ha_masters.endpoints}", cluster_id=ha_masters.cluster,
                         global_segment_size=1 << 20, rpc_timeout_s=2,
                         failover_timeout_s=FAILOVER_TIMEOUT_S)
    try:
        client.put("k", b"v")
        first.close()  # resigns: no leader until the next one starts

        # Two threads fail over at once; both go on as soon as a new leader serves.
        calls = [_Call(lambda: client.exists("k")) for _ in range(2)]
        time.sleep(0.3)
        assert all(c.thread.is_alive() for c in calls)
        second = ha_masters()
        elected = time.monotonic()
        # the new leader starts from what the first one wrote to etcd: "k" is still there
        assert [c.join(FAILOVER_TIMEOUT_S + 5) for c in calls] == [True, True]
        assert max(c.ended for c in calls) - elected < 2.0
        assert client.master_address == second.address

        # No leader comes: every waiting thread gets the one failover's error, after one
        # timeout (not one timeout each, one after the other).
        second.close()
        started = time.monotonic()
        calls = [_Call(lambda: client.exists("k")) for _ in range(3)]
        results = [c.join(FAILOVER_TIMEOUT_S + 10) for c in calls]
        assert all(isinstance(r, LeaderWaitTimeout) for r in results), results
        assert max(c.ended for c in calls) - started < FAILOVER_TIMEOUT_S + 2.0

        # close() while a call waits for a leader: both end at once.
        waiting = _Call(lambda: client.exists("k"))
        time.sleep(0.3)
        assert waiting.thread.is_alive()
        closing = time.monotonic()
        client.close()
        assert time.monotonic() - closing < 2.0
        assert isinstance(waiting.join(2.0), MooncakeError)
        assert waiting.ended - closing < 2.0
    finally:
        client.close()
