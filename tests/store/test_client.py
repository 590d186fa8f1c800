"""StoreClient API against an in-process master: semantics, bad input, SSD tier."""

import ctypes
import inspect
import os
import time

import numpy as np
import pytest
from helpers import wait_until

from mooncake_plugins.errors import (BufferTooSmall, InvalidKey, InvalidParams, NoAvailableSpace,
                                     ObjectAlreadyExists, ObjectHasLease, ObjectNotFound,
                                     RpcFailed, UnavailableInCurrentStatus)
from mooncake_plugins.store.client import ReplicateConfig, StoreClient
from mooncake_plugins.store.master import MasterConfig
from mooncake_plugins.store.server import MasterServer, ServerOptions


@pytest.fixture
def pair(master):
    a = StoreClient(master.address, global_segment_size=16 << 20)
    b = StoreClient(master.address, global_segment_size=16 << 20)
    yield a, b
    a.close()
    b.close()


def test_a_get_whose_lease_ran_out_reads_again_into_the_same_buffers(pair, monkeypatch):
    """A read that outlives its lease is retried: the retry reads into the buffers of the
    first attempt (they stay registered; before, new ones were registered while the
    first were freed, and one at a freed buffer's address clashed: 'overlaps a
    registered region', seen under a loaded CI)."""
    a, b = pair
    keys = [f"s{i}" for i in range(8)]
    assert a.batch_put(keys, [bytes([i]) * 3 for i in range(8)]) == [None] * 8
    reads, ttl, real_read = [], b._lease_ttl_s, b._read

    def read(located, todo, out):
        reads.append(len(todo))
        b._lease_ttl_s = 0 if len(reads) == 1 else ttl   # the first attempt runs out
        real_read(located, todo, out)

    monkeypatch.setattr(b, "_read", read)
    assert b.batch_get(keys) == [bytes([i]) * 3 for i in range(8)]
    assert reads == [8, 8]


def test_round_trips_of_every_shape(pair):
    a, b = pair
    a.put("bytes", b"abc")
    a.put("array", np.arange(1000, dtype=np.int64))
    a.put_parts("parts", b"head-", memoryview(b"body-"), bytearray(b"tail"))
    assert b.get("bytes") == b"abc"
    assert np.array_equal(np.frombuffer(b.get("array"), dtype=np.int64), np.arange(1000))
    assert b.get("parts") == b"head-body-tail"
    assert b.size("array") == 8000
    assert b.batch_exists(["bytes", "nope"]) == [True, False]


def test_batch_put_parts_gathers_without_joining(pair):
    a, b = pair
    arr = np.arange(256, dtype=np.uint8)
    reg = np.zeros(64, dtype=np.uint8)
    reg[:] = 7
    a.register_buffer(reg.ctypes.data, reg.nbytes)  # a part inside user-registered memory
    try:
        errors = a.batch_put_parts(["p1", "p2", "p3"],
                                   [[b"h", arr, b""], [arr[10:20], arr[:5]], [reg[8:16], b"t"]])
    finally:
        a.unregister_buffer(reg.ctypes.data)
    assert errors == [None, None, None]
    assert b.get("p1") == b"h" + arr.tobytes()
    assert b.get("p2") == arr[10:20].tobytes() + arr[:5].tobytes()  # one buffer, two parts
    assert b.get("p3") == b"\x07" * 8 + b"t"
    with pytest.raises(InvalidParams):
        a.batch_put_parts(["x"], [])


def test_zero_copy_from_and_into_registered_buffers(pair):
    a, b = pair
    src = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8)
    dst = np.zeros(4 << 20, dtype=np.uint8)
    a.register_buffer(src.ctypes.data, src.nbytes)
    b.register_buffer(dst.ctypes.data, dst.nbytes)
    a.put_from("z", src.ctypes.data, src.nbytes, ReplicateConfig(replica_num=2))
    assert b.get_into("z", dst.ctypes.data, dst.nbytes) == src.nbytes
    assert np.array_equal(dst[:src.nbytes], src)
    with pytest.raises(BufferTooSmall):
        b.get_into("z", dst.ctypes.data, 100)
    # scatter/gather: an object made of two pieces, read back into three
    pieces = [(src.ctypes.data, 1000), (src.ctypes.data + 5000, 3000)]
    assert a.batch_put_from_parts(["sg"], [pieces]) == [None]
    out = [(dst.ctypes.data, 10), (dst.ctypes.data + 100, 2000), (dst.ctypes.data + 3000, 5000)]
    assert b.batch_get_into_parts(["sg"], [out]) == [4000]
    want = np.concatenate([src[:1000], src[5000:8000]])
    got = np.concatenate([dst[:10], dst[100:2100], dst[3000:4990]])
    assert np.array_equal(got, want)
    a.unregister_buffer(src.ctypes.data)
    b.unregister_buffer(dst.ctypes.data)


def test_unregistered_memory_is_refused(pair):
    a, _ = pair
    buf = ctypes.create_string_buffer(4096)
    addr = ctypes.addressof(buf)
    errors = a.batch_put_from(["u"], [addr], [4096])
    assert errors[0] is not None
    assert not a.exists("u")  # the reserved space was revoked


def test_batches_report_per_key(pair):
    a, b = pair
    assert a.batch_put(["b1", "b2"], [b"1", b"22"]) == [None, None]
    errs = a.batch_put(["b1", "b3"], [b"x", b"333"])
    assert isinstance(errs[0], ObjectAlreadyExists) and errs[1] is None
    got = b.batch_get(["b1", "missing", "b3"])
    assert got[0] == b"1" and isinstance(got[1], ObjectNotFound) and got[2] == b"333"
    assert [type(e) if e else None for e in b.batch_remove(["b1", "zz"], force=True)] == [None, ObjectNotFound]


def test_upsert_remove_and_regex(pair):
    a, b = pair
    a.put("k", b"one")
    a.upsert("k", b"two!")
    assert b.get("k") == b"two!"
    for i in range(5):
        a.put(f"grp/{i}", b"x")
    assert b.remove_by_regex(r"^grp/[0-2]$") == 3
    b.get("k")  # takes a lease
    with pytest.raises(ObjectHasLease):
        b.remove("k")
    assert wait_until(lambda: not _has_lease(b, "k"), 5)
    b.remove("k")
    assert not a.exists("k")
    assert a.remove_all() == 2


def _has_lease(client, key):
    try:
        client.remove(key)
        client.put(key, b"two!")  # put it back for the caller to remove
        return False
    except ObjectHasLease:
        return True


def test_bad_inputs(pair):
    a, _ = pair
    with pytest.raises(InvalidKey):
        a.put("", b"x")
    with pytest.raises(InvalidKey):
        a.put("k" * 5000, b"x")
    with pytest.raises(InvalidParams):
        a.put("empty", b"")
    with pytest.raises(NoAvailableSpace):
        a.put("huge", bytearray(64 << 20))
    with pytest.raises(ObjectNotFound):
        a.get("never")
    with pytest.raises(ObjectNotFound):
        a.size("never")
    with pytest.raises(InvalidParams):
        a.batch_put(["a", "b"], [b"1"])
    with pytest.raises(RpcFailed):
        StoreClient("127.0.0.1:1", global_segment_size=0, rpc_timeout_s=2)


def test_ssd_tier_keeps_evicted_objects_readable(tmp_path):
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
            st = writer.stats()
            assert st["offloaded_evictions"] > 0 and st["objects"] == 24
            for k, v in blobs.items():
                assert reader.get(k) == v
            files = list(tmp_path.rglob("*.obj"))
            assert len(files) == 24
            writer.remove("s0", force=True)
            assert len(list(tmp_path.rglob("*.obj"))) == 23  # the file goes with the object
    finally:
        server.close()


def test_a_connected_client_is_kept_while_its_heartbeats_lag(master):
    """A client whose heartbeats stop but whose connections stay open (an application
    holding the GIL for seconds) keeps its segment and objects past the TTL (2 s)."""
    c = StoreClient(master.address, global_segment_size=1 << 20)
    try:
        c.put("kept", b"v")
        c._stop.set()
        c._heartbeat.join()
        time.sleep(4 * master.service.config.client_ttl_s)
        assert master.service.stats()["clients"] == 1
        assert c.get("kept") == b"v"
    finally:
        c.close()


def test_a_closed_client_is_forgotten_at_once_not_expired(master):
    """close() tells the master: the client and its segment go now, and the master's
    count of expired clients (clients that died) stays at zero."""
    keep = StoreClient(master.address, global_segment_size=1 << 20)
    c = StoreClient(master.address, global_segment_size=1 << 20)
    try:
        c.put("theirs", b"v", ReplicateConfig(preferred_segments=[c.segment_name]))
        keep.put("kept", b"w", ReplicateConfig(preferred_segments=[keep.segment_name]))
        assert master.service.stats()["clients"] == 2
        c.close()
        stats = master.service.stats()
        assert (stats["clients"], stats["segments"]) == (1, 1)
        assert not keep.exists("theirs") and keep.get("kept") == b"w"
        time.sleep(2 * master.service.config.client_ttl_s)
        assert master.service.stats()["expired_clients"] == 0
    finally:
        c.close()
        keep.close()


def test_every_call_of_a_closed_client_says_it_is_closed(master):
    """After close() each public call raises one error naming the cause (issue 44), not
    that of whatever part it reached first (the engine, the master connection), and an
    empty batch is no exception."""
    c = StoreClient(master.address, global_segment_size=1 << 20)
    c.put("k", b"v")
    located = c.locate(["k"])
    c.close()
    c.close()
    calls = {
        "batch_exists": lambda: c.batch_exists([]),
        "batch_get": lambda: c.batch_get([]),
        "batch_get_into": lambda: c.batch_get_into(["k"], [0], [1]),
        "batch_get_into_parts": lambda: c.batch_get_into_parts(["k"], [[(0, 1)]]),
        "batch_get_ranges": lambda: c.batch_get_ranges(located, [(0, 0, 1)]),
        "batch_get_ranges_into": lambda: c.batch_get_ranges_into(located, [(0, 0, [(0, 1)])]),
        "batch_put": lambda: c.batch_put(["k2"], [b"v"]),
        "batch_put_from": lambda: c.batch_put_from(["k2"], [0], [1]),
        "batch_put_from_parts": lambda: c.batch_put_from_parts([], []),
        "batch_put_parts": lambda: c.batch_put_parts(["k2"], [[b"v"]]),
        "batch_remove": lambda: c.batch_remove([]),
        "batch_replica_clear": lambda: c.batch_replica_clear(["k"]),
        "call_master": lambda: c.call_master("stats"),
        "copy_replicas": lambda: c.copy_replicas("k", "a", ["b"]),
        "create_copy_task": lambda: c.create_copy_task("k", ["b"]),
        "create_move_task": lambda: c.create_move_task("k", "a", "b"),
        "exists": lambda: c.exists("k"),
        "flush_offload": lambda: c.flush_offload(),
        "get": lambda: c.get("k"),
        "get_into": lambda: c.get_into("k", 0, 1),
        "gpu_buffers": lambda: c.gpu_buffers([]).__enter__(),
        "local_view": lambda: c.local_view(0, 1),
        "locate": lambda: c.locate([]),
        "put": lambda: c.put("k2", b"v"),
        "put_from": lambda: c.put_from("k2", 0, 1),
        "put_parts": lambda: c.put_parts("k2", b"v"),
        "query_task": lambda: c.query_task([0, 0]),
        "register_buffer": lambda: c.register_buffer(0, 1),
        "remove": lambda: c.remove("k"),
        "remove_all": lambda: c.remove_all(),
        "remove_by_regex": lambda: c.remove_by_regex("k"),
        "replicas": lambda: c.replicas([]),
        "size": lambda: c.size("k"),
        "stats": lambda: c.stats(),
        "unregister_buffer": lambda: c.unregister_buffer(0),
        "upsert": lambda: c.upsert("k", b"v"),
    }
    public = {name for name, v in inspect.getmembers(StoreClient)
              if callable(v) and not name.startswith("_")}
    assert set(calls) == public - {"close"}   # a new public call gets a line here
    for name, call in calls.items():
        with pytest.raises(UnavailableInCurrentStatus, match="^this StoreClient is closed$"):
            call()


def test_client_reregisters_after_expiry(master):
    c = StoreClient(master.address, global_segment_size=1 << 20)
    try:
        c._stop.set()  # silence heartbeats
        c._heartbeat.join()
        with c._rpc._lock:  # and drop its connections: the master expires us (ttl 2 s)
            for sock in c._rpc._idle:
                sock.close()
            c._rpc._idle.clear()
        assert wait_until(lambda: master.service.stats()["clients"] == 0, 10)
        c.put("after-expiry", b"ok")  # ClientNotFound -> register + remount -> retry
        assert c.get("after-expiry") == b"ok"
        assert master.service.stats()["segments"] == 1
    finally:
        c.close()
