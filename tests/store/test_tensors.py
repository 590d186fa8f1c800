"""CPU torch tensors: registered with the engine, stored and read back through the store."""

import pytest
from helpers import require_module

torch = require_module("torch", "torch is not installed (pip install torch==2.13.0, the CPU wheel "
                                "that .ci/run installs)")

from mooncake_plugins.compat.store import MooncakeDistributedStore  # noqa: E402
from mooncake_plugins.config import EngineConfig  # noqa: E402
from mooncake_plugins.transfer import TransferEngine  # noqa: E402


def test_engine_moves_tensor_memory():
    cfg = lambda: EngineConfig(transports=["tcp"])  # noqa: E731
    with TransferEngine(config=cfg()) as a, TransferEngine(config=cfg()) as b:
        src = torch.arange(4096, dtype=torch.float32)
        dst = torch.zeros(4096, dtype=torch.float32)
        ra, rb = a.register(src), b.register(dst)
        a.write(b.segment_name, ra.address, rb.address, src.numel() * 4)
        assert torch.equal(src, dst)
        with pytest.raises(ValueError):
            a.register(src[::2])  # not contiguous


def test_put_get_tensor(master):
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 8 << 20, 0, "tcp", "", master.address) == 0
    try:
        for t in (torch.randn(3, 5, 7), torch.arange(10, dtype=torch.int64),
                  torch.randn(4, 4).to(torch.bfloat16)):
            key = f"t-{t.dtype}"
            assert s.put_tensor(key, t) == 0
            back = s.get_tensor(key)
            assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
        assert s.get_tensor("missing") is None
    finally:
        s.close()
