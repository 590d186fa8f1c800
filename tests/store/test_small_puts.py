"""Small puts copy their values into registered scratch buffers of the client: each buffer
is lent to one call at a time, so concurrent puts never mix their bytes, and one that a
failed put may still be read from is not lent again."""

from __future__ import annotations

import itertools
import os
import threading
import time

import pytest

from mooncake_plugins.errors import InvalidKey
from mooncake_plugins.store import client as client_module
from mooncake_plugins.store.client import SMALL_PUT_NBYTES, ReplicateConfig, StoreClient


def test_concurrent_small_puts_keep_their_own_bytes(master):
    with StoreClient(master.address, global_segment_size=32 << 20) as c:
        values = {f"t{t}-{i}": os.urandom(1024 + (t * 977 + i * 131) % 7000)
                  for t in range(8) for i in range(150)}
        keys = sorted(values)
        errors: list[BaseException] = []

        def put(part: list[str]) -> None:
            try:
                for k in part:
                    c.put(k, values[k])
            except BaseException as exc:   # reported below
                errors.append(exc)

        threads = [threading.Thread(target=put, args=(keys[t::8],)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors[:1]
        assert all(c.get(k) == values[k] for k in keys)
        assert 1 <= len(c._scratch._free) <= 8, "at most one buffer per concurrent call"
        # a batch past the scratch size goes the registered way, and still round-trips
        big = [os.urandom(SMALL_PUT_NBYTES // 2 + 1) for _ in range(2)]
        assert c.batch_put(["b0", "b1"], big) == [None, None]
        assert c.batch_get(["b0", "b1"]) == big


def test_a_failed_put_does_not_lend_its_buffer_again(master, monkeypatch):
    with StoreClient(master.address, global_segment_size=8 << 20) as c:
        c.put("warm", b"x" * 100)
        lent = list(c._scratch._free)
        assert len(lent) == 1
        monkeypatch.setattr(c, "_run", lambda op, plan: {0: OSError("link down")})
        (err,) = c.batch_put(["lost"], [b"y" * 100])
        assert err is not None and "link down" in str(err)
        assert c._scratch._free == [], "the buffer a failed put used is dropped"
        monkeypatch.undo()
        c.put("after", b"z" * 100)
        assert c.get("after") == b"z" * 100 and c._scratch._free[0] is not lent[0]


def _count_calls(client: StoreClient, monkeypatch) -> list[str]:
    """The master methods ``client`` calls from now on, in order."""
    methods: list[str] = []
    real = type(client._rpc).call

    def call(rpc, method, **args):
        methods.append(method)
        return real(rpc, method, **args)

    monkeypatch.setattr(type(client._rpc), "call", call)
    return methods


def test_a_size_put_again_takes_one_master_round_trip(master, monkeypatch):
    with StoreClient(master.address, global_segment_size=8 << 20) as c, \
            StoreClient(master.address, global_segment_size=0) as reader:
        methods = _count_calls(c, monkeypatch)
        values = {f"k{i}": os.urandom(4096) for i in range(40)}
        for k, v in values.items():
            c.put(k, v)
        puts = [m for m in methods if m != "heartbeat"]
        # a size seen once goes the two-trip way; the second time slots are reserved;
        # from then on one put_reserved per put, refilling slots in bulk now and then
        assert puts[:5] == ["put_start", "put_end", "reserve", "put_reserved", "put_reserved"]
        assert puts.count("put_reserved") == 39 and "put_start" not in puts[2:]
        assert reader.batch_get(list(values)) == list(values.values())
        st = master.service.stats()
        assert st["reserved_puts"] == 39 and 0 < st["reserved_slots"] <= 16
        # objects of other sizes, or with preferred segments, are unaffected
        for _ in range(2):
            c.upsert("odd", b"x" * 4096, ReplicateConfig(preferred_segments=[c.segment_name]))
            assert [m for m in methods if m != "heartbeat"][-2:] == ["put_start", "put_end"]
        assert reader.get("odd") == b"x" * 4096


def test_a_put_with_an_invalid_key_reserves_nothing_and_evicts_nothing(master, monkeypatch):
    # A pool filled to just under the eviction watermark: asking for slots would evict
    # (the model test saw objects vanish after such a put, with no put of it succeeding)
    with StoreClient(master.address, global_segment_size=1 << 20) as c:
        big = {f"big{i}": bytes([i]) * 66_000 for i in range(15)}   # no slot size
        assert c.batch_put(list(big), list(big.values())) == [None] * 15
        st = master.service.stats()
        assert st["used_bytes"] > 0.94 * st["capacity_bytes"] and st["evicted"] == 0
        methods = _count_calls(c, monkeypatch)
        for _ in range(3):   # a size put again takes slots: not for a key that is refused
            with pytest.raises(InvalidKey):
                c.put("k" * 5000, b"x" * 1000)
            errors = c.batch_put(["", "k" * 4097], [b"y" * 1000] * 2)
            assert [type(e) for e in errors] == [InvalidKey] * 2
        assert "reserve" not in methods and "put_reserved" not in methods
        st = master.service.stats()
        assert st["evicted"] == 0 and st["reserved_slots"] == 0, st
        assert master.service.exist_many(list(big), lease=False) == [True] * 15
        c.put("fine", b"z" * 1000)
        c.put("fine2", b"z" * 1000)     # a valid key of that size still takes a slot
        assert "put_reserved" in methods


def test_slots_are_left_alone_when_the_master_has_not_answered_lately(master, monkeypatch):
    with StoreClient(master.address, global_segment_size=8 << 20) as c:
        c.put("a", b"1" * 300)
        c.put("b", b"2" * 300)                  # slots reserved here
        monkeypatch.setattr(client_module, "SLOT_FRESH_S", 0.05)
        methods = _count_calls(c, monkeypatch)
        c._answered -= 1.0     # (the heartbeat thread beats once a second)
        c.put("c", b"3" * 300)
        # it asks first (the slots' master may have died meanwhile), then uses one
        assert [m for m in methods if m != "heartbeat"] == ["reserve", "put_reserved"]
        assert c.get("c") == b"3" * 300


def test_a_client_the_master_forgot_drops_its_slots_and_the_put_lands(master, monkeypatch):
    with StoreClient(master.address, global_segment_size=8 << 20) as c:
        c.put("a", b"1" * 300)
        c.put("b", b"2" * 300)
        assert c._slots and master.service.stats()["reserved_slots"] > 0
        epoch = c._epoch
        master.service.unregister_client(c.client_id)   # as a master that restarted
        assert master.service.stats()["reserved_slots"] == 0
        methods = _count_calls(c, monkeypatch)
        c.put("c", b"3" * 300)
        # the slot is refused, put_start finds the client unknown, it registers again
        # (dropping every slot it had) and the put goes through
        assert [m for m in methods if m not in ("heartbeat", "mount_segment")][:4] == \
            ["put_reserved", "put_start", "register_client", "put_start"]
        assert not c._slots or all(
            rid in master.service._slots for pool in c._slots.values() for rid, _, _ in pool)
        assert c.get("c") == b"3" * 300
        # slots granted by a call made before the client registered again are not kept
        kept = {cls: list(pool) for cls, pool in c._slots.items()}
        c._add_slots((300, 1), {"slots": [[7, [[c.segment_name, 0, 300]]]], "use_within_s": 9.0},
                     epoch)
        assert c._epoch > epoch and c._slots == kept


def test_a_size_the_master_has_no_slots_for_is_not_asked_about_on_every_put(master, monkeypatch):
    # a 4 KiB pool: the client's share (1/16) holds no 300-byte slot
    with StoreClient(master.address, global_segment_size=4096) as c:
        monkeypatch.setattr(client_module, "SLOT_RETRY_S", 0.5)
        c.put("a", b"1" * 300)
        methods = _count_calls(c, monkeypatch)
        asked = time.monotonic()
        c.put("b", b"2" * 300)            # asks once, gets nothing
        refused = time.monotonic()
        c.put("c", b"3" * 300)
        c.put("d", b"4" * 300)
        assert [m for m in methods if m != "heartbeat"] == \
            ["reserve", "put_start", "put_end"] + ["put_start", "put_end"] * 2
        assert [c.get(k) for k in "bcd"] == [b"2" * 300, b"3" * 300, b"4" * 300]
        # Puts go on without asking until SLOT_RETRY_S after the refusal, then one asks
        # again (and still gets nothing): put until one asks, no later than that, and
        # not before SLOT_RETRY_S after "b" asked.
        for i in itertools.count():
            start, mark = time.monotonic(), len(methods)
            c.put(f"e{i}", b"5" * 300)
            end = time.monotonic()
            calls = [m for m in methods[mark:] if m != "heartbeat"]
            if calls[0] == "reserve":
                break
            assert calls == ["put_start", "put_end"]
            assert start < refused + client_module.SLOT_RETRY_S, \
                "no slot asked for again after the wait"
            c.remove(f"e{i}")
            time.sleep(0.02)
        assert calls == ["reserve", "put_start", "put_end"]
        assert end >= asked + client_module.SLOT_RETRY_S, "asked again before the wait"


def test_only_single_replica_puts_take_slots(master, monkeypatch):
    with StoreClient(master.address, global_segment_size=8 << 20) as a, \
            StoreClient(master.address, global_segment_size=8 << 20) as b:
        two = ReplicateConfig(replica_num=2)
        methods = _count_calls(a, monkeypatch)
        for i in range(3):
            a.put(f"r{i}", bytes([i]) * 500, two)
        assert [m for m in methods if m != "heartbeat"] == ["put_start", "put_end"] * 3
        assert [b.get(f"r{i}") for i in range(3)] == [bytes([i]) * 500 for i in range(3)]
