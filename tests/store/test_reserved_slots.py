"""Slots reserved ahead for one-round-trip small puts (MasterService.reserve/put_reserved),
with a fake clock: what a slot becomes, who may use it, and that its space always returns."""

import pytest

from mooncake_plugins.errors import (InvalidParams, NoAvailableSpace, ObjectAlreadyExists,
                                     ObjectNotFound, UnavailableInCurrentStatus)
from mooncake_plugins.store.master import (MAX_CLIENT_SLOT_NBYTES, MasterConfig, MasterService,
                                           PutConfig)

MiB = 1 << 20
SEG = 64 * MiB


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def service(clock: Clock, nsegs: int = 2, seg_nbytes: int = SEG, **cfg) -> MasterService:
    m = MasterService(MasterConfig(**cfg), clock=clock)
    for i in range(nsegs):
        m.register_client(f"c{i}", f"host{i}")
        m.mount_segment(f"c{i}", f"seg{i}", (i + 1) << 32, seg_nbytes)
    return m


def balance(m: MasterService) -> tuple[int, int]:
    st = m.stats()
    return st["used_bytes"], st["reserved_bytes"]


def test_a_slot_becomes_the_object_and_its_space_is_accounted_once():
    m = service(Clock())
    (rid, replicas), = m.reserve("c0", 4096, 2, 1)
    assert len(replicas) == 2 and {r[0][0] for r in replicas} == {"seg0", "seg1"}
    assert balance(m) == (0, 2 * 4096)
    m.put_reserved("c0", "k", rid, PutConfig())
    nbytes, got, _, _ = m.get("k")
    assert nbytes == 4096 and got == replicas
    assert balance(m) == (2 * 4096, 0) and m.stats()["reserved_puts"] == 1
    with pytest.raises(ObjectNotFound):   # used up
        m.put_reserved("c0", "k2", rid, PutConfig())
    m.remove("k", force=True)
    assert balance(m) == (2 * 4096, 0)   # freed once the read lease of get() ended
    m._clock.t += 10
    m.reap()
    assert balance(m) == (0, 0)


def test_only_the_client_it_was_reserved_for_can_use_a_slot():
    m = service(Clock())
    (rid, _), = m.reserve("c0", 100, 1, 1)
    with pytest.raises(ObjectNotFound):
        m.put_reserved("c1", "k", rid, PutConfig())
    with pytest.raises(ObjectNotFound):
        m.put_reserved("c0", "k", rid + 12345, PutConfig())
    m.put_reserved("c0", "k", rid, PutConfig())   # still the owner's
    assert m.exist_many(["k"], lease=False) == [True]


def test_a_refused_put_frees_its_slot_and_leaves_the_object_alone():
    m = service(Clock())
    (first, _), (second, _), (third, _) = m.reserve("c0", 512, 1, 3)
    m.put_reserved("c0", "k", first, PutConfig())
    with pytest.raises(ObjectAlreadyExists):
        m.put_reserved("c0", "k", second, PutConfig())
    with pytest.raises(InvalidParams):
        m.put_reserved("c0", "x", third, PutConfig(soft_pin_ttl_ms=-1))
    assert balance(m) == (512, 0)
    m.put_start("c1", "busy", 100, PutConfig())     # being written by a put in flight
    (fourth, _), = m.reserve("c0", 512, 1, 1)
    with pytest.raises(ObjectAlreadyExists):
        m.put_reserved("c0", "busy", fourth, PutConfig(upsert=True))
    (fifth, replicas), = m.reserve("c0", 512, 1, 1)
    m.put_reserved("c0", "k", fifth, PutConfig(upsert=True))   # upsert replaces
    assert m.get("k")[1] == replicas and balance(m) == (512 + 128, 0)  # 64-byte aligned


def test_requests_are_validated():
    m = service(Clock())
    for args in [(0, 1, 1), (65537, 1, 1), (100, 0, 1), (100, 17, 1), (100, 1, -1), (100, 1, 65),
                 ("100", 1, 1), (100, 1.0, 1)]:
        with pytest.raises(InvalidParams):
            m.reserve("c0", *args)
    assert m.reserve("c0", 100, 1, 0) == []


def test_a_client_holds_at_most_its_share_of_the_pool():
    m = service(Clock(), nsegs=1, seg_nbytes=16 * MiB)   # share: 16 MiB / 16 = 1 MiB
    got = [s for _ in range(40) for s in m.reserve("c0", 64 << 10, 1, 64)]
    assert len(got) == 16 and balance(m) == (0, MiB)
    big = service(Clock(), nsegs=1, seg_nbytes=1 << 30)  # ... and at most 4 MiB
    assert len([s for _ in range(3) for s in big.reserve("c0", 64 << 10, 1, 64)]) \
        == MAX_CLIENT_SLOT_NBYTES // (64 << 10)


def test_slots_gather_at_the_top_of_a_segment_so_large_objects_still_fit():
    m = service(Clock(), nsegs=1, seg_nbytes=8 * MiB)
    m.put_start("c0", "held", 4 * MiB, PutConfig())       # lower half taken meanwhile
    slots = m.reserve("c0", 4096, 1, 16)
    assert all(r[0][1] >= (1 << 32) + 8 * MiB - 16 * 4096 for _, (r,) in slots)
    m.put_revoke("c0", "held")
    m.put_start("c0", "big", 6 * MiB, PutConfig())         # one free run of 8 MiB - 64 KiB


def test_unused_slots_expire_and_clients_and_segments_take_theirs_along():
    clock = Clock()
    m = service(clock, nsegs=3, put_start_discard_timeout_s=30)
    m.reserve("c0", 4096, 1, 4)
    clock.t += 20
    young = m.reserve("c0", 4096, 1, 2)
    clock.t += 11                 # the first four are 31 s old
    for c in ("c0", "c1", "c2"):
        m.heartbeat(c)
    m.reap()
    assert m.stats()["reserved_slots"] == 2
    m.reserve("c1", 4096, 1, 3)
    m.unregister_client("c1")     # closes: its slots go at once, and c0's on its segment
    assert m.stats()["reserved_slots"] == sum(reps[0][0][0] != "seg1" for _, reps in young)
    m.reserve("c0", 4096, 1, 2 - m.stats()["reserved_slots"])
    assert m.stats()["reserved_slots"] == 2
    clock.t += 100                 # c0 silent: it expires with its slots
    m.reap()
    assert m.stats()["reserved_slots"] == 0 and balance(m) == (0, 0)


def test_a_slot_with_a_shard_on_a_segment_that_goes_is_dropped_whole():
    clock = Clock()
    m = service(clock, nsegs=2, seg_nbytes=64 * 4096, put_start_discard_timeout_s=30)
    pairs = m.reserve("c0", 4096, 2, 8)      # one replica on each segment
    assert len(pairs) == 4                   # the client's share: 1/16 of 512 KiB
    assert all({r[0][0] for r in reps} == {"seg0", "seg1"} for _, reps in pairs)
    m.unmount_segment("c1", "seg1")
    assert m.stats()["reserved_slots"] == 0
    with pytest.raises(ObjectNotFound):
        m.put_reserved("c0", "k", pairs[0][0], PutConfig())
    # c0 may still be writing into the seg0 halves: that space is not handed out again
    # until the slots could no longer be used
    with pytest.raises(NoAvailableSpace):
        m.put_start("c0", "x", 64 * 4096, PutConfig())   # the whole of seg0
    clock.t += 31
    m.heartbeat("c0")
    m.reap()
    assert balance(m) == (0, 0)
    m.put_start("c0", "x", 64 * 4096, PutConfig())


def test_a_slot_on_a_draining_segment_is_refused():
    m = service(Clock(), nsegs=1)
    (rid, _), = m.reserve("c0", 4096, 1, 1)
    m.set_draining(["seg0"], True)
    with pytest.raises(UnavailableInCurrentStatus):
        m.put_reserved("c0", "k", rid, PutConfig())
    assert balance(m) == (0, 0) and m.exist_many(["k"], lease=False) == [False]


def test_a_slot_is_never_striped_over_segments():
    m = service(Clock(), nsegs=2, stripe_nbytes=4096)   # an 8 KiB object would be striped
    assert m.reserve("c0", 8192, 1, 4) == [] and balance(m) == (0, 0)
    assert len(m.reserve("c0", 4096, 1, 4)) == 4         # one shard each
