"""Model-based test of the store: random operation sequences checked against a dict model.

A real in-process MasterServer, three in-process StoreClients (two contribute small
segments, one only reads and writes) and a holder *process* (``node.py``) contributing a
third segment, on the native and the pure-Python data paths (``impl``). Hypothesis drives
put / batch_put (the same buffer under several keys, overlapping slices of one buffer) /
get / batch_get / get_into / remove / remove_by_regex / exists, soft-pinned puts, eviction
pressure (the segments are small), reads racing eviction (leases), refused inputs, and a
kill -9 of the holder.

Invariants: a read returns exactly the model's bytes, or ObjectNotFound only when the key
may have been evicted (an eviction ran since it was last seen, and it was neither
soft-pinned, with ``allow_evict_soft_pinned_objects`` off, nor surely under a read lease);
removed keys are never found; a lease blocks remove; every refused operation raises the
documented typed exception and evicts nothing; after the holder dies (and the master
noticed), every object that had a replica wholly on living segments reads back the same
bytes, and the others are gone; at the end, with every object removed, no segment space
stays allocated.

``MOONCAKE_SOAK=1`` runs many more and longer sequences (``MOONCAKE_SOAK_EXAMPLES``, 300 by
default, per implementation).
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from helpers import LineChild, wait_until
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

from mooncake_plugins.errors import (BufferTooSmall, InvalidKey, InvalidParams, LeaseExpired,
                                     NoAvailableSpace, ObjectAlreadyExists, ObjectHasLease,
                                     ObjectNotFound, ReplicaNotReady)
from mooncake_plugins.store.client import ReplicateConfig, StoreClient
from mooncake_plugins.store.master import MAX_CLIENT_SLOT_NBYTES, MasterConfig
from mooncake_plugins.store.server import MasterServer, ServerOptions

SOAK = os.environ.get("MOONCAKE_SOAK") == "1"
SETTINGS = settings(
    max_examples=int(os.environ.get("MOONCAKE_SOAK_EXAMPLES", 300)) if SOAK else 25,
    stateful_step_count=80 if SOAK else 40, deadline=None, database=None,
    suppress_health_check=list(HealthCheck))

NODE = str(Path(__file__).with_name("node.py"))
SEGMENT = 512 << 10                 # per segment: three of them, so puts soon evict
LEASE_S = 1.0
CLIENT_TTL_S = 2.0                  # how long the master takes to notice a killed holder
DISCARD_S = 4.0                     # also how long a dropped segment's slots keep their space
BIG = 160 << 10                     # the largest object
KEYS = [f"{p}/{i}" for p in "ab" for i in range(4)]
FILL_KEYS = [f"f/{i}" for i in range(6)]
PATTERNS = ["^a/", "^b/", "1$", "^f/", "."]
READ_ERRORS = (ObjectNotFound, LeaseExpired)

keys = st.sampled_from(KEYS + FILL_KEYS)
# a few sizes recur, so puts also go through reserved slots (a size's second put on)
recurring = st.sampled_from([700, 4096, 30_000])
sizes = st.one_of(recurring, recurring, st.integers(1, 4096), st.integers(4097, 48 << 10),
                  st.integers(64 << 10, BIG))
seeds = st.integers(0, 1 << 32)
kinds = st.sampled_from(["bytes", "bytearray", "memoryview", "numpy"])
replica_nums = st.sampled_from([1, 1, 2])


def value_of(seed: int, nbytes: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def as_kind(data: bytes, kind: str) -> Any:
    """``data`` as one of the buffer types a caller may put."""
    if kind == "bytearray":
        return bytearray(data)
    if kind == "memoryview":
        return memoryview(bytearray(data))
    if kind == "numpy":
        return np.frombuffer(bytearray(data), dtype=np.uint8)
    return data


def _describe(got: bytes, *versions: bytes | None) -> str:
    """How ``got`` differs from each expected version (for failure messages)."""
    out = []
    for v in versions:
        if v is None:
            out.append("vs nothing")
            continue
        diff = next((i for i, (a, b) in enumerate(zip(got, v)) if a != b), min(len(got), len(v)))
        out.append(f"vs {len(v)} bytes: first difference at {diff}")
    return f"{len(got)} bytes, " + "; ".join(out)


class Cluster:
    """What the examples share: a master, clients with registered read buffers, a holder."""

    def __init__(self, impl_env: dict[str, str]) -> None:
        self.impl_env = impl_env
        self.master = MasterServer(
            MasterConfig(client_ttl_s=CLIENT_TTL_S, default_kv_lease_ttl_ms=int(LEASE_S * 1000),
                         allow_evict_soft_pinned_objects=False, stripe_nbytes=32 << 10,
                         eviction_ratio=0.1, put_start_discard_timeout_s=DISCARD_S),
            ServerOptions(rpc_port=0, reap_interval_s=0.1))
        self.master.start()
        self.clients: list[StoreClient] = []
        self.buffers: list[np.ndarray] = []
        self.holder: LineChild | None = None
        self.kills = 0
        try:
            for segment in (SEGMENT, SEGMENT, 0):
                client = StoreClient(self.master.address, global_segment_size=segment,
                                     transfer_timeout_s=10)
                self.clients.append(client)
                buf = np.zeros(BIG + 4096, dtype=np.uint8)
                client.register_buffer(buf.ctypes.data, buf.nbytes)
                self.buffers.append(buf)
            self.spawn_holder()
        except BaseException:
            self.close()
            raise

    def spawn_holder(self) -> None:
        segments = self.master.service.stats()["segments"]
        self.holder = LineChild([sys.executable, NODE, "--master", self.master.address,
                                 "--segment", str(SEGMENT)], env={**os.environ, **self.impl_env})
        assert self.master.service.stats()["segments"] == segments + 1

    def kill_holder(self) -> str:
        """kill -9 the holder; returns its segment name once the master dropped it."""
        assert self.holder is not None
        holder, self.holder = self.holder, None
        segment = holder.info["segment"]
        os.kill(holder.proc.pid, signal.SIGKILL)
        holder.proc.wait(10)
        holder.close()
        self.kills += 1
        stats = self.master.service.stats
        assert wait_until(lambda: stats()["segments"] == 2, CLIENT_TTL_S * 5, interval_s=0.05), \
            f"expected 2 segments once the holder's expired: {stats()}"
        return segment

    def close(self) -> None:
        if self.holder is not None:
            self.holder.close()
        for client, buf in zip(self.clients, self.buffers):
            client.unregister_buffer(buf.ctypes.data)
        for client in self.clients:
            client.close()
        self.master.close()


class StoreMachine(RuleBasedStateMachine):
    """The model: ``model`` holds what a read must return. A key may be absent only while
    in ``maybe_evicted`` (an eviction ran since it was last seen present, and it was neither
    soft-pinned nor surely under a read lease then); ``removed`` keys are surely absent."""

    cluster: Cluster   # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.model: dict[str, bytes] = {}
        self.pinned: set[str] = set()
        self.maybe_evicted: set[str] = set()
        self.removed: set[str] = set()
        self.leased_until: dict[str, float] = {}   # the master's lease ends by then
        self.lease_floor: dict[str, float] = {}    # ... and surely lasts until then
        self.kill_allowed = False
        self.evicted = 0
        # put rules run since the last kill: a precondition may read only what the drawn
        # steps decide (not their outcomes), or Hypothesis cannot replay a run
        self.puts_since_kill = 0

    # -- helpers ------------------------------------------------------------------------
    def _stats(self) -> dict:
        return self.cluster.master.service.stats()

    def _why(self) -> str:
        stalled = self._stats()["expired_clients"] - self.cluster.kills
        return (f" ({stalled} in-process clients expired: the machine stalled for "
                f"{CLIENT_TTL_S} s)" if stalled else "")

    def _lease(self, keys_: list[str], started: float | None = None,
               outcomes: list[Any] | None = None) -> None:
        """Record the read leases a call took: maybe on every key, and surely, when it began
        at ``started``, on each key whose outcome was not ObjectNotFound."""
        until = time.monotonic() + LEASE_S
        for i, key in enumerate(keys_):
            self.leased_until[key] = until
            if outcomes is not None and not isinstance(outcomes[i], ObjectNotFound):
                assert started is not None
                self.lease_floor[key] = max(self.lease_floor.get(key, 0.0), started + LEASE_S)

    def _surely_leased(self, key: str, at: float) -> bool:
        return self.lease_floor.get(key, 0.0) > at

    def _may_be_absent(self, key: str) -> bool:
        return key not in self.model or key in self.maybe_evicted

    def _present(self, key: str) -> None:
        """``key`` was seen stored just now."""
        assert key in self.model, f"{key!r} is stored, but it was never put or was removed"
        self.maybe_evicted.discard(key)

    def _gone(self, key: str) -> None:
        """``key`` is certainly not stored now."""
        self.model.pop(key, None)
        self.maybe_evicted.discard(key)
        self.pinned.discard(key)
        self.lease_floor.pop(key, None)
        self.removed.add(key)

    def _wrote(self, key: str, value: bytes, pin: bool) -> None:
        assert self._may_be_absent(key), f"put of {key!r} succeeded over a live object{self._why()}"
        self._gone(key)  # a new object: no lease of the old one holds it
        self.removed.discard(key)
        self.model[key] = value
        if pin:
            self.pinned.add(key)

    def _put_many(self, client: StoreClient, items: list[tuple[str, bytes]], values: list[Any],
                  replica_num: int, pin: bool) -> None:
        """batch_put ``values`` under the keys of ``items`` and check each outcome."""
        self.puts_since_kill += 1
        errors = client.batch_put([k for k, _ in items], values,
                                  ReplicateConfig(replica_num=replica_num, with_soft_pin=pin))
        ended = time.monotonic()
        count = self._stats()["evicted"]
        evicted, self.evicted = count != self.evicted, count
        if evicted:  # by this call, before or after any key of the batch was put
            self.maybe_evicted |= {k for k in set(self.model) - self.pinned
                                   if not self._surely_leased(k, ended)}
        for (key, value), err in zip(items, errors):
            if err is None:
                self._wrote(key, value, pin)
            elif isinstance(err, ObjectAlreadyExists):
                assert key in self.model, f"{key!r} refused as existing, but it is not stored"
                if not evicted:
                    self._present(key)
            else:
                assert isinstance(err, NoAvailableSpace), f"put {key!r}: {err!r}"

    def _check_read(self, key: str, got: Any, want: bytes | None,
                    observed: bool = True) -> None:
        """One read's outcome against ``want``: those bytes, or an error the model allows.
        ``observed``: nothing ran meanwhile, so a found key is present now."""
        if isinstance(got, Exception):
            assert isinstance(got, READ_ERRORS), f"get {key!r}: {got!r}"
            if isinstance(got, ObjectNotFound):
                assert self._may_be_absent(key), f"{key!r} was lost{self._why()}"
                self._gone(key)
                return
            assert want is not None, f"{key!r} is not stored, yet: {got!r}"
        else:
            assert want is not None, f"read {len(got)} bytes of {key!r}, which is not stored"
            assert got == want, f"wrong bytes for {key!r}: {_describe(got, want)}"
        if observed:
            self._present(key)

    def _read(self, c: int, batch: list[str]) -> None:
        started = time.monotonic()
        results = self.cluster.clients[c].batch_get(batch)
        self._lease(batch, started, results)
        for key, got in zip(batch, results):
            self._check_read(key, got, self.model.get(key))

    # -- rules --------------------------------------------------------------------------
    # one initialize rule: Hypothesis runs several in any order, and this one's puts must
    # follow the reset
    @initialize(kill=st.sampled_from([False, False, False, True]), c=st.integers(0, 2),
                pair=st.lists(st.sampled_from(KEYS), min_size=2, max_size=2, unique=True),
                n=recurring, seed=seeds)
    def reset(self, kill: bool, c: int, pair: list[str], n: int, seed: int) -> None:
        """An empty store, then two puts of one size from one client: a size's second put
        takes a reserved slot (one round trip), so every example reaches that path, the first
        (with fresh clients) surely, whatever the draw."""
        if self.cluster.holder is None:
            self.cluster.spawn_holder()
        self.cluster.clients[2].remove_all(force=True)
        assert self._stats()["objects"] == 0
        self.evicted = self._stats()["evicted"]
        self.kill_allowed = kill
        for i, key in enumerate(pair):
            value = value_of(seed + i, n)
            self._put_many(self.cluster.clients[c], [(key, value)], [value], 1, False)

    @rule(c=st.integers(0, 2), key=keys, n=sizes, seed=seeds, kind=kinds, replicas=replica_nums,
          pin=st.booleans())
    def put(self, c: int, key: str, n: int, seed: int, kind: str, replicas: int, pin: bool) -> None:
        value = value_of(seed, n)
        self._put_many(self.cluster.clients[c], [(key, value)], [as_kind(value, kind)],
                       replicas, pin)

    @rule(c=st.integers(0, 2), batch=st.lists(keys, min_size=1, max_size=4, unique=True),
          n=sizes, seed=seeds, mode=st.sampled_from(["same", "distinct", "overlapping"]),
          replicas=replica_nums, pin=st.booleans())
    def put_batch(self, c: int, batch: list[str], n: int, seed: int, mode: str, replicas: int,
                  pin: bool) -> None:
        if mode == "same":  # one buffer under every key
            value = value_of(seed, n)
            values: list[Any] = [bytearray(value)] * len(batch)
            items = [(k, value) for k in batch]
        elif mode == "distinct":
            items = [(k, value_of(seed + i, n)) for i, k in enumerate(batch)]
            values = [v for _, v in items]
        else:  # slices of one buffer that overlap each other
            view = memoryview(bytearray(value_of(seed, n + 64 * len(batch))))
            values = [view[64 * i:64 * i + n] for i in range(len(batch))]
            items = [(k, bytes(v)) for k, v in zip(batch, values)]
        self._put_many(self.cluster.clients[c], items, values, replicas, pin)

    @rule(c=st.integers(0, 2), first=st.integers(0, len(FILL_KEYS) - 1), count=st.integers(2, 5),
          seed=seeds, replicas=replica_nums)
    def eviction_pressure(self, c: int, first: int, count: int, seed: int, replicas: int) -> None:
        for i in range(count):
            key = FILL_KEYS[(first + i) % len(FILL_KEYS)]
            value = value_of(seed + i, BIG - 1000 * i)
            self._put_many(self.cluster.clients[c], [(key, value)], [value], replicas, False)

    @rule(c=st.integers(0, 2), key=keys)
    def get(self, c: int, key: str) -> None:
        self._read(c, [key])

    @rule(c=st.integers(0, 2), batch=st.lists(keys, min_size=1, max_size=6))
    def get_batch(self, c: int, batch: list[str]) -> None:
        self._read(c, batch)

    @rule(c=st.integers(0, 2), key=keys, short=st.booleans())
    def get_into(self, c: int, key: str, short: bool) -> None:
        buf = self.cluster.buffers[c]
        buf[:] = 0xA5
        want = self.model.get(key)
        room = 1 if short else buf.nbytes
        started = time.monotonic()
        try:
            got: Any = self.cluster.clients[c].get_into(key, buf.ctypes.data, room)
        except Exception as exc:  # checked against the model
            got = exc
        self._lease([key], started, [got])
        if isinstance(got, BufferTooSmall):
            assert want is not None and len(want) > room, f"get_into {key!r}: {got!r}"
            self._present(key)
        elif isinstance(got, Exception):
            self._check_read(key, got, want)
        else:
            assert want is not None and got == len(want), f"get_into {key!r} -> {got}"
            self._check_read(key, buf[:got].tobytes(), want)
            assert (buf[got:] == 0xA5).all(), f"get_into {key!r} wrote past the object"

    @rule(c=st.integers(0, 2), key=keys)
    def exists(self, c: int, key: str) -> None:
        started = time.monotonic()
        found = self.cluster.clients[c].exists(key)
        self._lease([key], started, [None if found else ObjectNotFound()])  # as a get
        if found:
            self._present(key)
        else:
            assert self._may_be_absent(key), f"{key!r} vanished{self._why()}"
            self._gone(key)

    @rule(c=st.integers(0, 2), key=keys, force=st.booleans())
    def remove(self, c: int, key: str, force: bool) -> None:
        started = time.monotonic()
        try:
            self.cluster.clients[c].remove(key, force=force)
        except ObjectNotFound:
            assert self._may_be_absent(key), f"remove {key!r}: not found{self._why()}"
        except ObjectHasLease:
            assert not force and started < self.leased_until.get(key, 0.0), \
                f"remove {key!r}: refused for a lease that had ended"
            self._present(key)
            return
        else:
            assert key in self.model, f"removed {key!r}, which is not stored"
            assert force or not self._surely_leased(key, time.monotonic()), \
                f"removed {key!r} while it was being read"
        self._gone(key)

    @rule(c=st.integers(0, 2), pattern=st.sampled_from(PATTERNS), force=st.booleans())
    def remove_by_regex(self, c: int, pattern: str, force: bool) -> None:
        matched = [k for k in self.model if re.search(pattern, k)]
        started = time.monotonic()
        count = self.cluster.clients[c].remove_by_regex(pattern, force=force)
        ended = time.monotonic()
        present = self.cluster.clients[c].batch_exists(matched) if matched else []
        gone = [k for k, p in zip(matched, present) if not p]
        for key, p in zip(matched, present):
            if p:  # only a lease keeps a matching object
                assert not force and started < self.leased_until.get(key, 0.0), \
                    f"remove_by_regex({pattern!r}) left {key!r}"
                self._present(key)
            else:
                assert force or not self._surely_leased(key, ended), \
                    f"remove_by_regex({pattern!r}) removed {key!r} while it was being read"
        self._lease(matched, ended, [None if p else ObjectNotFound() for p in present])
        maybe_gone_before = sum(1 for k in gone if k in self.maybe_evicted)
        assert len(gone) - maybe_gone_before <= count <= len(gone), (count, gone)
        for key in gone:
            self._gone(key)

    @rule(key=keys, reader=st.integers(0, 2), writer=st.integers(0, 2), seed=seeds)
    def get_while_evicting(self, key: str, reader: int, writer: int, seed: int) -> None:
        want = self.model.get(key)
        out: list[Any] = []

        def read() -> None:
            try:
                out.append(self.cluster.clients[reader].get(key))
            except Exception as exc:  # checked against the model
                out.append(exc)

        started = time.monotonic()
        thread = threading.Thread(target=read)
        thread.start()
        self.eviction_pressure(writer, seed % len(FILL_KEYS), 3, seed, 1)
        thread.join(60)
        assert not thread.is_alive(), "a get hung while puts evicted"
        got, now = out[0], self.model.get(key)
        if now is not want:  # evicted and put again by the pressure: any version, or none
            self._lease([key])
            if isinstance(got, Exception):
                assert isinstance(got, (*READ_ERRORS, ReplicaNotReady)), f"get {key!r}: {got!r}"
            else:
                assert got in (want, now), \
                    f"wrong bytes for {key!r} read during eviction: {_describe(got, want, now)}"
        else:
            self._lease([key], started, [got])
            self._check_read(key, got, want, observed=False)

    @rule(c=st.integers(0, 2), case=st.sampled_from(["empty value", "empty key", "long key",
                                                    "lengths", "regex", "replica_num"]))
    def refused(self, c: int, case: str) -> None:
        client = self.cluster.clients[c]
        calls: dict[str, tuple[type[Exception], Callable[[], object]]] = {
            "empty value": (InvalidParams, lambda: client.put("a/0", b"")),
            "empty key": (InvalidKey, lambda: client.get("")),
            "long key": (InvalidKey, lambda: client.put("k" * 5000, b"x")),
            "lengths": (InvalidParams, lambda: client.batch_put(["a/0"], [b"1", b"2"])),
            "regex": (InvalidParams, lambda: client.remove_by_regex("(")),
            "replica_num": (InvalidParams,
                            lambda: client.put("a/0", b"x", ReplicateConfig(replica_num=0))),
        }
        expected, call = calls[case]
        evicted = self._stats()["evicted"]
        with pytest.raises(expected):
            call()
        # nor does it touch the store: a put refused for its key once asked for slots of
        # its size first, evicting objects (that the model then took as lost)
        assert self._stats()["evicted"] == evicted, f"refused {case!r} evicted objects"

    @precondition(lambda self: self.kill_allowed and self.cluster.holder is not None
                  and self.puts_since_kill >= 3)
    @rule()
    def kill_holder(self) -> None:
        self.puts_since_kill = 0
        keys_ = sorted(self.model)
        placed = self.cluster.clients[2].replicas(keys_) if keys_ else []
        self._lease(keys_)
        segment = self.cluster.kill_holder()
        survives = {}
        for key, info in zip(keys_, placed):
            if isinstance(info, ObjectNotFound):
                assert self._may_be_absent(key), f"{key!r} was lost{self._why()}"
                self._gone(key)
            else:
                survives[key] = any(all(s[0] != segment for s in r) for r in info[1])
        started = time.monotonic()
        results = self.cluster.clients[2].batch_get(list(survives))
        self._lease(list(survives), started, results)
        for key, got in zip(survives, results):
            if survives[key]:
                assert not isinstance(got, Exception), \
                    f"{key!r} had a replica on living segments, yet: {got!r}{self._why()}"
                self._check_read(key, got, self.model[key])
            else:  # every replica had a shard on the dead holder: the master dropped it
                assert isinstance(got, ObjectNotFound), f"{key!r} survived its holder: {got!r}"
                self._gone(key)
        # the lost replicas are re-created where there is room (repair.py), then read again
        def settled() -> bool:
            st = self._stats()
            return st["repairs_running"] == 0 and st["repairs_waiting"] == st["repairs_blocked"]
        assert wait_until(settled, 30, 0.05), f"replica repair did not settle: {self._stats()}"
        self._read(2, sorted(k for k in survives if survives[k]))

    # -- invariants ---------------------------------------------------------------------
    @invariant()
    def stored_and_removed_keys(self) -> None:
        tracked = sorted(set(self.model) | self.removed)
        # the master's view, without the lease a client's exists would take on every key
        found = self.cluster.master.service.exist_many(tracked, lease=False)
        for key, present in zip(tracked, found):
            if present:
                assert key not in self.removed, f"removed {key!r} is found again"
                self._present(key)
            elif key in self.model:
                assert key in self.maybe_evicted, f"{key!r} vanished{self._why()}"
                self._gone(key)

    def teardown(self) -> None:
        self._read(1, sorted(self.model))


@pytest.fixture
def cluster(impl: str, impl_env: dict[str, str]) -> Iterator[Cluster]:
    c = Cluster(impl_env)
    try:
        yield c
    finally:
        c.close()


def test_store_against_model(cluster: Cluster) -> None:
    machine = type("Machine", (StoreMachine,), {"cluster": cluster})
    run_state_machine_as_test(machine, settings=SETTINGS)
    # no space leaks: with every object gone, all of it is free once the leases ended
    cluster.clients[0].remove_all(force=True)
    stats = cluster.master.service.stats
    assert wait_until(lambda: stats()["used_bytes"] == 0, LEASE_S + DISCARD_S + 2), stats()
    # puts of one round trip ran, and what their slots hold is all that is left
    assert stats()["reserved_puts"] > 0, stats()
    assert stats()["reserved_bytes"] <= (len(cluster.clients) + 1) * MAX_CLIENT_SLOT_NBYTES
