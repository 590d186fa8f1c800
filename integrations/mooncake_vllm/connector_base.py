"""What our connectors share: a scheduler-side and a worker-side object behind vLLM's
single connector class, and the calls that only pass through to one of them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .stats import TransferStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 outside an initialised model-parallel group)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    return parallel_state.get_tensor_model_parallel_rank()


class SplitConnector(KVConnectorBase_V1):
    """Builds ``self._scheduler`` or ``self._worker`` (by role) and delegates to it.

    Subclasses name themselves (``NAME``) and build the two sides in
    :meth:`_build_scheduler` and :meth:`_build_worker`.
    """

    NAME = ""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ValueError(f"{self.NAME} needs vLLM's kv_cache_config (vLLM >= 0.32)")
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"{self.NAME}: {len(groups)} KV cache groups; this connector "
                             "keeps one (start vLLM with --disable-hybrid-kv-cache-manager)")
        self._scheduler: Any = None
        self._worker: Any = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._build_scheduler(vllm_config, kv_cache_config)
        else:
            self._worker = self._build_worker(vllm_config, kv_cache_config)

    def _build_scheduler(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> Any:
        raise NotImplementedError

    def _build_worker(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> Any:
        raise NotImplementedError

    # -- worker side --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker.start_load_kv(self._get_connector_metadata())

    # -- scheduler side -----------------------------------------------------------------
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
        take = getattr(side, "get_kv_connector_stats", None)
        return take() if take else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TransferStats:
        return TransferStats(data=dict(data or {}))

    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            close = getattr(side, "shutdown", None)
            if close is not None:
                close()
