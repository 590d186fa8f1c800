"""Replica repair: replicas lost with a dead holder are re-created from a surviving one.

Master logic with a fake clock (the task a client is handed, visibility only after the
copy, retries, no room, the journal), then real holder processes killed with SIGKILL
while a client reads through the replica query API and compares the bytes.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import urllib.request

from helpers import wait_until

from mooncake_plugins.store import tasks
from mooncake_plugins.store.client import ReplicateConfig, StoreClient
from mooncake_plugins.store.journal import FileJournal, Journal
from mooncake_plugins.store.master import MasterConfig, MasterService, PutConfig
from mooncake_plugins.store.repair import MAX_ATTEMPTS
from mooncake_plugins.store.server import MasterServer, ServerOptions

KiB, MiB = 1 << 10, 1 << 20


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _service(clock: Clock, nsegs: int = 3, seg_nbytes: int = 8 * MiB,
             journal: Journal | None = None) -> MasterService:
    m = MasterService(MasterConfig(client_ttl_s=5), clock=clock)
    if journal is not None:
        m.attach_journal(journal)
    for i in range(nsegs):
        m.register_client(f"c{i}", f"host{i}")
        m.mount_segment(f"c{i}", f"seg{i}", (i + 1) << 32, seg_nbytes)
    return m


def _put(m: MasterService, key: str, nbytes: int, segments: list[str]) -> None:
    m.put_start("c0", key, nbytes, PutConfig(replica_num=len(segments),
                                             preferred_segments=segments))
    m.put_end("c0", key)


def _segments_of(m: MasterService, key: str) -> list[str]:
    return sorted(s[0] for r in m.get(key)[1] for s in r)


def _expire(m: MasterService, clock: Clock, dead: str, nclients: int = 3) -> None:
    """Let client ``dead`` miss its heartbeats while the others (c0, c1, ...) keep theirs."""
    clock.t += 6
    for i in range(nclients):
        if f"c{i}" != dead:
            m.heartbeat(f"c{i}")
    m.reap()


def _journal(directory: str) -> tuple[Journal, dict]:
    journal = Journal(FileJournal(directory))
    state = journal.backend.load()
    return journal, state


def test_a_lost_replica_is_copied_by_a_survivor_and_published_at_the_end(tmp_path) -> None:
    clock = Clock()
    journal, _ = _journal(str(tmp_path))
    journal.start()
    m = _service(clock, journal=journal)
    try:
        _put(m, "k", 100 * KiB, ["seg0", "seg1"])
        _put(m, "one", 100 * KiB, ["seg1"])    # no survivor: gone, nothing to repair
        _expire(m, clock, "c1")
        assert m.stats()["repairs_running"] == 1 and not m.exist("one")
        (task,) = m.tasks.take("c0")           # the survivor's owner copies
        assert (task["type"], task["key"], task["source"], task["targets"]) == \
            (tasks.COPY, "k", "seg0", ["seg2"])
        nbytes, src, new = m.replica_start("c0", "k", "seg0", ["seg2"], False)
        assert nbytes == 100 * KiB and src[0][0] == "seg0" and new[0][0][0] == "seg2"
        assert _segments_of(m, "k") == ["seg0"]             # invisible while copying
        m.replica_end("c0", "k", True)
        assert _segments_of(m, "k") == ["seg0", "seg2"]
        m.complete_task("c0", tuple(task["id"]), True, "")
        st = m.stats()
        assert (st["replicas_recreated"], st["repairs_waiting"], st["repairs_running"]) == (1, 0, 0)
        journal.wait(journal.seq)
    finally:
        journal.close()
    journal2, state = _journal(str(tmp_path))   # a restarted master sees the new replica
    try:
        m2 = MasterService(MasterConfig(client_ttl_s=5), clock=clock)
        m2.restore(state)
        assert _segments_of(m2, "k") == ["seg0", "seg2"]
        assert m2._objects["k"].replica_num == 2 and m2.stats()["repairs_waiting"] == 0
    finally:
        journal2.backend.close()


def test_a_restored_object_short_of_replicas_is_queued(tmp_path) -> None:
    clock = Clock()
    journal, _ = _journal(str(tmp_path))
    journal.start()
    m = _service(clock, nsegs=4, journal=journal)
    _put(m, "k", 4 * KiB, ["seg0", "seg1"])
    _put(m, "u", 4 * KiB, ["seg0", "seg2"])
    _put(m, "v", 4 * KiB, ["seg0", "seg3"])
    m.unmount_segment("c2", "seg2")   # a clean unmount is the holder's choice: no repair
    assert m.stats()["repairs_waiting"] == 0 and _segments_of(m, "u") == ["seg0"]
    _expire(m, clock, "c3", nclients=4)   # v: 1 of 2 replicas left, its repair starts
    assert m.stats()["repairs_running"] == 1 and _segments_of(m, "v") == ["seg0"]
    journal.wait(journal.seq)
    journal.close()
    # a restarted master: v still waits; k's replica on seg1, a segment it does not know
    # (the journal is edited so), is dropped and k waits too; u keeps its one replica
    journal, state = _journal(str(tmp_path))
    journal.backend.close()
    del state[("s", "seg1")]
    m2 = MasterService(MasterConfig(client_ttl_s=5), clock=clock)
    m2.restore(state)
    assert [_segments_of(m2, key) for key in "kuv"] == [["seg0"]] * 3
    assert m2.stats()["repairs_waiting"] == 2
    m2.heartbeat("c0")
    m2.register_client("c4", "host4")
    m2.mount_segment("c4", "seg4", 5 << 32, 8 * MiB)
    m2.reap()
    got = sorted((t["key"], t["targets"][0]) for t in m2.tasks.take("c0"))
    assert got == [("k", "seg4"), ("v", "seg4")]


def test_a_failed_copy_frees_its_space_is_retried_and_given_up(caplog) -> None:
    clock = Clock()
    m = _service(clock)
    _put(m, "k", 100 * KiB, ["seg0", "seg1"])
    _expire(m, clock, "c1")
    used = m.stats()["used_bytes"]
    for attempt in range(1, MAX_ATTEMPTS + 1):
        (task,) = m.tasks.take("c0")
        m.replica_start("c0", "k", "seg0", task["targets"], False)
        assert m.stats()["used_bytes"] == used + 100 * KiB
        m.replica_end("c0", "k", False)        # the transfer failed: nothing is published
        assert m.stats()["used_bytes"] == used and _segments_of(m, "k") == ["seg0"]
        with caplog.at_level(logging.ERROR, logger="mooncake_plugins.store.repair"):
            m.complete_task("c0", tuple(task["id"]), False, "StoreTransferFailed: boom")
        assert m.stats()["repairs_failed"] == attempt
        if attempt < MAX_ATTEMPTS:
            m.reap()
            assert m.tasks.take("c0") == []     # backoff before the next attempt
            clock.t += 2.0 ** attempt - 6
            _expire(m, clock, "c1")
    st = m.stats()
    assert (st["repairs_abandoned"], st["repairs_waiting"], st["repairs_running"]) == (1, 0, 0)
    assert "given up" in caplog.text and m.exist("k")


def test_no_room_keeps_the_survivor_evicts_nothing_and_waits_for_a_holder() -> None:
    clock = Clock()
    m = _service(clock, seg_nbytes=1 * MiB)
    _put(m, "k", 400 * KiB, ["seg0", "seg1"])
    _put(m, "fill", 700 * KiB, ["seg2"])   # seg2, the only other segment, is too full
    _expire(m, clock, "c1")
    st = m.stats()
    assert (st["repairs_blocked"], st["repairs_running"], st["evicted"]) == (1, 0, 0)
    assert m.tasks.take("c0") == [] and m.exist("fill") and _segments_of(m, "k") == ["seg0"]
    m.register_client("c3", "host3")       # a new holder brings room
    m.mount_segment("c3", "seg3", 4 << 32, 1 * MiB)
    m.reap()
    (task,) = m.tasks.take("c0")
    assert task["targets"] == ["seg3"] and m.stats()["repairs_blocked"] == 0


def test_repairs_stop_at_the_eviction_watermark() -> None:
    clock = Clock()
    m = _service(clock, seg_nbytes=1 * MiB)
    _put(m, "k", 200 * KiB, ["seg0", "seg1"])
    _put(m, "f0", 800 * KiB, ["seg0"])
    _put(m, "f2", 750 * KiB, ["seg2"])
    _expire(m, clock, "c1")   # seg2 has 274 KiB free, but 0.95 * 2048 - 1750 KiB < 200 KiB
    assert m.stats()["repairs_blocked"] == 1 and m.tasks.take("c0") == []


def test_concurrency_bounds_the_running_copies() -> None:
    clock = Clock()
    m = MasterService(MasterConfig(client_ttl_s=5, replica_repair_concurrency=2), clock=clock)
    for i in range(3):
        m.register_client(f"c{i}", f"host{i}")
        m.mount_segment(f"c{i}", f"seg{i}", (i + 1) << 32, 8 * MiB)
    for i in range(5):
        _put(m, f"k{i}", 4 * KiB, ["seg0", "seg1"])
    _expire(m, clock, "c1")
    assert len(m.tasks.take("c0")) == 2 and m.stats()["repairs_waiting"] == 3


# -- real holder processes ---------------------------------------------------------------

def _data(i: int) -> bytes:
    return random.Random(i).randbytes(64 * KiB + i * 4099)


def _memory_segments(reader: StoreClient, keys: list[str]) -> dict[str, list[str]]:
    out = {}
    for key, info in zip(keys, reader.replicas(keys)):
        assert not isinstance(info, Exception), f"{key}: {info!r}"
        out[key] = sorted(s[0] for r in info[1] for s in r)
    return out


def _wrong(reader: StoreClient, keys: list[str]) -> list[str]:
    """The keys whose bytes read back differ from what was put."""
    return [k for k, got in zip(keys, reader.batch_get(keys)) if got != _data(int(k[1:]))]


def _kill(node) -> None:
    os.kill(node.proc.pid, signal.SIGKILL)
    node.proc.wait(10)


def _whole_on(reader: StoreClient, keys: list[str], live: set[str], n: int = 2) -> bool:
    return all(len(segs) == n and set(segs) <= live
               for segs in _memory_segments(reader, keys).values())


def test_replicas_of_a_killed_holder_are_recreated_and_hold_the_bytes(master_process, nodes):
    _, addr = master_process("--client_ttl", "1.5", "--replica_repair_concurrency", "4")
    h0, h1, h2 = nodes(addr), nodes(addr), nodes(addr)
    with StoreClient(addr, global_segment_size=0) as reader:
        keys = [f"r{i}" for i in range(12)]
        for i, key in enumerate(keys):   # half on h1+h2, half on h1+h0
            pair = [h1.segment, h2.segment if i % 2 else h0.segment]
            reader.put(key, _data(i), ReplicateConfig(replica_num=2, preferred_segments=pair))
        _kill(h1)
        live = {h0.segment, h2.segment}
        assert wait_until(lambda: _whole_on(reader, keys, live), 30, 0.2), \
            _memory_segments(reader, keys)
        st = reader.stats()
        assert st["replicas_recreated"] == 12 and st["repairs_waiting"] == 0, st
        assert _wrong(reader, keys) == []
        # h2 goes too: the odd keys now only have the copies made on h0
        _kill(h2)
        assert wait_until(lambda: reader.stats()["repairs_blocked"] == 12, 30, 0.2), \
            reader.stats()   # no second live segment to copy to
        assert _whole_on(reader, keys, {h0.segment}, n=1)
        assert _wrong(reader, keys) == []
        # a new holder brings room; then only the copies of copies are left
        h3 = nodes(addr)
        assert wait_until(lambda: _whole_on(reader, keys, {h0.segment, h3.segment}), 30, 0.2)
        _kill(h0)
        assert wait_until(lambda: reader.stats()["segments"] == 1, 30, 0.2)
        assert _wrong(reader, keys) == []
        assert reader.stats()["replicas_recreated"] == 24


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    line = next(ln for ln in text.splitlines() if ln.startswith(f"mooncake_master_{name} "))
    return float(line.split()[1])


def test_without_room_objects_stay_readable_until_a_holder_joins(nodes) -> None:
    # free_ratio_first keeps the three holders balanced: random placement left one object
    # with a single replica (the other two holders full) in about 1 run in 60
    server = MasterServer(MasterConfig(client_ttl_s=1.5, allocation_strategy="free_ratio_first"),
                          ServerOptions(rpc_port=0, metrics_port=0, reap_interval_s=0.2))
    server.start()
    try:
        holders = [nodes(server.address, "--segment", str(4 * MiB)) for _ in range(3)]
        with StoreClient(server.address, global_segment_size=0) as reader:
            keys = [f"f{i}" for i in range(10)]
            data = [os.urandom(512 * KiB) for _ in keys]   # 10 MiB of 12 MiB, 2 replicas each
            errors = reader.batch_put(keys, data, ReplicateConfig(replica_num=2))
            assert errors == [None] * 10
            placed = _memory_segments(reader, keys)
            assert all(len(s) == 2 for s in placed.values()), placed
            victim = max(holders, key=lambda h: sum(h.segment in s for s in placed.values()))
            _kill(victim)
            # the survivors hold 8 MiB: not all lost replicas fit under the watermark
            assert wait_until(lambda: _metric(server.metrics_port, "repairs_blocked") > 0, 30, 0.2)
            st = reader.stats()
            assert st["evicted"] == 0 and st["objects"] == 10, st
            assert reader.batch_get(keys) == data
            nodes(server.address, "--segment", str(4 * MiB))
            assert wait_until(lambda: all(len(s) == 2 for s in
                                          _memory_segments(reader, keys).values()), 30, 0.2)
            assert reader.batch_get(keys) == data
            assert _metric(server.metrics_port, "repairs_blocked") == 0
            assert _metric(server.metrics_port, "replicas_recreated_total") == \
                sum(victim.segment in s for s in placed.values())
    finally:
        server.close()


def test_repair_can_be_turned_off() -> None:
    clock = Clock()
    m = MasterService(MasterConfig(client_ttl_s=5, replica_repair_concurrency=0), clock=clock)
    for i in range(3):
        m.register_client(f"c{i}", f"host{i}")
        m.mount_segment(f"c{i}", f"seg{i}", (i + 1) << 32, 8 * MiB)
    _put(m, "k", 4 * KiB, ["seg0", "seg1"])
    _expire(m, clock, "c1")
    assert m.tasks.take("c0") == [] and m.stats()["repairs_waiting"] == 0
