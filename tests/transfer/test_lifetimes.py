"""Memory lifetimes: buffers freed, reallocated, viewed, unregistered and closed under peers.

Each test runs on the native and on the pure-Python data path (the ``impl`` fixture).
The first three are the reproductions of issue 10: a silent lost write over shm after a
free + allocate at the same address, and two interpreter crashes through views.
"""

import hashlib
import logging
import subprocess
import sys
import textwrap
import threading

import pytest
from helpers import require_module

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.errors import RegionBusy
from mooncake_plugins.transfer import TransferEngine, memory
from mooncake_plugins.transfer.same_host import EPOCH

MiB = 1 << 20


def shm_engine(**kw) -> TransferEngine:
    return TransferEngine(config=EngineConfig(transports=["shm", "tcp"], **kw))


def test_write_after_peer_reallocates_same_address_lands(spawn_peer, impl, impl_env):
    """Issue 10 defect 1: free + allocate gives the same fd and address; no write is lost."""
    peer = spawn_peer("--nbytes", str(MiB), env=impl_env)
    with shm_engine() as e:
        assert e._paths(e.open_segment(peer.segment), None)[0].name == "shm"  # a genuine peer
        src = e.allocate(MiB)
        for round_, byte in enumerate(b"AB"):
            src.view()[:] = bytes([byte]) * MiB
            e.write(peer.segment, src.address, peer.address, MiB)
            assert peer.ask("sha") == hashlib.sha256(bytes([byte]) * MiB).hexdigest(), round_
            if round_ == 0:
                again = int(peer.ask("realloc"))
                assert again == peer.address  # the reproduction's premise: same address
        # and reads see the new buffer, not the orphaned one
        src.view()[:] = b"\0" * MiB
        e.read(peer.segment, src.address, peer.address, MiB)
        assert bytes(src.view()[:4]) == b"BBBB"


CRASHERS = {
    "managed view after free": """
        buf = e.allocate(1 << 20)
        v = buf.view()
        e.free(buf)
        v[0] = 1; v[-1] = 2
        assert v[0] == 1 and v[-1] == 2
    """,
    "local_view after free": """
        buf = e.allocate(1 << 20)
        v = e.local_view(buf.address + 4096, 4096)
        e.free(buf)
        v[:] = b"x" * 4096
    """,
    "local_view after unregister of a bytearray": """
        data = bytearray(1 << 20)
        region = e.register(data)
        v = e.local_view(region.address, 1 << 20)
        e.unregister(region)
        del data
        v[:] = b"y" * (1 << 20)
    """,
    "local_view after unregister of a tensor": """
        import torch
        t = torch.zeros(1 << 18, dtype=torch.float32)
        region = e.register(t)
        v = e.local_view(region.address, 1 << 20)
        e.unregister(region)
        del t
        v[:] = b"z" * (1 << 20)
    """,
    "views after close": """
        buf = e.allocate(1 << 20)
        v, w = buf.view(), e.local_view(buf.address, 16)
        e.close()
        v[0] = 1; w[1] = 2
    """,
}


@pytest.mark.parametrize("case", sorted(CRASHERS))
def test_no_view_sequence_crashes_the_interpreter(case, impl_env):
    """Issue 10 defect 3: in a child, so a regression shows as a signal, not a dead session."""
    if "tensor" in case:
        require_module("torch", "the tensor cases register torch tensors")
    code = "from mooncake_plugins.transfer import TransferEngine\ne = TransferEngine()\n" \
        + textwrap.dedent(CRASHERS[case]) + "\nprint('ok')\n"
    proc = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, **impl_env},
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr.decode()[-2000:])
    assert proc.stdout.strip() == b"ok"


def test_view_semantics_after_free(impl):
    e = TransferEngine()
    try:
        buf = e.allocate(MiB)
        v = buf.view()
        v[:5] = b"hello"
        e.free(buf)  # succeeds: the view keeps its pages, no peer reaches them any more
        assert bytes(v[:5]) == b"hello"
        with pytest.raises(BufferError):
            buf.view()
        again = e.allocate(MiB)  # the old pages are still mapped: a different address
        assert again.address != buf.address
        v.release()
        data = bytearray(4096)
        region = e.register(data)
        w = e.local_view(region.address + 10, 10)
        e.unregister(region)
        with pytest.raises(BufferError):  # the view still holds the bytearray's export
            data.extend(b"more")
        w.release()
        data.extend(b"more")  # and lets go with the view
    finally:
        e.close()


class _Spy:
    """Wraps what holds a region's memory: records the peer-visible epoch when it is let go."""

    def __init__(self, inner, engine: TransferEngine, seen: list) -> None:
        self.inner, self.engine, self.seen = inner, engine, seen

    def _record(self) -> None:
        self.seen.append(EPOCH.unpack_from(self.engine._epoch.map, 0)[0])

    def release(self) -> None:  # a registered buffer's export
        self._record()
        self.inner.release()

    def close(self) -> None:  # a managed buffer's memfd
        self._record()
        self.inner.close()


def test_peers_learn_of_unregister_and_free_before_memory_goes(impl):
    """The epoch page (what same-host peers check) changes before memory is released."""
    with shm_engine() as e:
        seen: list[int] = []
        region = e.register(bytearray(4096))
        region.keepalive = _Spy(region.keepalive, e, seen)
        e.unregister(region)
        buf = e.allocate(4096)
        e._managed[buf.address] = (buf, _Spy(e._managed[buf.address][1], e, seen))
        e.free(buf)
        assert seen == [2, 4]  # register 1, unregister 2, allocate 3, free 4: each already out


def _in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


class StuckWrite:
    """A write from ``a`` into a fresh buffer of ``b`` whose memcpy waits for ``finish()``."""

    def __init__(self, started: threading.Event, release: threading.Event) -> None:
        self._started, self._release = started, release

    def start(self, a: TransferEngine, b: TransferEngine, nbytes: int, byte: bytes = b"q"):
        """Start it; returns the target buffer once the copy is in flight."""
        src, self.dst = a.allocate(nbytes), b.allocate(nbytes)
        src.view()[:] = byte * nbytes
        self._thread, self._out = _in_thread(a.write, b.segment_name, src.address,
                                             self.dst.address, nbytes)
        assert self._started.wait(10)
        return self.dst

    def finish(self) -> None:
        """Let the copy go on; it must then succeed."""
        self._release.set()
        self._thread.join(10)
        assert self._out == [None]


@pytest.fixture
def stuck_write(monkeypatch):
    """Make the next shm memcpy wait, so a test can act while a write is in flight."""
    started, release = threading.Event(), threading.Event()
    real = memory.copy_many

    def copy_many(copies):
        started.set()
        assert release.wait(30)
        real(copies)

    monkeypatch.setattr(memory, "copy_many", copy_many)
    yield StuckWrite(started, release)
    release.set()


def test_same_process_shm_copy_holds_the_target_region(impl, stuck_write):
    with shm_engine() as a, shm_engine() as b:
        dst = stuck_write.start(a, b, 4096)
        with pytest.raises(RegionBusy):
            b.free(dst, wait_s=0.05)  # the copy into it is in flight
        stuck_write.finish()
        assert bytes(dst.view()) == b"q" * 4096
        b.free(dst)


def test_close_waits_for_in_flight_copies(impl, stuck_write):
    a, b = shm_engine(), shm_engine()
    try:
        stuck_write.start(a, b, MiB)
        closer, closed = _in_thread(b.close)
        closer.join(0.3)
        assert closer.is_alive()  # close waits for the copy into its memory
        stuck_write.finish()
        closer.join(10)
        assert closed == [None]
    finally:
        a.close()
        b.close()


def test_close_leaks_rather_than_unmaps_under_a_stuck_copy(impl, stuck_write, caplog):
    a, b = shm_engine(), shm_engine()
    try:
        stuck_write.start(a, b, MiB)
        with caplog.at_level(logging.ERROR):
            b.close(wait_s=0.1)
        assert "left mapped" in caplog.text
        stuck_write.finish()  # the copy now writes into memory that is still mapped: no crash
        b.close()  # again: now it is free, and released
        assert not len(b._regions) and b._epoch.map.closed
    finally:
        a.close()


def test_free_does_not_hold_the_engine_lock_while_waiting(impl, stuck_write, monkeypatch):
    with shm_engine() as a, shm_engine() as b:
        dst = stuck_write.start(a, b, 4096)
        waiting = threading.Event()
        real_remove = b._regions.remove

        def remove(address, wait_s=1.0):  # where free() waits for the copy into dst
            waiting.set()
            return real_remove(address, wait_s)

        monkeypatch.setattr(b._regions, "remove", remove)
        freer, freed = _in_thread(b.free, dst, 60.0)
        assert waiting.wait(30), "free() did not get to waiting for the copy"
        # free() now waits (the copy into dst is stuck): the engine lock must be free
        allocator, allocated = _in_thread(b.allocate, 4096)
        allocator.join(30)
        assert not allocator.is_alive(), "allocate() blocked behind a waiting free()"
        assert freer.is_alive() and freed == []  # the overlap did happen
        (other,) = allocated
        stuck_write.finish()
        freer.join(30)
        assert freed == [None]
        b.free(other)


def test_seqlock_repeats_a_copy_the_regions_changed_under():
    """The shm and cuda_ipc transports' one retry rule (ShmTransport.seqlocked): a copy is
    done once the peer's epoch stayed put around it, or its regions are still the same
    registrations; else it runs again on a fresh descriptor, and gives up after ATTEMPTS."""
    from mooncake_plugins.errors import TransferError
    from mooncake_plugins.transfer.peer import Peer
    from mooncake_plugins.transfer.segment import SegmentDescriptor
    from mooncake_plugins.transfer.transports.shm import ShmTransport

    def descriptor(epoch: int) -> SegmentDescriptor:
        return SegmentDescriptor("peer", "127.0.0.1", 1, 1, "h", epoch=epoch)

    def run(epochs: list[int], unchanged: bool) -> list[SegmentDescriptor]:
        t = ShmTransport()
        reads = iter(epochs)
        t._epoch_now = lambda desc: next(reads)  # the peer's epoch page, as read
        fetched = iter(descriptor(e) for e in range(10, 20))
        peer = Peer("peer", descriptor(1), lambda host, port: next(fetched))
        copied: list[SegmentDescriptor] = []
        try:
            t.seqlocked(peer, peer.descriptor, lambda d: copied.append(d) or "used",
                        lambda p, used: unchanged)
        finally:
            t.close()
        return copied

    assert len(run([1, 1], unchanged=False)) == 1       # the epoch stayed put: one copy
    assert len(run([1, 2], unchanged=True)) == 1        # changed, but not what we used
    again = run([1, 2, 2, 2], unchanged=False)          # changed under the copy: again,
    assert len(again) == 2 and again[1].epoch == 10     # on the descriptor fetched anew
    with pytest.raises(TransferError, match="kept changing"):
        run([1, 2] * ShmTransport.ATTEMPTS, unchanged=False)
