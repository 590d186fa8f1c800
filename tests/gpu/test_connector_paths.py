"""Our vLLM connectors' worker paths on a real GPU KV cache, with torch alone (marker
``cuda``; vLLM cannot be installed on the lent GPU machines, which reach no package index).

The KV cache is CUDA flash attention's layout, ``[2, num_blocks, block_size, kv_heads,
head]`` in bf16, per layer, as vLLM allocates it; the connector's own pieces move it:
``KVLayout`` (each block's ``(address, nbytes)`` pieces over all layers), ``cuda_fence``
(the saver waits for the compute stream's work, no device-wide synchronize), the store
client's gathered put of whole blocks and its layer-wise ranged reads into other blocks
(the store connector), and the transfer engine writing blocks into another process's GPU
KV cache (the P/D connector, over cuda_ipc).
"""

from __future__ import annotations

import hashlib
import json
import textwrap

import pytest
from peers import Target

from mooncake_plugins.store.client import StoreClient
from mooncake_plugins.store.master import MasterConfig
from mooncake_plugins.store.server import MasterServer, ServerOptions
from mooncake_plugins.transfer import TransferEngine
from mooncake_plugins.transfer.batch import OpCode, TransferRequest

torch = pytest.importorskip("torch", reason="the connector paths run on torch tensors")
from mooncake_vllm.cuda_fence import fence  # noqa: E402
from mooncake_vllm.kv_layout import KVLayout  # noqa: E402

pytestmark = pytest.mark.cuda

LAYERS, NUM_BLOCKS, BLOCK, HEADS, HEAD = 4, 64, 16, 8, 128
SAVED = 16    # blocks saved, then loaded into blocks SAVED..2*SAVED-1


def gpu_kv() -> dict[str, "torch.Tensor"]:
    if not torch.cuda.is_available():
        pytest.skip("torch here has no CUDA")
    return {f"model.layers.{i}.self_attn": torch.empty(
        2, NUM_BLOCKS, BLOCK, HEADS, HEAD, dtype=torch.bfloat16, device="cuda")
        for i in range(LAYERS)}


def test_store_connector_path_saves_and_loads_gpu_blocks() -> None:
    kv = gpu_kv()
    layout = KVLayout(kv, NUM_BLOCKS)
    assert layout.cuda_devices == [torch.cuda.current_device()]
    assert layout.pieces_per_block == 2 * LAYERS     # K and V of each layer
    server = MasterServer(MasterConfig(), ServerOptions(rpc_port=0))
    server.start()
    try:
        with StoreClient(server.address, global_segment_size=256 << 20) as holder, \
                StoreClient(server.address, global_segment_size=0) as client:
            for address, nbytes, location in layout.regions:
                client.register_buffer(address, nbytes, location)
            for t in kv.values():
                t.normal_()            # the "forward pass", queued on the compute stream
            after = fence(layout.cuda_devices)
            assert after is not None
            after.wait()               # what the saver thread does before reading
            keys = [f"blk-{b}" for b in range(SAVED)]
            assert client.batch_put_from_parts(
                keys, [layout.block_pieces(b) for b in range(SAVED)]) == [None] * SAVED
            located = client.locate(keys)
            for layer in range(LAYERS):   # layer-wise ranged reads, as the loader does
                reads = [(j, layer * layout.layer_nbytes, layout.layer_pieces(SAVED + j, layer))
                         for j in range(SAVED)]
                got = client.batch_get_ranges_into(located, reads)
                assert got == [layout.layer_nbytes] * SAVED, got
            for name, t in kv.items():
                assert torch.equal(t[:, SAVED:2 * SAVED], t[:, :SAVED]), name
            for address, _, _ in layout.regions:
                client.unregister_buffer(address)
            assert holder.stats()["objects"] == SAVED
    finally:
        server.close()


DECODE = textwrap.dedent("""
    import hashlib, json, sys, torch
    sys.path.insert(0, "integrations")
    from mooncake_plugins.transfer import TransferEngine
    from mooncake_vllm.kv_layout import KVLayout
    kv = {f"l{i}": torch.zeros(2, %(n)d, %(b)d, %(h)d, %(d)d, dtype=torch.bfloat16,
                               device="cuda") for i in range(%(layers)d)}
    layout = KVLayout(kv, %(n)d)
    eng = TransferEngine()
    for address, nbytes, location in layout.regions:
        eng.register_address(address, nbytes, location)
    print(eng.segment_name, layout.block_pieces(0)[0][0], flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] not in ("pieces", "hash"):
            break
        blocks = [int(x) for x in words[1:]]
        if words[0] == "pieces":   # what a decode worker sends the prefill in its pull
            print(json.dumps([layout.block_pieces(b) for b in blocks]), flush=True)
            continue
        h = hashlib.sha256()
        for name, t in kv.items():
            h.update(t[:, blocks].float().cpu().numpy().tobytes())
        print(h.hexdigest(), flush=True)
    eng.close()
    print("bye", flush=True)
""")


def test_pd_connector_path_writes_blocks_into_another_process_gpu_kv() -> None:
    kv = gpu_kv()
    for t in kv.values():
        t.normal_()
    prefill = KVLayout(kv, NUM_BLOCKS)
    script = DECODE % {"n": NUM_BLOCKS, "b": BLOCK, "h": HEADS, "d": HEAD, "layers": LAYERS}
    with Target(script) as decode_proc, TransferEngine() as eng:
        for address, nbytes, location in prefill.regions:
            eng.register_address(address, nbytes, location, private=True)
        src_blocks, dst_blocks = list(range(8)), [40, 3, 17, 9, 60, 22, 31, 50]
        theirs = json.loads(decode_proc.ask("pieces " + " ".join(map(str, dst_blocks))))
        after = fence(prefill.cuda_devices)
        after.wait()               # what the prefill worker does before writing
        requests = [TransferRequest(OpCode.WRITE, s_addr, d_addr, n)
                    for s, dst in zip(src_blocks, theirs)
                    for (s_addr, n), (d_addr, d_n) in zip(prefill.block_pieces(s), dst)]
        assert all(r.nbytes == n for r, (_, n) in zip(requests, (p for b in theirs for p in b)))
        eng.submit(decode_proc.segment, requests).wait(60)   # raises the first error
        h = hashlib.sha256()
        for t in kv.values():
            h.update(t[:, src_blocks].float().cpu().numpy().tobytes())
        assert decode_proc.ask("hash " + " ".join(map(str, dst_blocks))) == h.hexdigest()
