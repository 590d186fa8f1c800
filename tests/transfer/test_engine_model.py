"""Model-based test of registrations and transfers: random sequences against a dict model.

Two engines in two processes: this one (the initiator, native or pure-Python through the
``impl`` fixture) and ``model_peer.py`` (the same implementation), over shm and over tcp.
Hypothesis drives allocate / register (writable and read-only) / free / unregister on
both sides, fills, writes, reads and batches, including ranges that are out of bounds,
unregistered, or stale (freed, maybe reused by a later allocation). Every operation that
succeeds must leave the bytes the model says; every refused one raises AddressError; the
peer never crashes; each run ends with as many fds and regions as it started with.

``MOONCAKE_SOAK=1`` runs many more and longer sequences (see README).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import LineChild, wait_until
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.errors import AddressError
from mooncake_plugins.transfer import OpCode, TransferEngine, TransferRequest

SOAK = os.environ.get("MOONCAKE_SOAK") == "1"
SETTINGS = settings(max_examples=int(os.environ.get("MOONCAKE_SOAK_EXAMPLES", 400)) if SOAK else 40, stateful_step_count=60 if SOAK else 40,
                    deadline=None, database=None, suppress_health_check=list(HealthCheck))
SIZES = st.sampled_from([1, 100, 4096, 20000, 65536 + 3])
PEER = str(Path(__file__).with_name("model_peer.py"))


class ModelPeer(LineChild):
    def call(self, *args: object) -> object:
        reply = json.loads(self.ask(" ".join(map(str, args)), 30))
        if "error" in reply:
            raise RuntimeError(f"peer: {' '.join(map(str, args))}: {reply['error']}")
        return reply["ok"]


@dataclass
class Local:
    kind: str        # alloc | reg | ro
    handle: object   # ManagedBuffer or Region
    memory: object   # what to read the real bytes from
    model: bytearray


def _within(regions: dict[int, bytearray], address: int, nbytes: int) -> int | None:
    """The start of the model region holding the whole range, or None."""
    for start, model in regions.items():
        if start <= address and address + nbytes <= start + len(model):
            return start
    return None


def _pick(data: st.DataObject, addresses: object) -> int:
    """One of ``addresses`` by position in creation order (never by address: those differ
    from run to run, and Hypothesis replays draws by position)."""
    items = list(addresses)
    return items[data.draw(st.integers(0, len(items) - 1))]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class EngineMachine(RuleBasedStateMachine):
    peer: ModelPeer
    transports: list[str]

    def __init__(self) -> None:
        super().__init__()
        self.peer.call("reset")
        self.fds = _fds()
        self.engine = TransferEngine(config=EngineConfig(transports=self.transports,
                                                         slice_nbytes=16 << 10, inline_nbytes=32 << 10))
        self.local: dict[int, Local] = {}
        self.remote: dict[int, bytearray] = {}
        self.remote_kind: dict[int, str] = {}
        self.stale_local: list[tuple[int, int]] = []
        self.stale_remote: list[tuple[int, int]] = []
        self.seed = 0

    @initialize()
    def start(self) -> None:
        pass

    # -- the peer's memory -------------------------------------------------------------
    @rule(kind=st.sampled_from(["alloc", "reg"]), nbytes=SIZES)
    def remote_add(self, kind: str, nbytes: int) -> None:
        address = self.peer.call(kind, nbytes)
        self.remote[address] = bytearray(nbytes)
        self.remote_kind[address] = kind

    @precondition(lambda self: self.remote)
    @rule(data=st.data())
    def remote_remove(self, data: st.DataObject) -> None:
        self.remote_remove_at(_pick(data, self.remote))

    @precondition(lambda self: self.remote)
    @rule(data=st.data())
    def remote_recycle(self, data: st.DataObject) -> None:
        """Free a region and at once take one of the same size (often the same address)."""
        address = _pick(data, self.remote)
        nbytes, kind = len(self.remote[address]), self.remote_kind[address]
        self.remote_remove_at(address)
        self.remote_add(kind, nbytes)

    def remote_remove_at(self, address: int) -> None:
        self.peer.call("free" if self.remote_kind.pop(address) == "alloc" else "unreg", address)
        self.stale_remote.append((address, len(self.remote.pop(address))))

    @precondition(lambda self: self.remote)
    @rule(data=st.data())
    def remote_fill(self, data: st.DataObject) -> None:
        address = _pick(data, self.remote)
        self.seed += 1
        self.peer.call("fill", address, self.seed)
        self.remote[address][:] = random.Random(self.seed).randbytes(len(self.remote[address]))

    # -- our memory ----------------------------------------------------------------------
    @rule(kind=st.sampled_from(["alloc", "reg", "ro"]), nbytes=SIZES)
    def local_add(self, kind: str, nbytes: int) -> None:
        self.seed += 1
        init = random.Random(self.seed).randbytes(nbytes) if kind == "ro" else bytes(nbytes)
        if kind == "alloc":
            handle = self.engine.allocate(nbytes)
            memory, address = handle, handle.address
        else:
            memory = bytearray(init) if kind == "reg" else bytes(init)
            handle = self.engine.register(memory)
            address = handle.address
        self.local[address] = Local(kind, handle, memory, bytearray(init))

    @precondition(lambda self: self.local)
    @rule(data=st.data())
    def local_remove(self, data: st.DataObject) -> None:
        address = _pick(data, self.local)
        entry = self.local.pop(address)
        if entry.kind == "alloc":
            self.engine.free(entry.handle)
        else:
            self.engine.unregister(entry.handle)
        self.stale_local.append((address, len(entry.model)))

    @precondition(lambda self: any(e.kind != "ro" for e in self.local.values()))
    @rule(data=st.data())
    def local_fill(self, data: st.DataObject) -> None:
        address = _pick(data, [a for a, e in self.local.items() if e.kind != "ro"])
        entry = self.local[address]
        self.seed += 1
        fresh = random.Random(self.seed).randbytes(len(entry.model))
        with self.engine.local_view(address, len(fresh)) as view:
            view[:] = fresh
        entry.model[:] = fresh

    # -- transfers -----------------------------------------------------------------------
    def _range(self, data: st.DataObject, live: dict[int, int], stale: list[tuple[int, int]],
               ) -> tuple[int, int]:
        """A range in a live region (mostly), past its end, or in a stale one."""
        choices = [("live", a, n) for a, n in live.items()] + [("stale", a, n) for a, n in stale]
        if not choices:
            return 4096, 16  # never registered anywhere
        _, start, size = data.draw(st.sampled_from(choices))
        offset = data.draw(st.integers(0, size - 1))
        nbytes = data.draw(st.one_of(st.integers(1, size - offset),
                                     st.integers(size - offset + 1, size - offset + 64)))
        return start + offset, nbytes

    def _local_sizes(self) -> dict[int, int]:
        return {a: len(e.model) for a, e in self.local.items()}

    def _expect(self, op: OpCode, local: int, remote: int, nbytes: int) -> bool:
        lstart = _within({a: e.model for a, e in self.local.items()}, local, nbytes)
        rstart = _within(self.remote, remote, nbytes)
        if lstart is None or rstart is None:
            return False
        return not (op is OpCode.READ and self.local[lstart].kind == "ro")

    def _apply(self, op: OpCode, local: int, remote: int, nbytes: int) -> None:
        lstart = _within({a: e.model for a, e in self.local.items()}, local, nbytes)
        rstart = _within(self.remote, remote, nbytes)
        lm, rm = self.local[lstart].model, self.remote[rstart]
        lo, ro = local - lstart, remote - rstart
        if op is OpCode.WRITE:
            rm[ro:ro + nbytes] = lm[lo:lo + nbytes]
        else:
            lm[lo:lo + nbytes] = rm[ro:ro + nbytes]

    @rule(data=st.data(), op=st.sampled_from([OpCode.READ, OpCode.WRITE]))
    def transfer(self, data: st.DataObject, op: OpCode) -> None:
        local, nbytes = self._range(data, self._local_sizes(), self.stale_local)
        remote, rn = self._range(data, {a: len(m) for a, m in self.remote.items()}, self.stale_remote)
        nbytes = min(nbytes, rn) if data.draw(st.booleans()) else nbytes
        ok = self._expect(op, local, remote, nbytes)
        fn = self.engine.write if op is OpCode.WRITE else self.engine.read
        if ok:
            fn(self.peer.info["segment"], local, remote, nbytes, timeout_s=30)
            self._apply(op, local, remote, nbytes)
        else:
            with pytest.raises(AddressError):
                fn(self.peer.info["segment"], local, remote, nbytes, timeout_s=30)

    @precondition(lambda self: self.remote and any(e.kind != "ro" for e in self.local.values()))
    @rule(data=st.data(), count=st.integers(1, 12))
    def batch(self, data: st.DataObject, count: int) -> None:
        """Several requests in one batch; each one's error (or success) is its own."""
        requests, expected = [], []
        writable = {a: len(e.model) for a, e in self.local.items() if e.kind != "ro"}
        for _ in range(count):
            op = data.draw(st.sampled_from([OpCode.READ, OpCode.WRITE]))
            local, nbytes = self._range(data, writable, [])
            remote, rn = self._range(data, {a: len(m) for a, m in self.remote.items()},
                                     self.stale_remote)
            start = _within({a: bytearray(n) for a, n in writable.items()}, local, 1)
            nbytes = min(nbytes, rn, start + writable[start] - local)  # local stays in bounds
            requests.append(TransferRequest(op, local, remote, nbytes))
            expected.append(self._expect(op, local, remote, nbytes))
        if not requests:
            return
        # requests touching the same bytes would race each other: keep the first of those
        keep, seen_local, seen_remote = [], [], []
        for r, ok in zip(requests, expected):
            lr, rr = (r.local_address, r.nbytes), (r.remote_address, r.nbytes)
            if any(_overlap(lr, x) for x in seen_local) or any(_overlap(rr, x) for x in seen_remote):
                continue
            keep.append((r, ok))
            seen_local.append(lr)
            seen_remote.append(rr)
        batch = self.engine.submit(self.peer.info["segment"], [r for r, _ in keep])
        assert batch.wait_done(30)
        for (r, ok), err in zip(keep, batch.errors()):
            if ok:
                assert err is None, (r, err)
                self._apply(r.op, r.local_address, r.remote_address, r.nbytes)
            else:
                assert isinstance(err, AddressError), (r, err)

    # -- checks --------------------------------------------------------------------------
    @invariant()
    def local_bytes_match(self) -> None:
        for address, entry in self.local.items():
            with self.engine.local_view(address, len(entry.model)) as view:
                assert view == entry.model, f"local region 0x{address:x} ({entry.kind}) differs"

    @precondition(lambda self: self.remote)
    @rule(data=st.data())
    def remote_bytes_match(self, data: st.DataObject) -> None:
        address = _pick(data, self.remote)
        assert self.peer.call("sha", address) == hashlib.sha256(self.remote[address]).hexdigest()

    def teardown(self) -> None:
        for address, model in self.remote.items():
            assert self.peer.call("sha", address) == hashlib.sha256(model).hexdigest()
        self.engine.close()
        self.peer.call("reset")
        assert self.peer.call("count")["regions"] == 0
        assert wait_until(lambda: _fds() <= self.fds, 5), f"fds {self.fds} -> {_fds()}"


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


@pytest.mark.parametrize("transports", [["shm", "tcp"], ["tcp"]], ids=["shm", "tcp"])
def test_engine_against_model(impl, impl_env, transports):
    peer = ModelPeer([sys.executable, PEER], env={**os.environ, **impl_env})
    try:
        fds = json.loads(peer.ask("count", 30))["ok"]["fds"]
        machine = type("Machine", (EngineMachine,), {"peer": peer, "transports": transports})
        run_state_machine_as_test(machine, settings=SETTINGS)
        assert json.loads(peer.ask("count", 30))["ok"]["fds"] <= fds + 2, "the peer leaks fds"
    finally:
        peer.close()
