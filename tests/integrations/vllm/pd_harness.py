"""A prefill and a decode "engine" in one process for the P/D connector: vLLM's own
scheduler plus our worker side over a CPU KV cache each (:class:`harness.MiniEngine`),
with the connector's transfer results (received, failed) fed back as vLLM does."""

from __future__ import annotations

from typing import Any

from harness import MiniEngine
from vllm.v1.request import Request

PD = "MooncakePluginsPDConnector"
PD_EXTRA = {"local_hostname": "127.0.0.1", "pull_wait_s": 5.0, "transfer_timeout_s": 5.0,
            "connect_timeout_s": 2.0, "abort_timeout_s": 60.0}


class PDEngine(MiniEngine):
    """A :class:`MiniEngine` running the P/D connector in ``role``."""

    def __init__(self, model_dir: str, role: str, extra: dict[str, Any] | None = None,
                 **kw: Any) -> None:
        super().__init__(model_dir, {**PD_EXTRA, **(extra or {})}, role=role, connector=PD,
                         **kw)
        handshake = self.worker.get_handshake_metadata()
        if handshake is not None:        # what vLLM's engine core does after KV registration
            self.connector.set_xfer_handshake_metadata({0: handshake})

    def add_pd(self, req_id: str, prompt: list[int], params: dict[str, Any] | None,
               max_tokens: int = 4) -> Request:
        return self.add(req_id, prompt, max_tokens, params)
