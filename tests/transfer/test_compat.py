"""The original ``mooncake.engine.TransferEngine`` surface: names, argument order, return codes."""

import random

import pytest
from helpers import wait_until

from mooncake_plugins.compat.engine import TransferEngine, TransferNotify, TransferOpcode


@pytest.fixture(params=["P2PHANDSHAKE", "http"])
def engines(request):
    meta = request.param
    if meta == "http":
        meta = request.getfixturevalue("metadata_server").url
    target, initiator = TransferEngine(), TransferEngine()
    assert target.initialize("127.0.0.1", meta, "tcp", "") == 0
    assert initiator.initialize("127.0.0.1", meta, "tcp", "") == 0
    name = f"127.0.0.1:{target.get_rpc_port()}"
    yield target, initiator, name
    initiator.close()
    target.close()


def test_write_read_round_trips(engines):
    target, ini, name = engines
    dst = target.allocate_managed_buffer(1 << 20)
    src = ini.allocate_managed_buffer(1 << 20)
    assert dst and src
    assert ini.get_first_buffer_address(name) == dst
    rng = random.Random(5)
    for _ in range(50):
        data = rng.randbytes(rng.randint(16, 256))
        assert ini.write_bytes_to_buffer(src, data, len(data)) == 0
        assert ini.transfer_sync_write(name, src, dst, len(data)) == 0
        assert ini.write_bytes_to_buffer(src, bytes(len(data)), len(data)) == 0
        assert ini.transfer_sync_read(name, src, dst, len(data)) == 0
        assert ini.read_bytes_from_buffer(src, len(data)) == data
    assert ini.free_managed_buffer(src, 1 << 20) == 0


def test_batches_sync_and_async(engines):
    target, ini, name = engines
    dst = target.allocate_managed_buffer(1 << 20)
    src = ini.allocate_managed_buffer(1 << 20)
    srcs = [src + i * 1024 for i in range(100)]
    dsts = [dst + i * 1024 for i in range(100)]
    data = [random.Random(i).randbytes(100 + i) for i in range(100)]
    for a, d in zip(srcs, data):
        ini.write_bytes_to_buffer(a, d, len(d))
    assert ini.batch_transfer_sync_write(name, srcs, dsts, [len(d) for d in data]) == 0
    for a, d in zip(srcs, data):
        ini.write_bytes_to_buffer(a, bytes(len(d)), len(d))
    bid = ini.batch_transfer_async_read(name, srcs, dsts, [len(d) for d in data])
    assert bid > 0
    assert ini.get_batch_transfer_status([bid]) == 0
    assert [ini.read_bytes_from_buffer(a, len(d)) for a, d in zip(srcs, data)] == data
    bid = ini.transfer_submit_write(name, src, dst, 4096)
    seen = []  # the id is freed once it reports an end: keep what that call said
    assert wait_until(lambda: seen.append(ini.transfer_check_status(bid)) or seen[-1] != 0, 30,
                      interval_s=0.001)
    assert seen[-1] == 1
    assert ini.batch_transfer_sync(name, [src], [dst], [64], TransferOpcode.READ,
                                   TransferNotify("k", "v")) == 0
    assert [(n.name, n.msg) for n in target.get_notifies()] == [("k", "v")]


def test_error_codes(engines):
    target, ini, name = engines
    dst = target.allocate_managed_buffer(4096)
    src = ini.allocate_managed_buffer(4096)
    assert ini.transfer_sync_write(name, src, dst + 1, 4096) < 0  # out of bounds remotely
    assert ini.transfer_sync_write(name, src + 1, dst, 4096) < 0  # out of bounds locally
    assert ini.transfer_sync_write("127.0.0.1:1", src, dst, 16) < 0  # nobody there
    assert ini.batch_transfer_async_write(name, [src], [dst, dst], [16]) == 0  # length mismatch
    assert ini.get_batch_transfer_status([12345]) == -1
    assert ini.transfer_check_status(12345) == -1
    assert ini.free_managed_buffer(src, 1) == -1
    assert ini.read_bytes_from_buffer(12345, 10) == b""
    assert ini.write_bytes_to_buffer(src, b"ab", 3) < 0
    assert ini.send_probe(name) == 0
    assert ini.send_probe("127.0.0.1:1") < 0
    bad = TransferEngine()
    assert bad.initialize("127.0.0.1", "P2PHANDSHAKE", "efa", "") < 0  # rdma: tcp, as the original
    port_in_use = TransferEngine()  # OSError (address in use) is a code too, never raised
    assert port_in_use.initialize(f"127.0.0.1:{ini.get_rpc_port()}", "P2PHANDSHAKE", "tcp", "") < 0


def test_register_raw_memory(engines):
    target, ini, name = engines
    buf = bytearray(8192)
    import ctypes
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert target.register_memory(addr, 8192) == 0
    assert target.register_memory(addr, 8192) < 0  # overlaps
    src = ini.allocate_managed_buffer(8192)
    ini.write_bytes_to_buffer(src, b"hello", 5)
    assert ini.transfer_sync_write(name, src, addr + 100, 5) == 0
    assert buf[100:105] == b"hello"
    assert target.unregister_memory(addr) == 0
    assert ini.transfer_sync_write(name, src, addr + 100, 5) < 0
    assert target.batch_register_memory([addr, addr + 4096], [4096, 4096]) == 0
    assert target.batch_unregister_memory([addr, addr + 4096]) == 0
