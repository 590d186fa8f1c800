"""Two engines in one process: data paths, batches, slicing and bounds, over each transport."""

import hashlib
import random

import numpy as np
import pytest
from helpers import wait_until

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.errors import (AddressError, InvalidArgument, RegionBusy, SegmentNotFound,
                                     to_code)
from mooncake_plugins.transfer import OpCode, TransferEngine, TransferRequest, TransferStatus

TRANSPORTS = {"tcp": ["tcp"], "shm": ["shm", "tcp"]}


@pytest.fixture(params=sorted(TRANSPORTS))
def pair(request):
    cfg = lambda: EngineConfig(transports=TRANSPORTS[request.param], slice_nbytes=64 << 10)
    a, b = TransferEngine(config=cfg()), TransferEngine(config=cfg())
    yield a, b
    a.close()
    b.close()


def fill(view, seed):
    view[:] = random.Random(seed).randbytes(len(view))


def test_write_then_read_back(pair):
    a, b = pair
    n = 3 * (1 << 20) + 12345  # not a multiple of the slice size
    src, dst = a.allocate(n), b.allocate(n)
    fill(src.view(), 1)
    a.write(b.segment_name, src.address, dst.address, n)
    assert hashlib.sha256(dst.view()).digest() == hashlib.sha256(src.view()).digest()
    back = bytearray(n)
    region = a.register(back)
    a.read(b.segment_name, region.address, dst.address, n)
    assert back == bytes(src.view())


def test_plain_memory_both_sides(pair):
    a, b = pair
    src = np.arange(1 << 18, dtype=np.uint32)
    dst = np.zeros_like(src)
    ra, rb = a.register(src), b.register(dst)
    a.write(b.segment_name, ra.address, rb.address, src.nbytes)
    assert np.array_equal(src, dst)


def test_batch_of_many_small_requests(pair):
    a, b = pair
    src, dst = a.allocate(1 << 20), b.allocate(1 << 20)
    fill(src.view(), 2)
    reqs = [TransferRequest(OpCode.WRITE, src.address + i * 4096, dst.address + (255 - i) * 4096, 4096)
            for i in range(256)]
    batch = a.submit(b.segment_name, reqs)
    batch.wait(30)
    assert batch.status() == TransferStatus.COMPLETED
    assert all(batch.request_status(i) == TransferStatus.COMPLETED for i in range(256))
    s, d = src.view(), dst.view()
    for i in (0, 17, 255):
        assert d[(255 - i) * 4096:(256 - i) * 4096] == s[i * 4096:(i + 1) * 4096]


def test_empty_batch_completes(pair):
    a, b = pair
    batch = a.submit(b.segment_name, [])
    batch.wait(1)
    assert batch.status() == TransferStatus.COMPLETED


def test_remote_out_of_bounds_refused_and_target_survives(pair):
    a, b = pair
    src, dst = a.allocate(1 << 16), b.allocate(1 << 16)
    for remote, n in ((dst.address + 1, 1 << 16), (dst.address - 4096, 4096), (8, 8)):
        with pytest.raises(AddressError):
            a.write(b.segment_name, src.address, remote, n)
        with pytest.raises(AddressError):
            a.read(b.segment_name, src.address, remote, n)
    a.write(b.segment_name, src.address, dst.address, 1 << 16)  # still serving


BAD_REMOTE = {
    "negative": lambda dst: (-1, 1),
    "negative-ending-at-0": lambda dst: (-4096, 4096),
    "negative-aliasing-a-region": lambda dst: (dst - (1 << 64), 4096),  # == dst mod 2**64
    "wraps-past-2**64": lambda dst: ((1 << 64) - 2048, 4096),
    "last-byte-plus-one": lambda dst: ((1 << 64) - 1, 2),
    "at-2**64": lambda dst: (1 << 64, 1),
}


@pytest.mark.parametrize("bad", sorted(BAD_REMOTE))
def test_a_bad_remote_address_is_an_invalid_argument(pair, bad):
    """A negative remote address, or one whose range wraps around 2**64, is refused by the
    batch layer as it is submitted: InvalidArgument (the original's -1), raised at once, no
    batch made, no byte moved; not an AddressError from the target (-5) later on the batch."""
    a, b = pair
    src, dst = a.allocate(1 << 20), b.allocate(1 << 16)
    fill(src.view(), 4)
    before_src, before_dst = bytes(src.view()), bytes(dst.view())
    remote, n = BAD_REMOTE[bad](dst.address)
    message = "within the address space"
    for op in (OpCode.WRITE, OpCode.READ):
        with pytest.raises(InvalidArgument, match=message) as info:
            a.submit(b.segment_name, [TransferRequest(op, src.address, remote, n)])
        assert to_code(info.value) == -1
        with pytest.raises(InvalidArgument, match=message):
            a.transfer(b.segment_name, op, src.address, remote, n, timeout_s=10)
        # transfer_many: the item's error, on the inline path (small) and the batch path
        # (an item over a slice)
        for nbytes in (n, max(n, 2 * a.config.slice_nbytes)):
            out = a.transfer_many(op, {b.segment_name: [(src.address, remote, nbytes)]},
                                  timeout_s=10)
            assert [type(e) for e in out[b.segment_name]] == [InvalidArgument], out
    assert bytes(src.view()) == before_src and bytes(dst.view()) == before_dst
    a.write(b.segment_name, src.address, dst.address, 4096)  # both still serve
    assert bytes(dst.view()[:4096]) == before_src[:4096]


def test_local_memory_must_be_registered(pair):
    a, b = pair
    dst = b.allocate(4096)
    stray = bytearray(4096)
    addr = a.register(stray).address
    a.unregister(addr)
    with pytest.raises(AddressError):
        a.write(b.segment_name, addr, dst.address, 4096)


def test_read_only_registration(pair):
    a, b = pair
    data = bytes(range(256)) * 16
    ro = b.register(data)  # peers may read it, not write it
    into = a.allocate(len(data))
    a.read(b.segment_name, into.address, ro.address, len(data))
    assert bytes(into.view()) == data
    with pytest.raises(AddressError):
        a.write(b.segment_name, into.address, ro.address, len(data))
    own_ro = a.register(b"x" * 4096)
    with pytest.raises(AddressError):
        a.read(b.segment_name, own_ro.address, ro.address, 4096)


def test_unregister_while_in_flight_is_refused(pair):
    a, b = pair
    buf = bytearray(1 << 16)
    region = a.register(buf)
    held = a._regions.acquire(region.address, 10)
    with pytest.raises(RegionBusy):
        a.unregister(region, wait_s=0.05)
    a._regions.release(held)
    a.unregister(region)
    buf.extend(b"ok")  # the export is released: the bytearray may be resized again


def test_registered_bytearray_cannot_be_resized(pair):
    a, _ = pair
    buf = bytearray(100)
    a.register(buf)
    with pytest.raises(BufferError):
        buf.extend(b"x")


def test_bad_inputs(pair):
    a, b = pair
    with pytest.raises(InvalidArgument):
        a.allocate(0)
    dst = b.allocate(4096)
    src = a.allocate(4096)
    for bad in (TransferRequest("write", src.address, dst.address, 3),
                TransferRequest(OpCode.WRITE, -1, dst.address, 3),
                TransferRequest(OpCode.WRITE, src.address, dst.address, 2.5),
                TransferRequest(OpCode.WRITE, src.address, True, 3)):
        with pytest.raises(InvalidArgument):
            a.submit(b.segment_name, [bad])
    with pytest.raises(InvalidArgument):
        a.register_address(4096, 0)
    with pytest.raises(InvalidArgument):
        a.unregister(12345)
    with pytest.raises(InvalidArgument):
        a.register(object())
    with pytest.raises(InvalidArgument):
        a.open_segment("no-port-here")
    with pytest.raises(SegmentNotFound):
        a.open_segment("127.0.0.1:1")


def test_notify(pair):
    a, b = pair
    a.notify(b.segment_name, "req-1", "done")
    assert b.take_notifies() == [("req-1", "done")]
    assert b.take_notifies() == []


def test_peer_registers_later_is_seen(pair):
    a, b = pair
    first = b.allocate(4096)
    src = a.allocate(8192)
    a.write(b.segment_name, src.address, first.address, 4096)  # caches b's descriptor
    later = b.allocate(8192)
    fill(src.view(), 7)
    a.write(b.segment_name, src.address, later.address, 8192)
    assert bytes(later.view()) == bytes(src.view())
    b.free(first)  # the same size again: often the same address (and fd number) as before
    again = b.allocate(4096)
    fill(src.view(), 8)
    a.write(b.segment_name, src.address, again.address, 4096)
    assert bytes(again.view()) == bytes(src.view()[:4096])


def test_freed_peer_region_is_refused(pair):
    a, b = pair
    src = a.allocate(4096)
    gone = b.allocate(4096)
    a.write(b.segment_name, src.address, gone.address, 4096)
    b.free(gone)
    with pytest.raises(AddressError):
        a.write(b.segment_name, src.address, gone.address, 4096)


def test_closed_engine_rejects_use():
    e = TransferEngine(config=EngineConfig(transports=["tcp"]))
    e.close()
    with pytest.raises(InvalidArgument):
        e.allocate(10)


def test_private_regions_are_invisible_to_peers(pair):
    a, b = pair
    secret = bytearray(b"s" * 4096)
    region = b.register(secret, private=True)
    assert region.address not in [r.address for r in b.regions()]
    into = a.allocate(4096)
    with pytest.raises(AddressError):
        a.read(b.segment_name, into.address, region.address, 4096)
    with pytest.raises(AddressError):
        a.write(b.segment_name, into.address, region.address, 4096)
    assert secret == b"s" * 4096
    # ... but usable as the local side of b's own transfers
    assert b.is_registered(region.address, 4096) and not b.is_registered(region.address, 4097)
    b.write(a.segment_name, region.address, into.address, 4096)
    assert bytes(into.view()) == b"s" * 4096


def test_probe(pair):
    a, b = pair
    assert a.probe(b.segment_name).port == b.rpc_port
    name = b.segment_name
    b.close()
    with pytest.raises(SegmentNotFound):
        a.probe(name)


def test_notify_queue_is_bounded(pair, monkeypatch):
    from mooncake_plugins.errors import TransferError
    from mooncake_plugins.transfer import engine as engine_module
    a, b = pair
    monkeypatch.setattr(engine_module, "MAX_PENDING_NOTIFIES", 3)
    for i in range(3):
        a.notify(b.segment_name, f"n{i}", "m")
    with pytest.raises(TransferError, match="waiting to be taken"):
        a.notify(b.segment_name, "n3", "m")
    assert [n for n, _ in b.take_notifies()] == ["n0", "n1", "n2"]
    a.notify(b.segment_name, "n4", "m")  # the connection survived the refusal
    assert b.take_notifies() == [("n4", "m")]


def test_served_byte_counts_add_up_across_threads(pair):
    """Many server threads count bytes at once: no update may be lost."""
    import threading
    a, b = pair
    dst = b.allocate(1 << 20)
    srcs = [TransferEngine(config=EngineConfig(transports=["tcp"])) for _ in range(4)]
    try:
        def run(e):
            buf = e.allocate(4096)
            for i in range(200):
                e.write(b.segment_name, buf.address, dst.address + (i % 256) * 4096, 4096)
                e.read(b.segment_name, buf.address, dst.address + (i % 256) * 4096, 4096)
        threads = [threading.Thread(target=run, args=(e,)) for e in srcs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        want = {"bytes_in": 4 * 200 * 4096, "bytes_out": 4 * 200 * 4096}
        # a READ's bytes are counted just after they are sent: allow the server that moment
        assert wait_until(lambda: b.stats == want, 5), b.stats
    finally:
        for e in srcs:
            e.close()


def test_a_request_partly_out_of_bounds_moves_no_byte(pair):
    """Refused whole: its first slices, in bounds, must not be written (found by the model test)."""
    a, b = pair
    dst = b.allocate(200 << 10)
    src = a.allocate(200 << 10)
    fill(src.view(), 3)
    with pytest.raises(AddressError):  # slices of 64 KiB: the first three are in bounds
        a.write(b.segment_name, src.address, dst.address + 1, 200 << 10)
    assert bytes(dst.view()) == bytes(200 << 10)
    with pytest.raises(AddressError):
        a.read(b.segment_name, src.address, dst.address + 1, 200 << 10)
    assert bytes(src.view()) == random.Random(3).randbytes(200 << 10)


def test_batch_on_done_runs_once_after_the_last_slice():
    """A callback sees the finished batch: at once when it has ended, else from the
    thread that ends the last slice (the NIXL backend sends notifications this way)."""
    import threading

    from mooncake_plugins.errors import TransferError
    from mooncake_plugins.transfer.batch import Batch

    reqs = [TransferRequest(OpCode.WRITE, 0, 0, 8)] * 2
    batch = Batch(1, "peer", reqs)
    batch.add_slices(0, 2)
    batch.add_slices(1, 1)
    batch.seal()
    seen: list[tuple[str, bool, object]] = []
    batch.on_done(lambda b: seen.append((threading.current_thread().name, b.done(), b.error())))
    batch.slices_done([(0, None), (1, None)])
    assert seen == []  # one slice still running
    worker = threading.Thread(target=batch.slices_done, args=([(0, TransferError("lost"))],),
                              name="finisher")
    worker.start()
    worker.join()
    assert [(name, done, str(err)) for name, done, err in seen] == [("finisher", True, "lost")]
    batch.on_done(lambda b: seen.append(("late", b.done(), None)))  # already done: now
    assert seen[-1] == ("late", True, None) and len(seen) == 2
    empty = Batch(2, "peer", [])
    empty.seal()
    empty.on_done(lambda b: seen.append(("empty", b.done(), None)))
    assert seen[-1] == ("empty", True, None)
