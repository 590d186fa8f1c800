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

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .config import StoreSettings, from_extra_config
from .connector_base import SplitConnector, tp_rank
from .keys import BlockKeys

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

NAME = "MooncakePluginsStoreConnector"


class MooncakePluginsStoreConnector(SplitConnector):
    """A prefix KV pool over our store; see the module docstring."""

    NAME = NAME

    def _settings(self) -> StoreSettings:
        return from_extra_config(StoreSettings,
                                 self._kv_transfer_config.kv_connector_extra_config, NAME)

    def _build_scheduler(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> Any:
        from .store_scheduler import StoreScheduler

        settings = self._settings()
        return StoreScheduler(vllm_config, settings,
                              BlockKeys(vllm_config, kv_cache_config, settings.key_prefix))

    def _build_worker(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> Any:
        from .store_worker import StoreWorker

        settings = self._settings()
        return StoreWorker(settings, BlockKeys(vllm_config, kv_cache_config, settings.key_prefix),
                           kv_cache_config.num_blocks, tp_rank())

    # -- worker side --------------------------------------------------------------------
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._worker.handle_preemptions(kv_connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for this layer's reads of the step's blocks (started in start_load_kv)."""
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Blocks are saved whole (all layers) once the forward pass is done: a block is one
        store object, and a put is published only when all of its bytes are written."""

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

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._scheduler.update_connector_output(connector_output)
