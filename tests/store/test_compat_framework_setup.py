"""``MooncakeDistributedStore.setup`` as frameworks call it: LMCache's dict keys
(``master_server_address``, ``device_name``, sizes as strings) and its habit of ignoring
setup's return code."""

from mooncake_plugins.compat.store import MooncakeDistributedStore


def test_dict_setup_takes_the_frameworks_key_names(master):
    s = MooncakeDistributedStore()
    assert s.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                    "global_segment_size": "16777216", "local_buffer_size": "1048576",
                    "protocol": "tcp", "device_name": "", "master_server_address":
                    master.address, "some_future_key": 1}) == 0
    try:
        assert s.client.master_address == master.address
        assert s.put("k", b"v") == 0 and s.is_exist("k") == 1
    finally:
        s.close()


def test_after_a_failed_setup_nothing_reads_as_present(master, caplog):
    s = MooncakeDistributedStore()
    assert s.setup({"local_hostname": "127.0.0.1", "master_server_address": "127.0.0.1:1",
                    "global_segment_size": "1MB"}) == -900
    assert s.is_exist("k") == 0  # never a negative (truthy) code here
    assert s.batch_is_exist(["k", "j"]) == [0, 0]
    assert s.get("k") == b""
    assert "setup() failed (cannot reach master 127.0.0.1:1" in caplog.text
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 0, "tcp", "", master.address) == 0
    try:
        assert s.is_exist("k") == 0 and s.put_from("k", 0, 0) < 0
    finally:
        s.close()


def test_a_dropped_store_is_closed_as_by_the_originals_destructor(master):
    import gc
    import threading

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 0, "tcp", "", master.address) == 0
    heartbeat = s.client._heartbeat
    del s
    gc.collect()
    heartbeat.join(5)
    assert not heartbeat.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("mc-store-heartbeat")]


def test_host_mem_allocator_gives_usable_memory_until_freed():
    import ctypes

    from mooncake.store import MooncakeHostMemAllocator

    a = MooncakeHostMemAllocator()
    ptr = a.alloc(1 << 20)
    assert ptr and ptr % 4096 == 0
    ctypes.memset(ptr, 7, 1 << 20)
    assert ctypes.string_at(ptr + (1 << 20) - 3, 3) == b"\x07\x07\x07"
    assert a.free(ptr) == 0
    assert a.free(ptr) < 0 and a.alloc(0) == 0
