"""Analytic costs of prefill, decode steps and KV transfers, used by policies and the simulator.

The defaults are a rough fit for the Mooncake paper's setting, a dense 70B-class model
(LLaMA2-70B shape: 80 layers, d_model 8192, GQA with 8 KV heads of 128 dims, bf16)
served by one instance of 8 A800-80GB GPUs, derived from hardware figures rather than
measured here:

- KV cache per token: 2 (K and V) x 80 layers x 8 heads x 128 dims x 2 bytes = 327,680 B
  (320 KiB). The Mooncake README quotes 40 GB for 128k tokens of LLaMA3-70B (about
  312 KB/token), which agrees.
- Prefill, linear part: about 2 x 70e9 FLOP per token (weights). 8 x 312 TFLOPS of dense
  bf16 at an assumed 40 % utilisation is about 1.0 PFLOP/s, hence 1.4e-4 s per token.
- Prefill, quadratic part: causal attention costs 4 x 80 x 8192 FLOP per (query, key)
  pair and has n^2 / 2 pairs, about 1.31e6 x n^2 FLOP, hence 1.3e-9 s per token^2.
- Decode step: memory bound. Each step reads the 140 GB of weights over 8 x 2.0 TB/s of
  HBM at an assumed 60 % efficiency (9.6 TB/s), about 15 ms, and 327,680 B of KV per
  token in the batch's context (3.4e-8 s per token). Each request in the batch also adds
  its 1.4e-4 s of compute; this part is added rather than overlapped, which is pessimistic.
- KV transfer: 87 GB/s, what the Mooncake README reports for the Transfer Engine on
  4 x 200 Gbps RoCE, plus 1 ms of setup per transfer (our guess). A P/D request's KV
  streams to its decode instance layer by layer while the prefill computes, as in
  Mooncake, so its first token comes at the prefill's end. Behind vLLM's P/D protocol
  (the prefill answers, then the decode request carries its handle and pulls the KV) it
  follows the prefill instead, and the client's first token comes from the decode a
  handoff later (the decode leg's own request, ``handoff_latency_s``, and the bytes at
  ``handoff_bytes_per_s``): ``kv_streamed_during_prefill=False``, what
  ``mooncake-conductor calibrate`` measures and sets for a prefill/decode pair. Loads
  from the pool (``transfer_latency_s``, ``transfer_bytes_per_s``) it measures with
  ``--store``: an engine loading a prompt another engine saved.

The fixed costs (20 ms per prefill, 1 ms per transfer) are guesses for scheduling and
launch overhead. Every figure is a field of :class:`CostModel`, so a calibrated model can
be passed instead; :mod:`mooncake_plugins.cli.conductor` exposes none of them as flags on
purpose (write a small script for what-if studies).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class CostModel:
    """Time costs of one serving instance; see the module docstring for where each comes from.

    Attributes:
        prefill_fixed_s: overhead of one prefill (launch, scheduling).
        prefill_s_per_token: linear prefill cost per computed token.
        prefill_s_per_token_sq: quadratic (attention) prefill cost per computed token^2.
        decode_fixed_s: cost of one decode step for an empty batch (reading the weights).
        decode_s_per_request: added step cost per request in the batch.
        decode_s_per_context_token: added step cost per token of KV the batch attends to.
        kv_bytes_per_token: size of one token's KV cache across all layers.
        transfer_bytes_per_s: bandwidth of a KV load from the pool or a peer instance
            (and of a P/D request's KV streamed during its prefill, which costs no time).
        transfer_latency_s: setup cost of one such load.
        kv_streamed_during_prefill: a P/D request's KV moves while its prefill computes
            (first token at the prefill's end), not after it (first token a handoff
            later, from the decode).
        handoff_latency_s: without streaming during prefill, the fixed cost of the
            decode leg that pulls the KV (its request, scheduling, the recomputed last
            token).
        handoff_bytes_per_s: without streaming during prefill, the rate of that pull
            (a P/D connector's, which need not be the pool's).
    """

    prefill_fixed_s: float = 0.020
    prefill_s_per_token: float = 1.4e-4
    prefill_s_per_token_sq: float = 1.3e-9
    decode_fixed_s: float = 0.015
    decode_s_per_request: float = 1.4e-4
    decode_s_per_context_token: float = 3.4e-8
    kv_bytes_per_token: int = 327_680
    transfer_bytes_per_s: float = 87e9
    transfer_latency_s: float = 0.001
    kv_streamed_during_prefill: bool = True
    handoff_latency_s: float = 0.0
    handoff_bytes_per_s: float = 87e9

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < 0:
                raise InvalidArgument(f"CostModel.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("transfer_bytes_per_s", "handoff_bytes_per_s"):
            if getattr(self, name) == 0:
                raise InvalidArgument(f"CostModel.{name} must be > 0")

    def prefill_s(self, input_tokens: int, cached_tokens: int = 0) -> float:
        """Time to prefill a prompt whose first ``cached_tokens`` have KV already.

        Only the uncached suffix is computed, so the cost depends on
        ``input_tokens - cached_tokens`` alone (attention of the suffix to the cached
        prefix is not charged: a simplification that favours cache hits a little).

        Args:
            input_tokens: prompt length.
            cached_tokens: length of the reused prefix, ``0 <= cached_tokens <= input_tokens``.

        Returns:
            Seconds of prefill compute on one instance.

        Raises:
            InvalidArgument: ``cached_tokens`` is out of range.
        """
        new_tokens = input_tokens - cached_tokens
        if cached_tokens < 0 or new_tokens < 0:
            raise InvalidArgument(f"cached_tokens must be in [0, {input_tokens}], "
                                  f"got {cached_tokens}")
        return (self.prefill_fixed_s + self.prefill_s_per_token * new_tokens
                + self.prefill_s_per_token_sq * new_tokens * new_tokens)

    def decode_step_s(self, batch_requests: int, context_tokens: float) -> float:
        """Time of one decode iteration that emits one token for each request in the batch.

        Args:
            batch_requests: requests in the batch.
            context_tokens: total KV tokens the batch attends to (sum of context lengths).

        Returns:
            Seconds per step.
        """
        return (self.decode_fixed_s + self.decode_s_per_request * batch_requests
                + self.decode_s_per_context_token * context_tokens)

    def kv_nbytes(self, tokens: int) -> int:
        """Size in bytes of the KV cache of ``tokens`` tokens."""
        return tokens * self.kv_bytes_per_token

    def kv_transfer_s(self, tokens: int) -> float:
        """Time to move the KV cache of ``tokens`` tokens between instances (0 for none).

        Args:
            tokens: tokens whose KV is moved.

        Returns:
            Seconds, setup latency included.
        """
        if tokens <= 0:
            return 0.0
        return self.transfer_latency_s + self.kv_nbytes(tokens) / self.transfer_bytes_per_s

    def handoff_s(self, tokens: int) -> float:
        """Time from a P/D request's prefill end to its first token, ``tokens`` of KV
        moved to the decode: the decode leg when the KV follows the prefill, else 0."""
        if self.kv_streamed_during_prefill:
            return 0.0
        return self.handoff_latency_s + self.kv_nbytes(tokens) / self.handoff_bytes_per_s
