"""Our vLLM connectors' pieces that need no vLLM: settings from kv_connector_extra_config
and the KV layout of a block (on CPU and CUDA-shaped tensors)."""

from __future__ import annotations

import pytest
from helpers import require_module

from cuda_double import double  # noqa: F401  (the fixture)

from mooncake_vllm.config import StoreSettings, from_extra_config

torch = require_module("torch", "the KV layout works on torch tensors")
from mooncake_vllm.kv_layout import KVLayout  # noqa: E402


def test_settings_convert_and_name_bad_fields():
    s = from_extra_config(StoreSettings, {"master_server_address": "10.0.0.1:50051",
                                          "global_segment_size": "2GB", "replica_num": "2",
                                          "save_decode_cache": "yes"}, "X")
    assert (s.global_segment_size, s.replica_num, s.save_decode_cache) == (2 << 30, 2, True)
    assert from_extra_config(StoreSettings, None, "X") == StoreSettings()
    with pytest.raises(ValueError, match=r"X kv_connector_extra_config: unknown key "
                                         r"'master_address'; known keys: .*master_server_address"):
        from_extra_config(StoreSettings, {"master_address": "h:1"}, "X")
    with pytest.raises(ValueError, match=r"\['global_segment_size'\]: bad size '4 GBs'"):
        from_extra_config(StoreSettings, {"global_segment_size": "4 GBs"}, "X")
    with pytest.raises(ValueError, match=r"\['replica_num'\]: expected an integer"):
        from_extra_config(StoreSettings, {"replica_num": 1.5}, "X")
    with pytest.raises(ValueError, match="protocol 'efa'"):
        from_extra_config(StoreSettings, {"protocol": "efa"}, "X")
    assert from_extra_config(StoreSettings, {"protocol": "rdma"}, "X").protocol == "rdma"
    with pytest.raises(ValueError, match="not host:port"):
        from_extra_config(StoreSettings, {"master_server_address": "localhost"}, "X")


def block_bytes(layout: KVLayout, block: int) -> bytes:
    import ctypes

    return b"".join(ctypes.string_at(a, n) for a, n in layout.block_pieces(block))


def test_cpu_layout_block_is_one_piece_per_layer():
    kv = {f"l{i}": torch.arange(8 * 2 * 4 * 6, dtype=torch.float32).reshape(8, 2, 4, 6) + i
          for i in range(3)}
    layout = KVLayout(kv, num_blocks=8)
    assert layout.pieces_per_block == 3 and layout.block_nbytes == 3 * 2 * 4 * 6 * 4
    want = b"".join(kv[f"l{i}"][5].contiguous().numpy().tobytes() for i in range(3))
    assert block_bytes(layout, 5) == want
    assert len(layout.regions) == 3


def test_cuda_shaped_layout_splits_k_and_v():
    # flash attention: [2, num_blocks, block_size, kv_heads, head_size]
    t = torch.arange(2 * 8 * 4 * 2 * 3, dtype=torch.float32).reshape(2, 8, 4, 2, 3)
    layout = KVLayout({"l": t}, num_blocks=8)
    assert layout.pieces_per_block == 2
    assert block_bytes(layout, 6) == t[:, 6].contiguous().numpy().tobytes()


def test_layout_rejects_what_it_cannot_address():
    with pytest.raises(ValueError, match="no block dimension of 8"):
        KVLayout({"l": torch.zeros(7, 4)}, num_blocks=8)
    with pytest.raises(ValueError, match="disagree"):
        KVLayout({"a": torch.zeros(8, 4), "b": torch.zeros(8, 5)}, num_blocks=8)
    with pytest.raises(IndexError):
        KVLayout({"a": torch.zeros(8, 4)}, num_blocks=8).block_pieces(8)


def test_layout_over_gpu_memory_registers_cuda_regions(double):
    """Tensors over GPU memory (the CUDA TEST DOUBLE's: host memory it calls device
    memory) are registered as cuda:N, found from the pointer."""
    import ctypes

    nbytes = 2 * 8 * 4 * 4
    raw = (ctypes.c_char * nbytes).from_address(double.alloc(nbytes, device=1))
    t = torch.frombuffer(raw, dtype=torch.float32).view(2, 8, 4, 1, 1)
    layout = KVLayout({"l": t}, num_blocks=8)
    assert layout.regions == [(t.data_ptr(), nbytes, "cuda:1")]
    assert layout.cuda_devices == [1] and "in cuda:1" in layout.describe()
    assert KVLayout({"l": torch.zeros(8, 4)}, num_blocks=8).cuda_devices == []


def test_layout_refuses_kv_no_transport_moves(monkeypatch):
    with pytest.raises(ValueError, match="layer l: KV cache on meta; the transfer engine "
                                         "moves host .cpu. and CUDA memory only"):
        KVLayout({"l": torch.zeros(8, 4, device="meta")}, num_blocks=8)
    from mooncake_plugins.transfer import cuda
    from mooncake_vllm import kv_layout

    monkeypatch.setattr(cuda, "available", lambda: False)
    monkeypatch.setattr(cuda, "why_unavailable", lambda: "no CUDA driver (test)")
    with pytest.raises(ValueError, match=r"KV cache memory 0x1000\+64 \(cuda:0\): moving it "
                                         r"needs CUDA, and no CUDA driver \(test\)"):
        kv_layout._resolve(0x1000, 64, "cuda:0")
