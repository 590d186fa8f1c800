"""vLLM's own scheduler and our connector's worker side in one process, stepped by hand.

``MiniEngine`` is what an engine does around the connector, without a model: each step
it schedules, lets the worker side load and save, "computes" the scheduled tokens by
writing a value that depends only on (token, position) into their KV slots, and feeds
vLLM a model-runner output (with the connector's results) back. A block loaded from the
store must therefore hold exactly the values a computation would have written.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                         SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.plugins import load_general_plugins
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 16
CONNECTOR = "MooncakePluginsStoreConnector"

init_none_hash(sha256)


def store_config(address: str, **extra: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` for tests: no segment of our own (the holder has it)."""
    return {"master_server_address": address, "global_segment_size": 0,
            "rpc_timeout_s": 2.0, "transfer_timeout_s": 5.0, **extra}


def slot_value(token: int, position: int, layer: int) -> float:
    """What "computing" ``token`` at ``position`` writes into layer ``layer``'s KV (exact
    in float32, distinct per layer, so a layer's bytes in another layer show)."""
    return float((token * 4096 + position + 1) * (layer + 1))


class MiniEngine:
    """A scheduler, a worker-side connector and a CPU KV cache of ``num_blocks`` blocks."""

    def __init__(self, model_dir: str, extra: dict[str, Any], *, num_blocks: int = 64,
                 batch_tokens: int = 64, role: str = "kv_both",
                 policy: str = "recompute", connector: str = CONNECTOR,
                 kv: dict[str, torch.Tensor] | None = None) -> None:
        load_general_plugins()
        self.config = VllmConfig(
            model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32"),
            scheduler_config=SchedulerConfig(
                max_num_seqs=8, max_num_batched_tokens=batch_tokens, max_model_len=1024,
                enable_chunked_prefill=True, is_encoder_decoder=False,
                disable_hybrid_kv_cache_manager=True),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector=connector, kv_role=role, kv_load_failure_policy=policy,
                kv_connector_extra_config=extra),
            device_config=DeviceConfig("cpu"))
        self.config.cache_config.num_gpu_blocks = num_blocks
        kv_config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0", "layer.1"], FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32))])
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=kv_config,
                                   log_stats=True,
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   block_size=BLOCK)
        self.connector = self.scheduler.connector
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER,
                                                          kv_config)
        # CPU attention layout: [num_blocks, kv_heads, block_size, 2 * head_size]; or the
        # caller's, e.g. CUDA flash attention's [2, num_blocks, block_size, kv_heads, head]
        self.kv = kv or {name: torch.zeros(num_blocks, 1, BLOCK, 2)
                         for name in ("layer.0", "layer.1")}
        self.worker.register_kv_caches(self.kv)
        self.metas: list[Any] = []
        self.outputs: list[ModelRunnerOutput] = []
        self.results: list[KVConnectorOutput] = []
        self.answers: dict[str, dict[str, Any] | None] = {}   # finished: kv_transfer_params

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 4,
            kv_transfer_params: dict[str, Any] | None = None) -> Request:
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        req = Request(request_id=req_id, prompt_token_ids=list(prompt),
                      sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                     extra_args=extra),
                      pooling_params=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.scheduler.add_request(req)
        return req

    def step(self) -> Any:
        """One engine step, with the worker hooks in the model runner's order."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        self.metas.append(meta)
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        self._compute(out)
        w.wait_for_save()
        results = w.get_transfer_results(out.finished_req_ids)
        kv_out = KVConnectorOutput(finished_sending=results.finished_sending,
                                   finished_recving=results.finished_recving,
                                   failed_recving=results.failed_recving,
                                   invalid_block_ids=w.get_block_ids_with_load_errors(),
                                   kv_connector_stats=w.get_kv_connector_stats())
        w.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]   # schedule() advanced num_computed_tokens
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        result = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, kv_connector_output=kv_out)
        self.results.append(kv_out)
        self.outputs.append(result)
        for core_out in self.scheduler.update_from_output(out, result).values():
            for o in core_out.outputs:
                if o.finish_reason is not None:
                    self.answers[o.request_id] = o.kv_transfer_params
        return out

    def stat(self, name: str) -> float:
        """A connector counter summed over every step so far."""
        return sum(r.kv_connector_stats.data.get(name, 0) for r in self.results
                   if r.kv_connector_stats is not None)

    def _compute(self, out: Any) -> None:
        """Write the scheduled tokens' KV values layer by layer, each layer after waiting
        for its loads (as a forward pass's attention layers do)."""
        for layer, (name, t) in enumerate(self.kv.items()):
            self.worker.wait_for_layer_load(name)
            for rid, n in out.num_scheduled_tokens.items():
                req = self.scheduler.requests[rid]
                ids = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
                tokens = req.all_token_ids
                end = req.num_computed_tokens   # schedule() already counted this step's tokens
                for p in range(end - n, end):
                    k, v = self.slots(t, ids[p // BLOCK])
                    k[p % BLOCK] = v[p % BLOCK] = slot_value(tokens[p], p, layer)

    @staticmethod
    def slots(t: torch.Tensor, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's K and V values of one layer, one per slot, in either layout."""
        if t.dim() == 5:    # flash attention: [2, num_blocks, block_size, 1, 1]
            return t[0, block_id, :, 0, 0], t[1, block_id, :, 0, 0]
        return t[block_id, 0, :, 0], t[block_id, 0, :, 1]

    def run(self, timeout_s: float = 30.0) -> None:
        """Step until no request is left (finished requests' blocks freed too); a step
        with nothing to schedule waits a little, as saves finish in the background."""
        deadline = time.monotonic() + timeout_s
        while self.scheduler.requests:
            if time.monotonic() > deadline:
                raise AssertionError(f"requests still open after {timeout_s} s: "
                                     f"{list(self.scheduler.requests)}")
            if not self.step().num_scheduled_tokens:
                time.sleep(0.005)

    def block_ok(self, block_id: int, tokens: list[int], first_pos: int,
                 layers: list[str] | None = None) -> bool:
        """Whether the block holds the values computing ``tokens`` at ``first_pos`` gives
        (in ``layers``, default all)."""
        def holds(layer: int, t: torch.Tensor) -> bool:
            want = torch.tensor([slot_value(tok, first_pos + i, layer)
                                 for i, tok in enumerate(tokens)])
            k, v = self.slots(t, block_id)
            return torch.equal(k, want) and torch.equal(v, want)

        return all(holds(layer, t) for layer, (name, t) in enumerate(self.kv.items())
                   if layers is None or name in layers)

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()
