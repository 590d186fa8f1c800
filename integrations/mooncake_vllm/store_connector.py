"""``MooncakePluginsStoreConnector``: vLLM's KV blocks in a shared Mooncake Store pool.

Select it with vLLM's own flag (the name is registered through the
``vllm.general_plugins`` entry point of this distribution)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"MooncakePluginsStoreConnector",
        "kv_role":"kv_both", "kv_load_failure_policy":"recompute",
        "kv_connector_extra_config":{"master_server_address":"127.0.0.1:50051"}}'

Every full prompt block an engine computes is saved under a key of its prefix hash,
model, layout and TP rank (:mod:`.keys`); any engine that later sees the same prefix
loads those blocks instead of computing them. Settings: :class:`.config.StoreSettings`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .config import StoreSettings, from_extra_config
from .keys import BlockKeys
from .stats import TransferStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

NAME = "MooncakePluginsStoreConnector"


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 outside an initialised model-parallel group)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    return parallel_state.get_tensor_model_parallel_rank()


class MooncakePluginsStoreConnector(KVConnectorBase_V1):
    """A prefix KV pool over our store; see the module docstring."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ValueError(f"{NAME} needs vLLM's kv_cache_config (vLLM >= 0.32)")
        settings = from_extra_config(StoreSettings,
                                     self._kv_transfer_config.kv_connector_extra_config, NAME)
        keys = BlockKeys(vllm_config, kv_cache_config, settings.key_prefix)
        self._scheduler = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from .store_scheduler import StoreScheduler

            self._scheduler = StoreScheduler(vllm_config, settings, keys)
        else:
            from .store_worker import StoreWorker

            self._worker = StoreWorker(settings, keys, kv_cache_config.num_blocks, tp_rank())

    # -- worker side --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in :meth:`start_load_kv`, before the forward pass."""

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Blocks are saved whole (all layers) once the forward pass is done."""

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    # -- scheduler side -----------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    # -- both ---------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> TransferStats | None:
        side = self._scheduler or self._worker
        return side.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TransferStats:
        return TransferStats(data=dict(data or {}))

    def shutdown(self) -> None:
        (self._scheduler or self._worker).shutdown()
