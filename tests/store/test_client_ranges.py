"""StoreClient ranged reads: ``locate`` once, then ``batch_get_ranges_into`` reads byte
ranges of the located objects straight into registered memory, from memory replicas
(across shards) or from the SSD tier, and refuses to hand out bytes read after the lease."""

import os
import time

import numpy as np
import pytest

from mooncake_plugins.errors import InvalidParams, LeaseExpired, ObjectNotFound
from mooncake_plugins.store.client import StoreClient
from mooncake_plugins.store.master import MasterConfig
from mooncake_plugins.store.server import MasterServer, ServerOptions


@pytest.fixture
def striped():
    """A master that stripes objects over 4 KiB shards, three segments to stripe over."""
    server = MasterServer(MasterConfig(stripe_nbytes=4096), ServerOptions(rpc_port=0))
    server.start()
    clients = [StoreClient(server.address, global_segment_size=1 << 20) for _ in range(3)]
    yield clients
    for c in clients:
        c.close()
    server.close()


def test_ranges_of_a_striped_object_land_in_scattered_pieces(striped):
    writer, _, reader = striped
    data = np.random.default_rng(2).integers(0, 255, 3 * 8192 + 100, dtype=np.uint8)
    writer.put("obj", data)
    located = reader.locate(["obj", "missing"])
    nbytes, replicas, _ = located.found[0]
    assert nbytes == data.nbytes and len(replicas[0]) == 3, "the object spans three shards"
    assert isinstance(located.found[1], ObjectNotFound)

    dst = np.zeros(64 << 10, dtype=np.uint8)
    base = dst.ctypes.data
    reader.register_buffer(base, dst.nbytes)
    try:
        reads = [(0, 0, [(base, data.nbytes)]),                          # the whole object
                 (0, 5000, [(base + 30000, 7), (base + 31000, 12000)]),   # across shards
                 (0, data.nbytes - 10, [(base + 50000, 10)]),             # its last bytes
                 (0, data.nbytes - 10, [(base + 52000, 11)]),             # one byte too many
                 (1, 0, [(base + 54000, 1)])]                             # not in the store
        got = reader.batch_get_ranges_into(located, reads)
        assert got[:3] == [data.nbytes, 12007, 10]
        assert isinstance(got[3], InvalidParams) and isinstance(got[4], ObjectNotFound)
        assert np.array_equal(dst[:data.nbytes], data)
        assert np.array_equal(np.concatenate([dst[30000:30007], dst[31000:43000]]),
                              data[5000:17007])
        assert np.array_equal(dst[50000:50010], data[-10:])
        assert not dst[52000:52011].any(), "a refused range writes nothing"
        with pytest.raises(InvalidParams):
            reader.batch_get_ranges_into(located, [(2, 0, [(base, 1)])])
    finally:
        reader.unregister_buffer(base)


LEASE_S = 3.0  # the first read must fall inside the lease: seconds to spare under load


@pytest.fixture
def leasing_master():
    """A master leasing what is looked up for LEASE_S."""
    server = MasterServer(MasterConfig(default_kv_lease_ttl_ms=int(LEASE_S * 1000)),
                          ServerOptions(rpc_port=0))
    server.start()
    yield server
    server.close()


def test_a_range_read_after_the_lease_ran_out_is_refused(leasing_master):
    """Bytes read after the lookup's lease ran out may be another object's: refused."""
    with StoreClient(leasing_master.address, global_segment_size=1 << 20) as c:
        c.put("k", b"x" * 1000)
        dst = np.zeros(1000, dtype=np.uint8)
        c.register_buffer(dst.ctypes.data, dst.nbytes)
        try:
            asked = time.monotonic()  # the lease runs from no earlier than this
            located = c.locate(["k"])
            assert c.batch_get_ranges_into(located, [(0, 0, [(dst.ctypes.data, 10)])]) == [10]

            def read_late():
                (got,) = c.batch_get_ranges_into(located, [(0, 10, [(dst.ctypes.data, 10)])])
                return got

            # read again and again until the lease runs out: then every read is refused
            deadline = asked + LEASE_S + 30
            while not isinstance(late := read_late(), LeaseExpired):
                assert late == 10 and time.monotonic() < deadline, late
                time.sleep(0.05)
            assert time.monotonic() - asked >= LEASE_S  # not before its end
            assert isinstance(read_late(), LeaseExpired)
        finally:
            c.unregister_buffer(dst.ctypes.data)


def test_ranges_of_an_object_only_on_the_ssd_tier(tmp_path):
    server = MasterServer(MasterConfig(enable_offload=True, root_fs_dir=str(tmp_path),
                                       eviction_ratio=0.3), ServerOptions(rpc_port=0))
    server.start()
    try:
        with StoreClient(server.address, global_segment_size=4 << 20, enable_ssd_offload=True,
                         ssd_offload_path=str(tmp_path)) as writer, \
                StoreClient(server.address, global_segment_size=0) as reader:
            blobs = {f"s{i}": os.urandom(512 << 10) for i in range(24)}  # 12 MiB into 4 MiB
            for k, v in blobs.items():
                writer.put(k, v)
                writer.flush_offload()
            located = reader.locate(list(blobs))
            on_disk = [i for i, f in enumerate(located.found) if not f[1] and f[2]]
            assert on_disk, "some objects were evicted to the SSD tier"
            i = on_disk[0]
            want = blobs[located.keys[i]]
            dst = np.zeros(8192, dtype=np.uint8)
            reader.register_buffer(dst.ctypes.data, dst.nbytes)
            try:
                got = reader.batch_get_ranges_into(
                    located, [(i, 100_000, [(dst.ctypes.data, 1000),
                                            (dst.ctypes.data + 4096, 3000)])])
                assert got == [4000]
                assert dst[:1000].tobytes() + dst[4096:7096].tobytes() == want[100_000:104_000]
            finally:
                reader.unregister_buffer(dst.ctypes.data)
    finally:
        server.close()
