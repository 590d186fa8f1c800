"""Store keys of KV blocks: prefix hash, model, layout and tensor-parallel rank.

A block's key names everything that decides its bytes, so two deployments that differ in
model, dtype, block size, head layout, platform or TP split never read each other's
blocks: ``{prefix}vllm/{model}/{layout}/tp{rank}of{size}/{block hash}``. The block hash is
vLLM's own chained prefix hash (``Request.block_hashes``: the tokens of this block and of
every block before it, plus LoRA, multimodal inputs and cache salt), so equal keys mean
equal prefixes.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Sequence

from mooncake_plugins.store import block_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def _model_tag(model: str) -> str:
    base = os.path.basename(model.rstrip("/")) or "model"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in base)[:48]
    return f"{safe}-{hashlib.sha256(model.encode()).hexdigest()[:12]}"


class BlockKeys:
    """Keys of one engine's KV blocks.

    Raises:
        ValueError: a KV cache config with several groups (hybrid models; start vLLM with
            ``--disable-hybrid-kv-cache-manager``) or a block size that is not a multiple of
            the prefix-hash granularity.
    """

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
                 key_prefix: str = "") -> None:
        from vllm.platforms import current_platform

        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"{len(groups)} KV cache groups: this connector keeps one "
                             "(start vLLM with --disable-hybrid-kv-cache-manager)")
        spec = groups[0].kv_cache_spec
        self.block_size: int = spec.block_size
        hash_block = getattr(kv_cache_config, "hash_block_size", None) or self.block_size
        if self.block_size % hash_block:
            raise ValueError(f"block size {self.block_size} is not a multiple of the "
                             f"prefix-hash block size {hash_block}")
        self._hashes_per_block = self.block_size // hash_block
        parallel = vllm_config.parallel_config
        self.tp_size: int = parallel.tensor_parallel_size
        dtype = str(spec.dtype).removeprefix("torch.")
        layout = (f"{current_platform.device_type}-{type(spec).__name__}-{dtype}"
                  f"-bs{self.block_size}-kvh{spec.num_kv_heads}-hd{spec.head_size}"
                  f"-L{len(groups[0].layer_names)}-pp{parallel.pipeline_parallel_size}")
        model = vllm_config.model_config.model
        self._base = f"{key_prefix}vllm/{_model_tag(model)}/{layout}"

    def block_hashes(self, request: "Request") -> list[str]:
        """Hex hashes of the request's full blocks, in order."""
        hashes = request.block_hashes
        step = self._hashes_per_block
        return [bytes(hashes[i]).hex() for i in range(step - 1, len(hashes), step)]

    def key(self, block_hash: str, tp_rank: int) -> str:
        return block_keys.block_key(self._base, block_hash, tp_rank, self.tp_size)

    def keys(self, block_hashes: Sequence[str], tp_rank: int) -> list[str]:
        return [self.key(h, tp_rank) for h in block_hashes]

    def all_ranks(self, block_hashes: Sequence[str]) -> list[str]:
        """Every rank's key of each block, block-major: ``[b0r0, b0r1, ..., b1r0, ...]``."""
        return block_keys.all_ranks(self._base, block_hashes, self.tp_size)
