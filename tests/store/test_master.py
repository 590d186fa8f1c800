"""MasterService logic with a fake clock: visibility, placement, leases, eviction, liveness."""

import pytest

from mooncake_plugins.errors import (ClientNotFound, InvalidKey, InvalidParams, NoAvailableSpace,
                                     ObjectAlreadyExists, ObjectHasLease, ObjectNotFound,
                                     ReplicaNotReady, SegmentAlreadyExists, StoreSegmentNotFound)
from mooncake_plugins.store.allocation import OffsetAllocator
from mooncake_plugins.store.master import MasterConfig, MasterService, PutConfig

# This module checks the master's metadata service. CI's MOONCAKE_PUREPYTHON=1 pass leaves
# it out (-m 'not control_plane'): the Python fallbacks would carry only its RPC frames,
# which that pass's data-path modules and tests/security/test_master_rpc.py cover.
pytestmark = pytest.mark.control_plane

MiB = 1 << 20


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def clock():
    return Clock()


def service(clock, nsegs=3, seg_nbytes=8 * MiB, **cfg):
    m = MasterService(MasterConfig(**cfg), clock=clock)
    for i in range(nsegs):
        m.register_client(f"c{i}", f"host{i}")
        m.mount_segment(f"c{i}", f"seg{i}", (i + 1) << 32, seg_nbytes)
    return m


def put(m, key, nbytes, client="c0", **cfg):
    replicas = m.put_start(client, key, nbytes, PutConfig(**cfg))
    m.put_end(client, key)
    return replicas


def test_put_is_invisible_until_put_end(clock):
    m = service(clock)
    m.put_start("c0", "k", 100, PutConfig())
    assert not m.exist("k")
    with pytest.raises(ReplicaNotReady):
        m.get("k")
    with pytest.raises(ObjectAlreadyExists):
        m.put_start("c1", "k", 100, PutConfig())
    m.put_end("c0", "k")
    assert m.exist("k")
    nbytes, replicas, disk, ttl = m.get("k")
    assert nbytes == 100 and len(replicas) == 1 and disk is None and ttl == 5.0


def test_revoke_frees_space(clock):
    m = service(clock, nsegs=1)
    m.put_start("c0", "k", 4 * MiB, PutConfig())
    assert m.stats()["used_bytes"] == 4 * MiB
    m.put_revoke("c0", "k")
    assert m.stats()["used_bytes"] == 0 and not m.exist("k")
    with pytest.raises(ObjectNotFound):
        m.put_end("c0", "k")


def test_replicas_on_distinct_segments(clock):
    m = service(clock, nsegs=3)
    replicas = put(m, "k", 1000, replica_num=3)
    segs = [shard[0] for r in replicas for shard in r]
    assert sorted(segs) == ["seg0", "seg1", "seg2"]
    # more replicas than segments: best effort, one per segment
    assert len(put(m, "k2", 1000, replica_num=5)) == 3


def test_large_objects_are_striped(clock):
    m = service(clock, nsegs=3, stripe_nbytes=1 * MiB)
    (replica,) = put(m, "big", 3 * MiB + 5)
    assert len(replica) == 3 and len({s[0] for s in replica}) == 3
    assert sum(s[2] for s in replica) == 3 * MiB + 5


def test_striping_never_costs_a_replica(clock):
    # the first replica striped over both segments left none for the second: a put of
    # 2 replicas on 2 hosts kept 1, though each segment had room for a whole copy
    m = service(clock, nsegs=2, stripe_nbytes=1 * MiB)
    replicas = put(m, "two", 3 * MiB, replica_num=2)
    assert len(replicas) == 2 and sorted(s[0] for r in replicas for s in r) == ["seg0", "seg1"]
    m = service(clock, nsegs=4, stripe_nbytes=1 * MiB)
    replicas = put(m, "wide", 3 * MiB, replica_num=2)   # striped over 3, whole on the 4th
    assert sorted(len(r) for r in replicas) == [1, 3]
    assert len({s[0] for r in replicas for s in r}) == 4
    # too large for any one segment: striped over both, the one replica that fits
    m = service(clock, nsegs=2, seg_nbytes=2 * MiB, stripe_nbytes=1 * MiB)
    (replica,) = put(m, "big", 3 * MiB, replica_num=2)
    assert len(replica) == 2


def test_preferred_and_local_first(clock):
    m = service(clock, allocation_strategy="local_first")
    (replica,) = put(m, "a", 100, client="c2")
    assert replica[0][0] == "seg2"  # the writer's host
    (replica,) = put(m, "b", 100, client="c2", preferred_segments=["seg1"])
    assert replica[0][0] == "seg1"


def test_lru_eviction_skips_leased_and_soft_pinned(clock):
    m = service(clock, nsegs=1, seg_nbytes=10 * MiB, eviction_ratio=0.1)
    put(m, "leased", 2 * MiB)  # the least recently used object: LRU order alone would evict it
    put(m, "pinned", 2 * MiB, with_soft_pin=True)
    put(m, "old", 2 * MiB)
    put(m, "new", 2 * MiB)
    # exist() grants a read lease (5 s) without making "leased" most recently used (get would)
    assert m.exist("leased")

    def present(*keys):  # looks only: no lease is granted or extended
        return m.exist_many(list(keys), lease=False)

    put(m, "more", 2 * MiB)  # 10 MiB full -> evict one: "leased" is first in LRU order but leased
    assert present("leased", "pinned", "old", "new", "more") == [True, True, False, True, True]
    assert m.stats()["evicted"] == 1
    clock.t += 6  # the lease has ended: "leased" is the LRU victim now, ahead of "new"
    put(m, "more2", 2 * MiB)
    assert present("leased", "pinned", "new", "more", "more2") == [False, True, True, True, True]
    assert m.stats()["evicted"] == 2


def test_soft_pinned_go_last_and_only_if_allowed(clock):
    m = service(clock, nsegs=1, seg_nbytes=4 * MiB, allow_evict_soft_pinned_objects=False)
    put(m, "p1", 2 * MiB, with_soft_pin=True)
    put(m, "p2", 2 * MiB, with_soft_pin=True)
    with pytest.raises(NoAvailableSpace):
        put(m, "x", 2 * MiB)
    m2 = service(clock, nsegs=1, seg_nbytes=10 * MiB)
    put(m2, "p1", 2 * MiB, with_soft_pin=True)
    put(m2, "p2", 2 * MiB, with_soft_pin=True)
    put(m2, "u1", 2 * MiB)
    put(m2, "x", 4 * MiB)  # over the watermark: u1 first, then the oldest pinned one
    assert [m2.exist(k) for k in ("u1", "p1", "p2", "x")] == [False, False, True, True]


def test_lease_blocks_remove_and_defers_reuse(clock):
    m = service(clock, nsegs=1, seg_nbytes=4 * MiB)
    put(m, "k", 4 * MiB)
    m.get("k")
    with pytest.raises(ObjectHasLease):
        m.remove("k")
    m.remove("k", force=True)  # gone from the index, space still reserved for the reader
    with pytest.raises(NoAvailableSpace):
        put(m, "k2", 4 * MiB)
    clock.t += 6
    m.reap()
    put(m, "k2", 4 * MiB)


def test_upsert_keeps_old_version_until_put_end(clock):
    m = service(clock, nsegs=1)
    put(m, "k", 100)
    m.put_start("c0", "k", 200, PutConfig(upsert=True))
    assert m.get("k")[0] == 100
    m.put_end("c0", "k")
    assert m.get("k")[0] == 200


def test_dead_client_drops_its_replicas_others_survive(clock):
    m = service(clock, nsegs=3, client_ttl_s=10)
    put(m, "two", 1000, replica_num=2, preferred_segments=["seg0", "seg1"])
    put(m, "one", 1000, preferred_segments=["seg0"])
    clock.t += 5
    m.heartbeat("c1")
    m.heartbeat("c2")
    clock.t += 6
    m.reap()  # c0 silent for 11 s
    assert m.exist("two") and not m.exist("one")
    _, replicas, _, _ = m.get("two")
    assert [r[0][0] for r in replicas] == ["seg1"]
    with pytest.raises(ClientNotFound):
        m.heartbeat("c0")
    assert m.stats()["expired_clients"] == 1


def test_dead_segment_frees_the_other_shards_of_its_replicas(clock):
    """Found by the model test: shards on living segments leaked when a segment died."""
    m = service(clock, nsegs=2, seg_nbytes=MiB, stripe_nbytes=4096, client_ttl_s=10,
                default_kv_lease_ttl_ms=60_000)
    put(m, "removed", 8192)                  # both striped over seg0 and seg1
    put(m, "read", 8192)
    m.get("removed")
    m.get("read")                            # leases for 60 s
    m.remove("removed", force=True)          # its space waits for the lease
    clock.t += 5
    m.heartbeat("c0")
    clock.t += 6
    m.reap()                                 # c1 silent for 11 s: seg1 goes, both objects too
    assert not m.exist("read") and m.stats()["segments"] == 1
    assert m.stats()["used_bytes"] == 8192   # the seg0 shards wait for the readers' leases
    clock.t += 50
    m.heartbeat("c0")
    m.reap()
    assert m.stats()["used_bytes"] == 0


def test_abandoned_put_is_discarded(clock):
    m = service(clock, nsegs=1, put_start_discard_timeout_s=30, client_ttl_s=100)
    m.put_start("c0", "k", 1000, PutConfig())
    clock.t += 31
    m.reap()
    assert m.stats()["used_bytes"] == 0
    put(m, "k", 1000, client="c0")


def test_regex_and_remove_all(clock):
    m = service(clock)
    for k in ("a/1", "a/2", "b/1"):
        put(m, k, 10)
    assert m.remove_by_regex(r"^a/") == 2
    assert m.remove_all() == 1
    with pytest.raises(InvalidParams):
        m.remove_by_regex("(")


def test_bad_inputs(clock):
    m = service(clock)
    for key in ("", "x" * 5000, 5, None):
        with pytest.raises(InvalidKey):
            m.put_start("c0", key, 10, PutConfig())
    for n in (0, -1, 1 << 50, "10"):
        with pytest.raises(InvalidParams):
            m.put_start("c0", "k", n, PutConfig())
    with pytest.raises(InvalidParams):
        m.put_start("c0", "k", 10, PutConfig(replica_num=0))
    with pytest.raises(ClientNotFound):
        m.put_start("nobody", "k", 10, PutConfig())
    with pytest.raises(SegmentAlreadyExists):
        m.mount_segment("c0", "seg0", 0, 1 << 20)
    with pytest.raises(StoreSegmentNotFound):
        m.unmount_segment("c1", "seg0")
    with pytest.raises(ObjectNotFound):
        m.get("missing")
    with pytest.raises(NoAvailableSpace):
        m.put_start("c0", "huge", 100 * MiB, PutConfig())
    empty = MasterService(MasterConfig(), clock=clock)
    empty.register_client("c", "h")
    with pytest.raises(StoreSegmentNotFound):
        empty.put_start("c", "k", 10, PutConfig())


def test_offset_allocator_coalesces():
    a = OffsetAllocator(1024)
    x, y, z = a.allocate(256), a.allocate(256), a.allocate(512)
    assert (x, y, z) == (0, 256, 512) and a.allocate(1) is None
    a.free(256, 256)
    a.free(0, 256)
    assert a.allocate(512) == 0
    a.free(0, 512)
    a.free(512, 512)
    assert a.largest_free == 1024 and a.used == 0
    with pytest.raises(InvalidParams):
        a.free(0, 64)  # double free


def test_keys_with_suffix_and_peek_take_no_lease(clock):
    m = service(clock)
    for k in ("vllm/m/L/tp0of2/ab12", "vllm/m/L/tp1of2/ab12", "vllm/m/L/tp0of2/cd34"):
        put(m, k, 10)
    m.put_start("c0", "half/ab12", 10, PutConfig())   # not complete: never listed
    assert sorted(m.keys_with_suffix("/ab12", 10)) == ["vllm/m/L/tp0of2/ab12",
                                                        "vllm/m/L/tp1of2/ab12"]
    assert len(m.keys_with_suffix("/ab12", 1)) == 1
    assert m.keys_with_suffix("/ef56", 10) == []
    assert len(m.keys_with_suffix("", 2)) == 2 and len(m.keys_with_suffix("", 10)) == 3
    assert sorted(m.keys_containing("tp0of2/", 10)) == ["vllm/m/L/tp0of2/ab12",
                                                         "vllm/m/L/tp0of2/cd34"]
    assert m.keys_containing("half", 10) == []   # not complete
    with pytest.raises(InvalidParams):
        m.keys_containing("/ab12", 0)
    for suffix, limit in (("/ab12", 0), ("/ab12", 1001)):
        with pytest.raises(InvalidParams):
            m.keys_with_suffix(suffix, limit)
    # looking (a router's probe) leaves no lease: the object can be removed at once
    assert m.exist_many(["vllm/m/L/tp0of2/cd34", "nope"], lease=False) == [True, False]
    m.remove("vllm/m/L/tp0of2/cd34")
    assert m.exist("vllm/m/L/tp0of2/ab12")
    with pytest.raises(ObjectHasLease):
        m.remove("vllm/m/L/tp0of2/ab12")


def test_keys_with_suffix_scans_without_holding_the_lock(clock):
    """The scan runs on a copy of the key list: another thread can take the master's lock
    while keys are being compared (it once held it through the whole scan, and with
    300k objects every other call waited about 130 ms)."""
    import threading

    m = service(clock)
    free_while_scanning: list[bool] = []

    def lock_free() -> bool:
        got: list[bool] = []

        def probe() -> None:
            got.append(m._lock.acquire(blocking=False))
            if got[0]:
                m._lock.release()

        t = threading.Thread(target=probe)
        t.start()
        t.join()
        return got[0]

    class ProbingKey(str):
        def endswith(self, suffix, *args):   # called by the scan for every key
            free_while_scanning.append(lock_free())
            return str.endswith(self, suffix, *args)

    put(m, ProbingKey("vllm/m/L/tp0of1/ab12"), 10)
    put(m, "vllm/m/L/tp0of1/cd34", 10)
    assert m.keys_with_suffix("/ab12", 10) == ["vllm/m/L/tp0of1/ab12"]
    assert free_while_scanning == [True]
