"""The frameworks' in-tree Mooncake code on the drop-in, with GPU buffers: the exact calls
they make (vLLM's ``MooncakeConnector`` and SGLang's ``MooncakeKVManager`` on
``mooncake.engine``; vLLM's ``MooncakeStoreConnector`` on ``mooncake.store``), over the
CUDA TEST DOUBLE (tests/cuda_double.py: "device memory" that is host memory; it proves the
path and the bookkeeping, not CUDA: tests/gpu runs on a GPU).
"""

from __future__ import annotations

import ctypes
import os
from typing import Iterator

import pytest
from cuda_double import double  # noqa: F401  (the fixture)

from mooncake.engine import TransferEngine
from mooncake.store import MooncakeDistributedStore
from mooncake_plugins.store.master import MasterConfig
from mooncake_plugins.store.server import MasterServer, ServerOptions

KV = 1 << 20        # one "layer" of KV per engine
BLOCK = 16 << 10


def write(address: int, data: bytes) -> None:
    ctypes.memmove(address, data, len(data))   # the double's device memory is host memory


@pytest.fixture
def engines(double) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    prefill, decode = TransferEngine(), TransferEngine()
    try:
        for e in (prefill, decode):   # vLLM passes "rdma" or "tcp"; SGLang MOONCAKE_PROTOCOL
            assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def test_pd_block_writes_between_gpu_kv_caches(engines, double):
    """vLLM's P/D connector: batch_register_memory of each KV cache (device pointers),
    the prefill's batch_transfer_sync_write of blocks into the decode's KV cache; SGLang's
    MooncakeKVManager: transfer_sync_write for the metadata row, batch_deregister at the end."""
    prefill, decode = engines
    src, dst = double.alloc(KV), double.alloc(KV, device=1)
    pattern = os.urandom(KV)
    write(src, pattern)
    assert prefill.batch_register_memory([src], [KV]) == 0
    assert decode.batch_register_memory([dst], [KV]) == 0
    session = f"127.0.0.1:{decode.get_rpc_port()}"
    blocks = [3, 0, 7, 12]      # the decode's blocks get the prefill's blocks 0..3
    before = double.copies
    assert prefill.batch_transfer_sync_write(
        session, [src + i * BLOCK for i in range(4)], [dst + b * BLOCK for b in blocks],
        [BLOCK] * 4) == 0
    got = double.view(dst, KV)
    for i, b in enumerate(blocks):
        assert got[b * BLOCK:(b + 1) * BLOCK] == pattern[i * BLOCK:(i + 1) * BLOCK]
    assert double.copies > before, "CUDA copies moved the blocks"
    assert prefill.transfer_sync_write(session, src + KV - 64, dst + KV - 64, 64) == 0
    assert double.view(dst + KV - 64, 64) == pattern[-64:]
    assert prefill.transfer_sync_read(session, src, dst + 3 * BLOCK, BLOCK) == 0
    assert double.view(src, BLOCK) == pattern[:BLOCK]
    # a block past the decode's registration is refused with an error code, nothing moves
    assert prefill.batch_transfer_sync_write(session, [src], [dst + KV - 8], [64]) < 0
    assert decode.batch_unregister_memory([dst]) == 0
    assert prefill.transfer_sync_write(session, src, dst, 64) < 0, "deregistered: refused"
    assert prefill.batch_unregister_memory([src]) == 0


@pytest.fixture
def store(double) -> Iterator[MooncakeDistributedStore]:
    server = MasterServer(MasterConfig(), ServerOptions(rpc_port=0))
    server.start()
    s = MooncakeDistributedStore()
    try:
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 1 << 20, "tcp", "",
                       server.address) == 0
        yield s
    finally:
        s.close()
        server.close()


def test_store_connector_calls_on_gpu_kv(store, double):
    """vLLM's MooncakeStoreConnector: register_buffer of each layer's KV tensor (device
    memory), batch_put_from_multi_buffers of a block's pieces over every layer,
    batch_is_exist, batch_get_into_multi_buffers into other blocks."""
    layers = [double.alloc(KV) for _ in range(4)]
    for i, base in enumerate(layers):
        write(base, bytes([i + 1]) * KV)
        assert store.register_buffer(base, KV) == 0
    keys = [f"blk-{b}" for b in range(3)]
    ptrs = [[base + b * BLOCK for base in layers] for b in range(3)]
    before = double.copies
    assert store.batch_put_from_multi_buffers(keys, ptrs, [[BLOCK] * 4] * 3) == [0, 0, 0]
    assert store.batch_is_exist(keys + ["absent"]) == [1, 1, 1, 0]
    assert double.copies > before, "CUDA copies read the device memory"
    for base in layers:
        write(base, bytes(KV))
    into = [[base + (10 + b) * BLOCK for base in layers] for b in range(3)]
    assert store.batch_get_into_multi_buffers(keys, into, [[BLOCK] * 4] * 3) == [4 * BLOCK] * 3
    for i, base in enumerate(layers):
        for b in range(3):
            assert double.view(base + (10 + b) * BLOCK, BLOCK) == bytes([i + 1]) * BLOCK
        assert double.view(base, BLOCK) == bytes(BLOCK), "nothing written elsewhere"
        assert store.unregister_buffer(base) == 0


def test_get_into_an_unregistered_gpu_destination(store, double):
    """Upstream's CUDA case: ``get_into`` a CUDA tensor nobody registered works (it is
    registered for the call); unregistered host memory is still refused."""
    raw = bytes(range(32))
    assert store.put("raw", raw) == 0
    dst = double.alloc(64)
    double.copy_log.clear()
    assert store.get_into("raw", dst, len(raw)) == len(raw)
    assert double.view(dst, len(raw)) == raw and double.copy_log
    assert not store.client.engine.is_registered(dst, len(raw)), "registered for the call only"
    host = ctypes.create_string_buffer(64)
    assert store.get_into("raw", ctypes.addressof(host), len(raw)) < 0
