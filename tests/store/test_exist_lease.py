"""An existence check leases what it found, as the original's ``ExistKey`` does: a reader
that has just found an object (SGLang's ``batch_exists`` -> ``batch_get_v1``) does not lose
it to ``remove_all()``, ``remove()`` without force, or eviction until the lease TTL ends."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Callable

import pytest
from mooncake_plugins.compat.store import MooncakeDistributedStore
from mooncake_plugins.errors import ObjectHasLease
from mooncake_plugins.store.client import StoreClient
from mooncake_plugins.store.master import MasterConfig, MasterService, PutConfig
from mooncake_plugins.store.server import MasterServer, ServerOptions

# This module checks leases taken by existence checks. CI's MOONCAKE_PUREPYTHON=1 pass
# leaves it out (-m 'not control_plane'): the Python fallbacks would carry only its RPC
# frames, which that pass's data-path modules and tests/security/test_master_rpc.py cover.
pytestmark = pytest.mark.control_plane

MiB = 1 << 20
# The leases of the real-master tests: the steps that must fall inside one (a few RPCs)
# have seconds to spare on a loaded machine; its end is waited for, not slept for.
LEASE_S = 3.0


@pytest.fixture
def master() -> Iterator[MasterServer]:
    """An in-process master leasing what is found for LEASE_S."""
    server = MasterServer(MasterConfig(default_kv_lease_ttl_ms=int(LEASE_S * 1000)),
                          ServerOptions(rpc_port=0))
    server.start()
    yield server
    server.close()


def removed_once_leases_end(remove_all: Callable[[], int], count: int) -> int:
    """Call ``remove_all`` until it has removed ``count`` objects in all (their leases
    ended), for at most LEASE_S + 30 s; the total removed."""
    removed, deadline = 0, time.monotonic() + LEASE_S + 30
    while removed < count and time.monotonic() < deadline:
        removed += remove_all()
        time.sleep(0.05)
    return removed


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _service(clock: Clock, seg_nbytes: int, **cfg) -> MasterService:
    m = MasterService(MasterConfig(**cfg), clock=clock)
    m.register_client("c", "h")
    m.mount_segment("c", "seg", 1 << 32, seg_nbytes)
    return m


def _put(m: MasterService, key: str, nbytes: int) -> None:
    m.put_start("c", key, nbytes, PutConfig())
    m.put_end("c", key)


def test_exist_leases_for_the_configured_ttl() -> None:
    clock = Clock()
    m = _service(clock, 8 * MiB, default_kv_lease_ttl_ms=2000)
    for key in ("one", "a", "b", "unchecked"):
        _put(m, key, 1000)
    assert m.exist("one") and m.exist_many(["a", "b", "missing"]) == [True, True, False]
    with pytest.raises(ObjectHasLease):
        m.remove("one")
    assert m.remove_all() == 1 and m.exist_many(["one", "a", "b"], lease=False) == [True] * 3
    clock.t += 1.9
    assert m.remove_all() == 0
    clock.t += 0.2   # 2 s after the checks
    assert m.remove_all() == 3 and m.stats()["objects"] == 0


def test_eviction_skips_an_object_just_found() -> None:
    clock = Clock()
    m = _service(clock, 10 * MiB, eviction_ratio=0.1)
    for key in ("old", "found", "new", "newer"):
        _put(m, key, 2 * MiB)
    assert m.exist_many(["found"]) == [True]
    _put(m, "more", 2 * MiB)   # full: evicts by LRU, "old" first, never the leased one
    _put(m, "more2", 2 * MiB)
    assert m.exist_many(["old", "found", "new"], lease=False) == [False, True, False]
    clock.t += 6   # the lease ended: it is evicted like any other
    m.exist_many(["newer", "more"])
    _put(m, "more3", 2 * MiB)
    assert m.exist_many(["found"], lease=False) == [False]


def test_client_exists_and_batch_exists_protect_from_remove_all(master) -> None:
    with StoreClient(master.address, global_segment_size=8 << 20) as c:
        c.put("single", b"1")
        assert c.exists("single")
        assert c.remove_all() == 0 and c.batch_exists(["single"]) == [True]
        assert removed_once_leases_end(c.remove_all, 1) == 1  # leased again just above
        c.batch_put(["p", "q", "r"], [b"p", b"q", b"r"])
        assert c.batch_exists(["p", "q", "missing"]) == [True, True, False]
        assert c.remove_all() == 1            # r was not checked
        with pytest.raises(ObjectHasLease):
            c.remove("p")
        assert removed_once_leases_end(c.remove_all, 2) == 2
        c.put("forced", b"f")
        assert c.exists("forced") and c.remove_all(force=True) == 1


def test_compat_is_exist_and_batch_is_exist_protect_from_remove_all(master, metadata_server) -> None:
    store = MooncakeDistributedStore()
    assert store.setup("localhost", metadata_server.url, 16 << 20, 1 << 20, "tcp", "",
                       master.address) == 0
    try:
        assert store.put_batch(["a", "b", "c"], [b"a", b"b", b"c"]) == 0
        assert store.is_exist("a") == 1 and store.batch_is_exist(["b", "zz"]) == [1, 0]
        assert store.remove_all() == 1          # c only
        assert store.remove("a") == ObjectHasLease.code
        assert removed_once_leases_end(store.remove_all, 2) == 2
        assert store.batch_is_exist(["a", "b", "c"]) == [0, 0, 0]
    finally:
        assert store.close() == 0
