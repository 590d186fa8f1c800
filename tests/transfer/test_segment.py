"""RegionTable bounds checks and descriptor validation: the security boundary."""

import threading
import time

import pytest

from mooncake_plugins.errors import AddressError, InvalidArgument, ProtocolError, RegionBusy
from mooncake_plugins.transfer.segment import Region, RegionInfo, RegionTable, SegmentDescriptor


def table(*ranges):
    t = RegionTable()
    for a, n in ranges:
        t.add(Region(RegionInfo(a, n)))
    return t


def test_find_inside_and_edges():
    t = table((1000, 100), (5000, 10))
    assert t.find(1000, 100).address == 1000
    assert t.find(1099, 1).address == 1000
    assert t.find(5000, 10).address == 5000
    for addr, n in ((999, 1), (1000, 101), (1099, 2), (1100, 1), (4999, 2), (5005, 6), (0, 1)):
        with pytest.raises(AddressError):
            t.find(addr, n)


def test_overlap_and_bad_ranges_rejected():
    t = table((1000, 100))
    for a, n in ((950, 51), (1099, 10), (1000, 1), (900, 300)):
        with pytest.raises(InvalidArgument):
            t.add(Region(RegionInfo(a, n)))
    with pytest.raises(InvalidArgument):
        t.add(Region(RegionInfo(-1, 10)))
    with pytest.raises(InvalidArgument):
        t.add(Region(RegionInfo((1 << 64) - 5, 10)))
    with pytest.raises(InvalidArgument):
        t.add(Region(RegionInfo(10, 0)))
    t.add(Region(RegionInfo(1100, 5)))  # adjacent is fine
    assert len(t) == 2


def test_busy_region_cannot_be_removed():
    t = table((1000, 100))
    region = t.acquire(1010, 10)
    with pytest.raises(RegionBusy):
        t.remove(1000, wait_s=0)
    t.release(region)
    t.remove(1000)
    with pytest.raises(AddressError):
        t.find(1000, 1)
    with pytest.raises(InvalidArgument):
        t.remove(1000)


def test_remove_waits_for_transfers_to_end():
    t = table((1000, 100), (2000, 10))
    region = t.acquire(1010, 10)
    waiting = threading.Event()
    drained = t._drained

    class Watched(type(drained)):  # tells when remove() starts waiting for the transfer
        def wait_for(self, predicate, timeout=None):
            waiting.set()
            return super().wait_for(predicate, timeout)

    t._drained = Watched(t._lock)
    out: list = []
    remover = threading.Thread(target=lambda: out.append(t.remove(1000, wait_s=60)), daemon=True)
    remover.start()
    deadline = time.monotonic() + 30
    while not waiting.is_set() and remover.is_alive():
        assert time.monotonic() < deadline, "remove() neither waited nor returned"
        time.sleep(0.01)
    # remove() is waiting (or returned at once: wrong): the busy region must still be there
    assert t.find(1010, 10) is region and len(t) == 2
    assert remover.is_alive() and out == [], "remove() returned while a transfer held the region"
    t.release(region)  # the transfer ends: now remove() goes on
    remover.join(30)
    assert not remover.is_alive() and out == [region]
    with pytest.raises(AddressError):
        t.find(1010, 10)
    assert len(t) == 1 and t.find(2000, 10).address == 2000


def test_epoch_changes_on_every_update():
    t = RegionTable()
    e0 = t.epoch
    t.add(Region(RegionInfo(10, 10)))
    t.remove(10)
    assert t.epoch == e0 + 2


def good_wire():
    return SegmentDescriptor("a:1", "127.0.0.1", 1, 42, "h", 3, 5,
                             [RegionInfo(4096, 100, "cpu:0", -1), RegionInfo(8192, 10, "*", 3, True)]).to_wire()


def test_descriptor_round_trip():
    d = SegmentDescriptor.from_wire(good_wire())
    assert d.regions == [RegionInfo(4096, 100, "cpu:0", -1), RegionInfo(8192, 10, "*", 3, True)]
    assert d.find(4100, 96, write=True).address == 4096
    assert d.find(8192, 10).memfd == 3
    with pytest.raises(AddressError):
        d.find(4100, 97)
    with pytest.raises(AddressError):
        d.find(8192, 10, write=True)


@pytest.mark.parametrize("mutate", [
    lambda w: w.pop("regions"),
    lambda w: w.update(port=0),
    lambda w: w.update(port=70000),
    lambda w: w.update(pid=-3),
    lambda w: w.update(v=2),
    lambda w: w.update(name=5),
    lambda w: w.update(epoch=True),
    lambda w: w.update(regions=[[1, 2, 3]]),
    lambda w: w.update(regions=[[1, -2, "x", -1, False]]),
    lambda w: w.update(regions=[[(1 << 64) - 1, 2, "x", -1, False]]),
    lambda w: w.update(regions=[[1, 2, 7, -1, False]]),
    lambda w: w.update(regions=[[1, 2, "x", -2, False]]),
    lambda w: w.update(regions=[[1, 2, "x", -1, 0]]),
    lambda w: w.update(regions=[[1, 2, "x", -1]]),
    lambda w: w.update(regions="nope"),
])
def test_descriptor_validation(mutate):
    w = good_wire()
    mutate(w)
    with pytest.raises(ProtocolError):
        SegmentDescriptor.from_wire(w)
    with pytest.raises(ProtocolError):
        SegmentDescriptor.from_wire([1, 2])
