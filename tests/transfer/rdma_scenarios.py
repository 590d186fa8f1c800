"""Scenarios of the rdma transport over the libibverbs test double (``verbs_double.c``).

Each runs in a fresh process (``python rdma_scenarios.py NAME``, started by
``test_rdma_double.py`` with the double's environment), because the first libibverbs a
process loads stays loaded. A scenario prints ``ok`` at its end; an assertion or error
exits non-zero with its traceback.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import json
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.errors import (AddressError, MooncakeError, TransferError,
                                     TransportUnavailable)
from mooncake_plugins.transfer import OpCode, TransferEngine, verbs

HERE = Path(__file__).parent
MiB = 1 << 20


def engine(transports: tuple[str, ...] = ("rdma",), **config) -> TransferEngine:
    cfg = EngineConfig(transports=list(transports), slice_nbytes=256 << 10, retries=1, **config)
    return TransferEngine("127.0.0.1", "P2PHANDSHAKE", config=cfg)


def live() -> int:
    """The double's live objects (contexts, PDs, MRs, CQs, QPs) in this process."""
    return ctypes.CDLL(os.environ["MOONCAKE_LIBIBVERBS"]).verbs_double_live()


def rdma_of(e: TransferEngine):
    return next(t for t in e._transports if t.name == "rdma")


def mr_access(address: int) -> list[int]:
    """Access flags of the double's published memory regions starting at ``address``."""
    from verbs_double import read_mr
    out = []
    for path in glob.glob(os.path.join(os.environ["VERBS_DOUBLE_DIR"], "mr-*")):
        mr = read_mr(path)
        if mr and mr["pid"] == os.getpid() and mr["addr"] == address:
            out.append(mr["access"])
    return out


def forge(e: TransferEngine, segment: str, region) -> None:
    """Put ``region`` into ``e``'s cached descriptor of ``segment`` (a lying initiator)."""
    peer = e.open_segment(segment)
    d = peer.descriptor
    regions = [r for r in d.regions if r.address != region.address] + [region]
    peer.descriptor = dataclasses.replace(d, regions=regions)


class Logs(logging.Handler):
    """The rdma transport's log messages, kept."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []
        log = logging.getLogger("mooncake_plugins.transfer.transports.rdma")
        log.addHandler(self)
        log.setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def take(self, text: str) -> int:
        """How many messages so far contain ``text``; forgets every message."""
        count = sum(text in m for m in self.messages)
        self.messages.clear()
        return count


def roundtrip() -> None:
    """Bytes equal both ways, odd sizes, over both NIC pairs; tcp serves nothing."""
    with engine() as a, engine() as b:
        assert [t.name for t in b._transports] == ["rdma"]
        desc = b.open_segment(a.segment_name).descriptor
        assert len(desc.rdma) == 2, desc.rdma
        n = 8 * MiB + 3
        dst = a.allocate(n)
        plain = bytearray(3 * MiB + 5)
        pr = a.register(plain)
        src = b.allocate(n)
        back = b.allocate(n)
        data = random.randbytes(n)
        src.view()[:] = data
        b.write(a.segment_name, src.address, dst.address, n)
        assert bytes(dst.view()) == data
        items = [(0, 1), (4096, 4097), (MiB, 2 * MiB + 5)]
        errs = b.transfer_many(OpCode.WRITE, {a.segment_name: [
            (src.address + off, pr.address + off, k) for off, k in items]})
        assert errs == {a.segment_name: [None] * 3}, errs
        for off, k in items:
            assert plain[off:off + k] == data[off:off + k]
        b.read(a.segment_name, back.address, dst.address, n)
        assert bytes(back.view()) == data
        assert a.stats == {"bytes_in": 0, "bytes_out": 0}, a.stats
        desc = b.open_segment(a.segment_name).descriptor
        assert all(len(r.rkeys) == 2 for r in desc.regions), desc.regions
        paths = b.path_stats()
        used = {p.split("->")[0] for p, s in paths.items() if s["bytes"] > 0}
        assert used == {"rdma:double0", "rdma:double1"}, paths
        assert sum(s["bytes"] for s in paths.values()) == 2 * n + sum(k for _, k in items), paths
    assert live() == 0, live()
    print("ok")


def refusals() -> None:
    """A read-only, a private and an out-of-bounds region stay untouched, even when the
    initiator lies about them: the NIC refuses (the double's remote access error) and
    the engine reports the range's real state."""
    logs = Logs()
    nic_refused = "broken (remote access error)"
    with engine() as a, engine() as b:
        src = b.allocate(MiB)
        src.view()[:] = b"\x55" * MiB
        ro_bytes = bytes(8192)
        ro = a.register(ro_bytes)
        private = bytearray(8192)
        pv = a.register(private, private=True)
        small = a.allocate(8192)
        native = verbs.native()
        assert mr_access(ro.address) and all(not f & native.ACCESS_REMOTE_WRITE
                                              for f in mr_access(ro.address))
        assert mr_access(pv.address) and all(f == native.ACCESS_LOCAL_WRITE
                                              for f in mr_access(pv.address))
        seg = a.segment_name

        def refused(remote: int, n: int) -> str:
            try:
                b.write(seg, src.address, remote, n)
            except AddressError as exc:
                return str(exc)
            raise AssertionError(f"write to 0x{remote:x}+{n} was not refused")

        assert "read-only" in refused(ro.address, 4096)
        desc = b.open_segment(seg).descriptor
        ro_info = desc.find(ro.address, 4096)
        forge(b, seg, dataclasses.replace(ro_info, readonly=False))
        assert logs.take(nic_refused) == 0
        why = refused(ro.address, 4096)
        assert "read-only" in why and logs.take(nic_refused) == 1, (why, logs.messages)
        assert ro_bytes == bytes(8192)
        guessed = tuple(int(os.path.basename(p)[3:], 16) for p in
                        glob.glob(os.path.join(os.environ["VERBS_DOUBLE_DIR"], "mr-*"))
                        if _mr_at(p, pv.address))
        forge(b, seg, dataclasses.replace(ro_info, address=pv.address, nbytes=8192,
                                          readonly=False, rkeys=guessed))
        why = refused(pv.address, 4096)
        assert "not inside" in why and logs.take(nic_refused) == 1, why
        assert private == bytearray(8192)
        big = dataclasses.replace(b.open_segment(seg).descriptor.find(small.address, 8192),
                                  nbytes=MiB)
        forge(b, seg, big)
        why = refused(small.address, MiB)
        assert "not inside" in why and logs.take(nic_refused) == 1, why
        assert bytes(small.view()) == bytes(8192)
        assert b.read(seg, src.address, small.address, 8192) is None  # still serving
    assert live() == 0, live()
    print("ok")


def _mr_at(path: str, address: int) -> bool:
    from verbs_double import read_mr
    mr = read_mr(path)
    return bool(mr) and mr["addr"] == address


def revoke() -> None:
    """Unregistering revokes the rkeys at once (a stale initiator is refused, the memory
    unchanged); memory registered again at the same address is reached with its new keys."""
    logs = Logs()
    with engine() as a, engine() as b:
        seg = a.segment_name
        src = b.allocate(MiB)
        src.view()[:] = b"\x11" * MiB
        target = bytearray(MiB)
        region = a.register(target)
        b.write(seg, src.address, region.address, MiB)
        assert target == b"\x11" * MiB
        stale = b.open_segment(seg).descriptor
        a.unregister(region)
        target[:] = bytes(MiB)
        b.open_segment(seg).descriptor = stale
        src.view()[:] = b"\x22" * MiB
        try:
            b.write(seg, src.address, region.address, MiB)
            raise AssertionError("a write through revoked keys succeeded")
        except AddressError as exc:
            assert "not inside" in str(exc), exc
        assert logs.take("broken (remote access error)") == 1
        assert target == bytes(MiB)
        old_keys = stale.find(region.address, MiB).rkeys
        again = a.register(target)
        assert again.address == region.address
        b.open_segment(seg).descriptor = stale  # stale keys for live memory: retried fresh
        b.write(seg, src.address, again.address, MiB)
        assert target == b"\x22" * MiB
        assert logs.take("broken (remote access error)") == 1  # the stale keys, then fresh
        fresh = b.open_segment(seg).descriptor.find(again.address, MiB).rkeys
        assert fresh != old_keys
    assert live() == 0, live()
    print("ok")


def link_down() -> None:
    """A completion failing mid-transfer (VERBS_DOUBLE_FAIL_AFTER=5: the sixth work
    request) breaks the connection; the slices that did not move are retried on a new
    one and every byte arrives."""
    logs = Logs()
    with engine() as a, engine() as b:
        n = 4 * MiB  # 16 slices
        dst = a.allocate(n)
        src = b.allocate(n)
        data = random.randbytes(n)
        src.view()[:] = data
        b.write(a.segment_name, src.address, dst.address, n)
        assert bytes(dst.view()) == data
        messages = list(logs.messages)
        # the batch that saw the failed request, or one whose requests it flushed on the
        # same queue pair (the engine runs a batch's tasks on two workers), says so first
        assert logs.take("broken (") == 1, messages
        assert any("broken (transport retry counter exceeded)" in m
                   or "broken (work request flushed)" in m for m in messages), messages
        assert sum(m.startswith("rdma connected to") for m in messages) == 2, messages
        assert a.stats == {"bytes_in": 0, "bytes_out": 0}, a.stats
        b.read(a.segment_name, src.address, dst.address, n)  # the new connection serves on
    assert live() == 0, live()
    print("ok")


def path_pause() -> None:
    """A path whose request fails (VERBS_DOUBLE_FAIL_AFTER=5) is paused: the transfer
    completes over the other NIC pair, the next one uses only that pair, and after the
    pause (1 s here) both carry bytes again (within a few writes)."""
    logs = Logs()
    with engine(path_pause_s=1.0) as a, engine(path_pause_s=1.0) as b:
        n = 4 * MiB
        dst = a.allocate(n)
        src = b.allocate(n)
        data = random.randbytes(n)
        src.view()[:] = data
        b.write(a.segment_name, src.address, dst.address, n)
        assert bytes(dst.view()) == data
        stats = b.path_stats()
        paused = [p for p, st in stats.items() if st["paused"]]
        assert len(paused) == 1 and stats[paused[0]]["failures"] == 1, stats
        assert logs.take("failed (transport retry counter exceeded)") == 1

        def moved() -> dict[str, int]:
            return {p: st["bytes"] for p, st in b.path_stats().items()}

        before = moved()
        b.write(a.segment_name, src.address, dst.address, n)
        grew = {p for p, k in moved().items() if k > before.get(p, 0)}
        assert grew == set(stats) - set(paused), (grew, paused)
        deadline = time.monotonic() + 10
        while any(st["paused"] for st in b.path_stats().values()):   # the pause ends
            assert time.monotonic() < deadline, b.path_stats()
            time.sleep(0.02)
        # both carry bytes again: a path takes the next slice when it is free, so on a
        # loaded machine one write may go over one path alone; a few writes use both
        before = moved()
        for _ in range(20):
            b.write(a.segment_name, src.address, dst.address, n)
            grew = {p for p, k in moved().items() if k > before.get(p, 0)}
            if grew == set(stats):
                break
        assert grew == set(stats), (grew, b.path_stats())
        assert not any(st["paused"] for st in b.path_stats().values())
        assert bytes(dst.view()) == data
    assert live() == 0, live()
    print("ok")


def peer(*args: str):
    """``peer.py`` in its own process with rdma as its only transport (helpers.LineChild)."""
    from helpers import LineChild
    return LineChild([sys.executable, str(HERE / "peer.py"), "--transports", "rdma", *args],
                     env=dict(os.environ))


def peer_killed() -> None:
    """A peer process killed -9: the transfer fails with a TransferError within seconds,
    and the engine goes on serving other peers."""
    from peer import pattern
    child = peer("--nbytes", str(4 * MiB))
    try:
        info = child.info
        with engine() as b:
            buf = b.allocate(4 * MiB)
            b.read(info["segment"], buf.address, info["address"], 4 * MiB)
            assert bytes(buf.view()) == pattern(1, 4 * MiB)
            os.kill(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
            t0 = time.monotonic()
            try:
                b.write(info["segment"], buf.address, info["address"], 4 * MiB, timeout_s=60)
                raise AssertionError("a write to a dead peer succeeded")
            except TransferError as exc:
                print("dead peer:", exc)
            elapsed = time.monotonic() - t0
            assert elapsed < 15, elapsed
            with engine() as c:
                other = c.allocate(MiB)
                b.write(c.segment_name, buf.address, other.address, MiB)
                assert bytes(other.view()) == bytes(buf.view()[:MiB])
    finally:
        child.close()
    print("ok")


def two_process() -> None:
    """Against a peer process: write and read 8 MiB, the peer's tcp server moves nothing."""
    import hashlib
    from peer import pattern
    child = peer("--nbytes", str(8 * MiB), "--plain")
    try:
        info = child.info
        with engine() as b:
            buf = b.allocate(8 * MiB)
            data = random.randbytes(8 * MiB)
            buf.view()[:] = data
            b.write(info["segment"], buf.address, info["address"], 8 * MiB)
            assert child.ask("sha") == hashlib.sha256(data).hexdigest()
            assert child.ask("fill 5") == "ok"
            b.read(info["segment"], buf.address, info["address"], 8 * MiB)
            assert bytes(buf.view()) == pattern(5, 8 * MiB)
            assert json.loads(child.ask("stats")) == {"bytes_in": 0, "bytes_out": 0}
    finally:
        child.close()
    print("ok")


def handshake() -> None:
    """``rdma_connect`` is validated: a bad NIC index is refused with a reply, a bad GID
    closes that connection; the target keeps serving and caps the queue pairs one
    initiator may hold."""
    from mooncake_plugins.transfer.transports import rdma
    with engine() as a, engine(("rdma", "tcp")) as b:
        ctl = b._control
        port = a.rpc_port
        gid = "0000:0000:0000:0000:0000:ffff:7f00:0001"
        try:
            ctl.control("127.0.0.1", port, "rdma_connect", segment="x",
                        qps=[[5, 77, 1, gid, 0, 4096]])
            raise AssertionError("NIC 5 accepted")
        except MooncakeError as exc:
            assert "NIC 5" in str(exc), exc
        try:
            ctl.control("127.0.0.1", port, "rdma_connect", segment="x",
                        qps=[[0, 77, 1, "not-a-gid", 0, 4096]])
            raise AssertionError("a bad GID accepted")
        except MooncakeError as exc:
            print("bad gid:", exc)
        assert ctl.control("127.0.0.1", port, "ping") == b"pong"
        rd_b = rdma_of(b)
        qp = rd_b._nics[0].dev.create_qp(16)
        try:
            for _ in range(rdma.MAX_QPS_PER_SEGMENT // 4 + 3):
                ctl.control("127.0.0.1", port, "rdma_connect", segment="greedy",
                            qps=[[0, qp.qp_num, 1, rd_b._nics[0].gid_text, 0, 4096]] * 4)
            held = rdma_of(a)._accepted["greedy"]
            assert len(held) == rdma.MAX_QPS_PER_SEGMENT, len(held)
        finally:
            qp.close()
    assert live() == 0, live()
    print("ok")


def gid_choice() -> None:
    """The RoCE v2 IPv4 GID by default; MC_GID_INDEX=0 forces the link-local one, and
    both ends must agree for queue pairs to come up (the double checks the GID)."""
    with engine() as a:
        nics = a.descriptor().rdma
        assert all(n[1].endswith(":ffff:7f00:0001") or ":ffff:7f00:" in n[1] for n in nics), nics
    os.environ["MC_GID_INDEX"] = "0"
    try:
        with engine() as a, engine() as b:
            assert all(n[1].startswith("fe80") for n in a.descriptor().rdma)
            src, dst = b.allocate(MiB), a.allocate(MiB)
            src.view()[:] = b"\x07" * MiB
            b.write(a.segment_name, src.address, dst.address, MiB)
            assert bytes(dst.view()) == b"\x07" * MiB
    finally:
        del os.environ["MC_GID_INDEX"]
    print("ok")


def model() -> None:
    """The engine model test (``test_engine_model.py``: random registrations, frees,
    fills, transfers and batches, stale and out-of-bounds ranges, against a dict model)
    with rdma as the only transport on both sides; then no memory region or queue pair of
    either process is left with the double."""
    from hypothesis.stateful import run_state_machine_as_test
    from test_engine_model import PEER, SETTINGS, EngineMachine, ModelPeer
    peer = ModelPeer([sys.executable, PEER, "--transports", "rdma"], env=dict(os.environ))
    try:
        machine = type("Machine", (EngineMachine,), {"peer": peer, "transports": ["rdma"]})
        run_state_machine_as_test(machine, settings=SETTINGS)
        from verbs_double import read_mr
        pid = peer.proc.pid
        left = [p for p in glob.glob(os.path.join(os.environ["VERBS_DOUBLE_DIR"], "mr-*"))
                if (read_mr(p) or {}).get("pid") == pid]
        assert not left, f"the peer keeps {len(left)} memory regions after its reset"
    finally:
        peer.close()
    assert live() == 0, live()
    print("ok")


def no_device() -> None:
    """No RDMA device: one sentence; an engine told to use rdma alone does not start, and
    one with the default transports starts without rdma and moves bytes with the others."""
    assert verbs.why_unavailable() == "no RDMA device: libibverbs lists none", \
        verbs.why_unavailable()
    try:
        engine().close()
    except TransportUnavailable as exc:
        assert str(exc).startswith("no RDMA device: libibverbs lists none"), exc
    else:
        raise AssertionError("an engine with rdma alone started without an RDMA device")
    with TransferEngine("127.0.0.1") as a, TransferEngine("127.0.0.1") as b:
        assert "rdma" not in [t.name for t in a._transports]
        dst = a.allocate(MiB)
        src = b.allocate(MiB)
        src.view()[:] = b"\x03" * MiB
        b.write(a.segment_name, src.address, dst.address, MiB)
        assert bytes(dst.view()) == b"\x03" * MiB
        assert "rdma" not in a.descriptor().to_wire()
    from mooncake_plugins.cli.doctor import transports
    row = dict(transports())["rdma"]
    assert "no RDMA device" in row, row
    print("ok")


if __name__ == "__main__":
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    globals()[sys.argv[1]]()
