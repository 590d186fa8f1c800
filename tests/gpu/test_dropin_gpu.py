"""The frameworks' in-tree Mooncake calls on the drop-in with GPU buffers, on a real GPU
(marker ``cuda``): the same sequences as tests/compat/test_gpu_dropin.py runs over the
CUDA test double. vLLM's ``MooncakeConnector`` and SGLang's ``MooncakeKVManager``
register their GPU KV caches with ``mooncake.engine`` and write blocks between them;
vLLM's ``MooncakeStoreConnector`` registers each layer with ``mooncake.store`` and puts
and gets a block's pieces over every layer.
"""

from __future__ import annotations

import os

import pytest

from mooncake.engine import TransferEngine
from mooncake.store import MooncakeDistributedStore
from mooncake_plugins.store.master import MasterConfig
from mooncake_plugins.store.server import MasterServer, ServerOptions
from mooncake_plugins.transfer import cuda, memory

pytestmark = pytest.mark.cuda

KV = 4 << 20
BLOCK = 64 << 10


def upload(address: int, data: bytes) -> None:
    staging = bytearray(data)
    cuda.copy(address, memory.address_of(staging)[0], len(data))


def download(address: int, nbytes: int) -> bytes:
    return memory.read_bytes(address, nbytes)


def test_pd_block_writes_between_gpu_kv_caches() -> None:
    prefill, decode = TransferEngine(), TransferEngine()
    with cuda.DeviceBuffer(KV) as src, cuda.DeviceBuffer(KV) as dst:
        try:
            for e in (prefill, decode):
                assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
            pattern = os.urandom(KV)
            upload(src.address, pattern)
            upload(dst.address, bytes(KV))
            assert prefill.batch_register_memory([src.address], [KV]) == 0
            assert decode.batch_register_memory([dst.address], [KV]) == 0
            session = f"127.0.0.1:{decode.get_rpc_port()}"
            blocks = [3, 0, 7, 12]
            assert prefill.batch_transfer_sync_write(
                session, [src.address + i * BLOCK for i in range(4)],
                [dst.address + b * BLOCK for b in blocks], [BLOCK] * 4) == 0
            got = download(dst.address, KV)
            for i, b in enumerate(blocks):
                assert got[b * BLOCK:(b + 1) * BLOCK] == pattern[i * BLOCK:(i + 1) * BLOCK]
            assert prefill.batch_transfer_sync_write(session, [src.address],
                                                     [dst.address + KV - 8], [64]) < 0
            assert decode.batch_unregister_memory([dst.address]) == 0
            assert prefill.batch_unregister_memory([src.address]) == 0
        finally:
            prefill.close()
            decode.close()


def test_store_connector_calls_on_gpu_kv() -> None:
    server = MasterServer(MasterConfig(), ServerOptions(rpc_port=0))
    server.start()
    store = MooncakeDistributedStore()
    layers = [cuda.DeviceBuffer(KV) for _ in range(4)]
    try:
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 1 << 20, "tcp", "",
                           server.address) == 0
        for i, buf in enumerate(layers):
            upload(buf.address, bytes([i + 1]) * KV)
            assert store.register_buffer(buf.address, KV) == 0
        keys = [f"blk-{b}" for b in range(3)]
        ptrs = [[buf.address + b * BLOCK for buf in layers] for b in range(3)]
        assert store.batch_put_from_multi_buffers(keys, ptrs, [[BLOCK] * 4] * 3) == [0, 0, 0]
        into = [[buf.address + (10 + b) * BLOCK for buf in layers] for b in range(3)]
        for buf in layers:
            upload(buf.address + 10 * BLOCK, bytes(3 * BLOCK))
        assert store.batch_get_into_multi_buffers(keys, into, [[BLOCK] * 4] * 3) == \
            [4 * BLOCK] * 3
        for i, buf in enumerate(layers):
            assert download(buf.address + 10 * BLOCK, 3 * BLOCK) == bytes([i + 1]) * 3 * BLOCK
            assert store.unregister_buffer(buf.address) == 0
    finally:
        store.close()
        server.close()
        for buf in layers:
            buf.close()


def test_tensor_reads_into_gpu_memory() -> None:
    """LMCache's and SGLang's tensor calls with CUDA tensors: ``put_tensor`` of a CUDA
    tensor, ``get_tensor_into`` a registered device buffer (a CUDA tensor over it comes
    back), ``get_tensor_into_cuda`` straight into a registered CUDA tensor."""
    torch = pytest.importorskip("torch", reason="tensor calls need torch")
    if not torch.cuda.is_available():
        pytest.skip("torch here has no CUDA")
    server = MasterServer(MasterConfig(), ServerOptions(rpc_port=0))
    server.start()
    store = MooncakeDistributedStore()
    try:
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 1 << 20, "tcp", "",
                           server.address) == 0
        t = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
        nbytes = t.numel() * t.element_size()
        assert store.put_tensor("kv", t) == 0
        buf = torch.empty(304 + nbytes, dtype=torch.uint8, device="cuda")
        assert store.register_buffer(buf.data_ptr(), buf.numel()) == 0
        got = store.get_tensor_into("kv", buf.data_ptr(), buf.numel())
        assert got.is_cuda and got.data_ptr() == buf.data_ptr() + 304 and torch.equal(got, t)
        dest = torch.empty_like(t)
        assert store.register_buffer(dest.data_ptr(), nbytes) == 0
        assert store.get_tensor_into_cuda("kv", dest) == nbytes and torch.equal(dest, t)
        assert store.unregister_buffer(dest.data_ptr()) == 0
        assert store.unregister_buffer(buf.data_ptr()) == 0
        # upstream's CUDA case: CUDA sources for the tensor puts, an unregistered CUDA
        # destination for get_into
        ts = [torch.arange(16, dtype=torch.float32, device="cuda").reshape(4, 4),
              torch.arange(24, dtype=torch.int64, device="cuda").reshape(2, 3, 4)]
        assert store.upsert_tensor("u", ts[0]) == 0
        assert store.batch_put_tensor(["b0", "b1"], ts) == [0, 0]
        assert store.batch_upsert_tensor(["b0", "b1"], ts[::-1]) == [0, 0]
        assert torch.equal(store.get_tensor("u"), ts[0].cpu())
        assert torch.equal(store.get_tensor("b0"), ts[1].cpu())
        raw = bytes(range(32))
        assert store.put("raw", raw) == 0
        dst = torch.empty(len(raw), dtype=torch.uint8, device="cuda")
        assert store.get_into("raw", dst.data_ptr(), len(raw)) == len(raw)
        assert dst.cpu().numpy().tobytes() == raw
    finally:
        store.close()
        server.close()
