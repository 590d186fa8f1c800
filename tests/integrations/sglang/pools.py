"""SGLang's host KV pool on CPU, built as SGLang builds it, for tests and the reader child.

Importing SGLang's pool pulls ``torchvision`` through a multimodal config module; the
lean CPU venv has no usable torchvision (only CUDA builds exist on the index), so a
stand-in that fails on use is installed for that import only (:func:`stub_torchvision`).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 8, 4
DEVICE_TOKENS = 64
MODEL = "tiny/llama"


class _Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []

        def missing(attr: str) -> Any:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return type(attr, (), {"__init__": _unusable})

        mod.__getattr__ = missing
        return mod

    def exec_module(self, module) -> None:
        pass


def _unusable(*_: Any, **__: Any) -> None:
    raise RuntimeError("torchvision is a test stand-in here (no CPU build available)")


def stub_torchvision() -> None:
    try:
        import torchvision  # noqa: F401
    except Exception:
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        sys.meta_path.insert(0, _Stub())


import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402

stub_torchvision()  # after transformers decided (without it) that torchvision is absent

from sglang.srt.mem_cache.device_pool_info import (KVBufferLayout, KVBuffers,  # noqa: E402
                                                   MHABufferInfo)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402


def host_pool(layout: str) -> MHATokenToKVPoolHost:
    """A host pool of fp16 KV for a 2-layer, 2-head model (pages of 4 tokens)."""
    k = tuple(torch.zeros(DEVICE_TOKENS + PAGE, HEADS, HEAD_DIM, dtype=torch.float16)
              for _ in range(LAYERS))
    v = tuple(torch.zeros_like(t) for t in k)
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM,
                         v_head_dim=HEAD_DIM, dtype=torch.float16, device=torch.device("cpu"))
    pool = MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=DEVICE_TOKENS, start_layer=0,
                                end_layer=LAYERS)
    pool._device_buffers = (k, v)  # keep the "device" tensors alive with the pool
    return pool


def storage_config(extra: dict[str, Any] | None, layout: str,
                   tp_rank: int = 0) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=layout != "layer_first", model_name=MODEL, extra_config=extra)


def fill_pages(pool: MHATokenToKVPoolHost, indices: torch.Tensor, seed: int) -> None:
    """Give each page of ``indices`` bytes that depend only on (seed, page number)."""
    for n, start in enumerate(indices[::PAGE].tolist()):
        g = torch.Generator().manual_seed(seed * 1009 + n)
        flat = pool.get_data_page(start, flat=True)
        pool.set_from_flat_data_page(start, torch.randn(flat.shape, generator=g)
                                     .to(flat.dtype))


def page_digests(pool: MHATokenToKVPoolHost, indices: torch.Tensor) -> list[str]:
    return [hashlib.sha256(pool.get_data_page(s, flat=True).contiguous().view(torch.uint8)
                           .numpy().tobytes()).hexdigest()
            for s in indices[::PAGE].tolist()]


def write_pages(backend: Any, pool: MHATokenToKVPoolHost, keys: list[str],
                indices: torch.Tensor) -> list[bool]:
    """Store pages the way SGLang's controller does for the backend's interface."""
    if backend.storage_config.extra_config.get("interface_v1"):
        return backend.batch_set_v1(keys, indices)
    ok = backend.batch_set(keys, [pool.get_data_page(s) for s in indices[::PAGE].tolist()])
    return [ok] * len(keys)


def read_pages(backend: Any, pool: MHATokenToKVPoolHost, keys: list[str],
               indices: torch.Tensor) -> list[bool]:
    """Read pages into ``indices`` the way SGLang's controller does."""
    if backend.storage_config.extra_config.get("interface_v1"):
        return backend.batch_get_v1(keys, indices)
    pages = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    for page, start in zip(pages, indices[::PAGE].tolist()):
        if page is not None:
            pool.set_from_flat_data_page(start, page)
    return [p is not None for p in pages]
