"""``MooncakePluginsPDConnector``: disaggregated prefill over our transfer engine.

A prefill engine computes a prompt's KV; its workers write the KV straight into the
decode engine's KV cache; the decode engine generates from there::

    # decode (start it first), then prefill
    vllm serve MODEL --port 8200 --kv-transfer-config '{"kv_connector":
        "MooncakePluginsPDConnector", "kv_role":"kv_consumer",
        "kv_load_failure_policy":"recompute"}'
    vllm serve MODEL --port 8100 --kv-transfer-config '{"kv_connector":
        "MooncakePluginsPDConnector", "kv_role":"kv_producer"}'
    python examples/vllm_pd_proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

The proxy sends a request to the prefill with ``{"do_remote_decode": true,
"transfer_id": ...}`` and ``max_tokens`` 1; the prefill answers with the parameters the
decode needs, and the proxy sends the request on to the decode with them. Flow and
failure handling: :mod:`.pd_scheduler`, :mod:`.pd_worker`; settings:
:class:`.config.PDSettings`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorTransferResults,
)

from .config import PDSettings, from_extra_config
from .connector_base import SplitConnector, tp_rank

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput

NAME = "MooncakePluginsPDConnector"


class MooncakePluginsPDConnector(SplitConnector):
    """Prefill writes, decode receives; see the module docstring."""

    NAME = NAME

    def _build_scheduler(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> Any:
        from .pd_scheduler import PDScheduler

        from_extra_config(PDSettings, self._kv_transfer_config.kv_connector_extra_config, NAME)
        return PDScheduler(vllm_config, kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)

    def _build_worker(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> Any:
        from .pd_worker import PDWorker

        kv = self._kv_transfer_config
        settings = from_extra_config(PDSettings, kv.kv_connector_extra_config, NAME)
        return PDWorker(settings, kv.engine_id, kv.is_kv_producer, kv.is_kv_consumer,
                        kv_cache_config.num_blocks, tp_rank(),
                        vllm_config.parallel_config.tensor_parallel_size)

    # -- worker side --------------------------------------------------------------------
    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.get_handshake_metadata()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Received KV is complete before its request is scheduled."""

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any,
                      **kwargs: Any) -> None:
        """The prefill's KV is written from the paged cache once the request finished."""

    def wait_for_save(self) -> None:
        """Nothing to wait for: writes run on the side channel's threads."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Requests done sending, done receiving and, of those, failed receives (vLLM
        recomputes them); reported once each."""
        sent, received, failed = self._worker.get_finished()
        return KVConnectorTransferResults(finished_sending=set(sent or ()),
                                          finished_recving=set(received or ()),
                                          failed_recving=failed)

    # -- scheduler side -----------------------------------------------------------------
    def set_xfer_handshake_metadata(
            self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._scheduler.set_xfer_handshake_metadata(metadata)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._scheduler.update_finished_sending(connector_output.finished_sending or set())
