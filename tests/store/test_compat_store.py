"""The original ``mooncake.store`` surface: setup forms, names, argument order, return codes."""

import ctypes

import numpy as np
import pytest

from mooncake_plugins.compat.store import MooncakeDistributedStore, ReplicateConfig


@pytest.fixture
def stores(master, metadata_server):
    a, b = MooncakeDistributedStore(), MooncakeDistributedStore()
    assert a.setup("localhost", metadata_server.url, 16 << 20, 1 << 20, "tcp", "",
                   master.address) == 0
    assert b.setup({"local_hostname": "localhost", "metadata_server": metadata_server.url,
                    "global_segment_size": "16MB", "local_buffer_size": 1 << 20,
                    "protocol": "tcp", "rdma_devices": "", "master_server_addr": master.address}) == 0
    yield a, b
    assert a.close() == 0 and b.close() == 0


def test_put_batch_takes_one_value_under_several_keys(stores):
    """Valid input for the original: the same buffer, and slices of one, under many keys."""
    a, b = stores
    value = bytes(range(256)) * 4
    assert a.put_batch(["s1", "s2", "s3"], [value] * 3) == 0
    arr = np.arange(100, dtype=np.uint8)
    assert a.put_batch(["w", "w-slice"], [arr, arr[10:50]]) == 0
    assert a.put_batch(["v-tail", "v"], [memoryview(value)[10:], value]) == 0
    assert b.get_batch(["s1", "s2", "s3"]) == [value] * 3
    assert b.get("w") == arr.tobytes() and b.get("w-slice") == arr[10:50].tobytes()
    assert b.get("v-tail") == value[10:] and b.get("v") == value


def test_basic_calls_and_codes(stores):
    a, b = stores
    assert a.put("k", b"value") == 0
    assert b.get("k") == b"value"
    assert b.is_exist("k") == 1 and b.is_exist("nope") == 0
    assert b.batch_is_exist(["k", "nope"]) == [1, 0]
    assert b.get_size("k") == 5 and b.get_size("nope") == -704
    assert b.get("nope") == b""
    assert a.put("k", b"again") == 0 and b.get("k") == b"value"  # kept, as the original
    assert a.put_batch(["k", "k2"], [b"x", b"y"]) == 0 and b.get("k") == b"value"
    assert a.upsert("k", b"again") == 0 and b.get("k") == b"again"
    assert a.put_parts("p", b"ab", b"cd") == 0 and b.get("p") == b"abcd"
    cfg = ReplicateConfig()
    cfg.replica_num = 2
    cfg.preferred_segment = b.get_hostname()
    assert a.put("r", b"x" * 1000, cfg) == 0 and b.get("r") == b"x" * 1000
    assert a.put_batch(["b1", "b2"], [b"1", b"2"]) == 0
    assert b.get_batch(["b1", "b2", "zz"]) == [b"1", b"2", b""]
    assert b.remove("b1", True) == 0 and b.remove("b1") == -704
    assert a.remove_by_regex("^b", True) == 1
    assert a.put("", b"x") == -400 and a.put("e", b"") == -600
    assert a.remove_all(True) >= 3


def test_zero_copy_batches(stores):
    a, b = stores
    src = np.arange(64 * 1024, dtype=np.uint8)
    dst = np.zeros(64 * 1024, dtype=np.uint8)
    assert a.register_buffer(src.ctypes.data, src.nbytes) == 0
    assert b.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    keys = [f"blk{i}" for i in range(16)]
    ptrs = [src.ctypes.data + i * 4096 for i in range(16)]
    assert a.batch_put_from(keys, ptrs, [4096] * 16) == [0] * 16
    assert a.batch_put_from(keys[:1], ptrs[:1], [4096]) == [0]   # exists: kept
    out = [dst.ctypes.data + i * 4096 for i in range(16)]
    assert b.batch_get_into(keys, out, [4096] * 16) == [4096] * 16
    assert np.array_equal(src, dst)
    assert b.get_into("blk3", dst.ctypes.data, 100) == -10  # BUFFER_OVERFLOW
    assert b.batch_get_into(["missing"], [dst.ctypes.data], [4096]) == [-704]
    # multi-buffer objects (vLLM / SGLang page layouts)
    parts = [[src.ctypes.data, src.ctypes.data + 8192], [src.ctypes.data + 100]]
    assert a.batch_put_from_multi_buffers(["m1", "m2"], parts, [[100, 200], [50]]) == [0, 0]
    dst[:] = 0
    got = b.batch_get_into_multi_buffers(["m1", "m2"], [[dst.ctypes.data, dst.ctypes.data + 1000],
                                                        [dst.ctypes.data + 5000]],
                                         [[150, 150], [50]])
    assert got == [300, 50]
    want = np.concatenate([src[:100], src[8192:8392]])
    assert np.array_equal(np.concatenate([dst[:150], dst[1000:1150]]), want)
    assert np.array_equal(dst[5000:5050], src[100:150])
    assert a.unregister_buffer(src.ctypes.data) == 0 and b.unregister_buffer(dst.ctypes.data) == 0


def test_setup_errors_are_codes(master):
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 1 << 20, 0, "tcp", "", "127.0.0.1:1") == -900
    assert s.setup("localhost", "P2PHANDSHAKE", 1 << 20, 0, "tcp", "", master.address,
                   tenant_id="other") == -1012
    assert s.get("k") == b""  # not set up: logged, no crash


def test_buffers_and_replica_descriptors(stores):
    a, b = stores
    assert a.put("h", b"header+payload") == 0
    handle = b.get_buffer("h")
    assert bytes(handle) == b"header+payload" and handle.size() == len(handle) == 14
    assert memoryview(handle)[:6] == b"header"
    assert ctypes.string_at(handle.ptr(), 6) == b"header"
    assert b.get_buffer("missing") is None
    got = b.batch_get_buffer(["h", "missing"])
    assert bytes(got[0]) == b"header+payload" and got[1] is None
    cfg = ReplicateConfig()
    cfg.replica_num = 2
    assert a.put("r2", b"x" * 100, cfg) == 0
    desc = b.batch_get_replica_desc(["h", "r2", "missing"])
    assert set(desc) == {"h", "r2"} and len(desc["r2"]) == 2
    assert all(d.is_memory_replica() and not d.is_disk_replica() and not d.is_local_disk_replica()
               for d in desc["r2"])
    assert len(b.get_replica_desc("h")) == 1 and b.get_replica_desc("missing") == []


def test_hostname_ports_sizes_and_no_local_buffer(master, metadata_server):
    a = MooncakeDistributedStore()
    assert a.setup("localhost", metadata_server.url, "16MB", 0, "tcp", "", master.address) == 0
    try:
        host, port = a.get_hostname().split(":")
        assert host == "localhost" and 12300 <= int(port) <= 14300   # picked, as the original
        # without a local buffer, copying puts and gets fail; registered buffers still work
        assert a.put("k", b"v") == -600 and a.put_batch(["k"], [b"v"]) == -600
        assert a.put_parts("k", b"a", b"b") == -600 and not a.is_exist("k")
        buf = ctypes.create_string_buffer(b"zero-copy", 64)
        assert a.register_buffer(ctypes.addressof(buf), 64) == 0
        assert a.put_from("k", ctypes.addressof(buf), 9) == 0
        assert a.get("k") == b"" and a.get_into("k", ctypes.addressof(buf) + 32, 32) == 9
        assert a.unregister_buffer(ctypes.addressof(buf)) == 0
    finally:
        a.close()
    assert MooncakeDistributedStore().setup("localhost", metadata_server.url, "50%", 0, "tcp", "",
                                            master.address) == -600


def test_get_into_ranges(stores):
    a, b = stores
    assert a.put("r1", b"0123456789") == 0 and a.put("r2", b"abcdefghij") == 0
    buf = ctypes.create_string_buffer(16)
    ptr = ctypes.addressof(buf)
    assert b.register_buffer(ptr, 16) == 0
    got = b.get_into_ranges([ptr], [["r1", "r2", "missing"]], [[[0, 4], [8], [12]]],
                            [[[1, 8], [0], [0]]], [[[3, 2], [4], [1]]])
    assert got == [[[3, 2], [4], [-704]]]
    assert buf.raw[:12] == b"123\x0089\x00\x00abcd"
    bad = b.get_into_ranges([ptr], [["r1", "r1", "r1"]], [[[0], [14], [0, 1]]],
                            [[[8], [0], [0]]], [[[4], [4], [1]]])
    assert bad == [[[-600], [-600], [-600, -600]]]   # past the object, the buffer; uneven lists
    assert b.unregister_buffer(ptr) == 0
