"""A client following an HA master: one thread fails over, no lock is held while it waits."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Callable, Iterator

import pytest
from helpers import free_port, wait_until

from mooncake_plugins.errors import MooncakeError
from mooncake_plugins.store.client import StoreClient
from mooncake_plugins.store.ha import LeaderWaitTimeout
from mooncake_plugins.store.master import MasterConfig
from mooncake_plugins.store.server import MasterServer, ServerOptions

# This module checks clients following a new leader. CI's MOONCAKE_PUREPYTHON=1 pass leaves
# it out (-m 'not control_plane'): the Python fallbacks would carry only its RPC frames,
# which that pass's data-path modules and tests/security/test_master_rpc.py cover.
pytestmark = [pytest.mark.control_plane, pytest.mark.exclusive]

LONG_FAILOVER_S = 15.0
SHORT_FAILOVER_S = 4.0


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
    master = f"etcd://{ha_masters.endpoints}"
    # a long failover timeout: waking "at once" and "at close" are told apart from it
    client = StoreClient(master, cluster_id=ha_masters.cluster, global_segment_size=1 << 20,
                         rpc_timeout_s=2, failover_timeout_s=LONG_FAILOVER_S)
    short = None
    try:
        client.put("k", b"v")
        first.close()  # resigns: no leader until the next one starts

        # Two threads fail over at once; both go on as soon as a new leader serves.
        calls = [_Call(lambda: client.exists("k")) for _ in range(2)]
        assert wait_until(lambda: client._failover_run is not None, 10)
        assert all(c.thread.is_alive() for c in calls)
        second = ha_masters()
        elected = time.monotonic()
        # the new leader starts from what the first one wrote to etcd: "k" is still there
        assert [c.join(LONG_FAILOVER_S + 5) for c in calls] == [True, True]
        assert max(c.ended for c in calls) - elected < LONG_FAILOVER_S / 3
        assert client.master_address == second.address

        # No leader comes: every waiting thread gets the one failover's error, after one
        # timeout (not one timeout each, one after the other).
        short = StoreClient(master, cluster_id=ha_masters.cluster, global_segment_size=0,
                            rpc_timeout_s=2, failover_timeout_s=SHORT_FAILOVER_S)
        second.close()
        started = time.monotonic()
        calls = [_Call(lambda: short.exists("k")) for _ in range(3)]
        results = [c.join(3 * SHORT_FAILOVER_S + 10) for c in calls]
        assert all(isinstance(r, LeaderWaitTimeout) for r in results), results
        assert max(c.ended for c in calls) - started < 2 * SHORT_FAILOVER_S

        # close() while a call waits for a leader: both end at once.
        waiting = _Call(lambda: client.exists("k"))
        assert wait_until(lambda: client._failover_run is not None, 10)
        closing = time.monotonic()
        client.close()
        assert time.monotonic() - closing < LONG_FAILOVER_S / 3
        assert isinstance(waiting.join(LONG_FAILOVER_S), MooncakeError)
        assert waiting.ended - closing < LONG_FAILOVER_S / 3
    finally:
        client.close()
        if short is not None:
            short.close()


@pytest.mark.etcd
def test_a_broken_connection_to_a_live_leader_is_mended(ha_masters) -> None:
    """A call that fails while the leader lives on (no new term comes) goes back to that
    leader after a short wait, instead of waiting for another leader until it times out."""
    leader = ha_masters()
    with StoreClient(f"etcd://{ha_masters.endpoints}", cluster_id=ha_masters.cluster,
                     global_segment_size=1 << 20, rpc_timeout_s=2,
                     failover_timeout_s=LONG_FAILOVER_S) as client:
        client.put("k", b"v")
        client._rpc.close()   # its connection is gone; the master is not
        started = time.monotonic()
        assert client.exists("k")
        assert time.monotonic() - started < LONG_FAILOVER_S / 3
        assert client.master_address == leader.address
