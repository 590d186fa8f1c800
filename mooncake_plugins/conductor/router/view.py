"""A live :class:`~..policies.ClusterView` over the router's instances, taken per request."""

from __future__ import annotations

import math
from typing import Sequence

from ..policies import DecodeForecast, PrefixHit
from .instances import Instance, Pool


class LiveView:
    """The cluster as a policy sees it at one request: the usable prefill and decode
    instances (index ``i`` of the decision is ``prefill[i]`` / ``decode[i]``), their
    queues, caches and decode batches as the router knows them.

    ``pool_prefix`` is what the store holds of this request's prompt (``pool_blocks``,
    asked of the master by :class:`~.store_view.StoreView` before the view is taken;
    0 without a store or a prompt of token ids).

    With ``correct``, ``expected_ttft_s`` scales the model's estimate by what was
    measured on the instance (:meth:`~.instances.Instance.ttft_ratio`), its queue
    drains at the measured speed and its decodes step at the measured pace.
    """

    def __init__(self, pool: Pool, block_tokens: int, decode_max_batch: int,
                 step_s: float = 0.0, pool_blocks: int = 0, correct: bool = True) -> None:
        self.prefill: list[Instance] = pool.prefill_side()
        self.decode: list[Instance] = pool.decode_side()
        self._colocated = not pool.disaggregated()
        self._step_s = step_s
        self._pool_blocks = pool_blocks
        self._block_tokens = block_tokens
        self._max_batch = decode_max_batch
        self._now = pool.now()
        self._correct = correct
        self._ratios = [i.ttft_ratio(self._now) if correct else 1.0 for i in self.prefill]

    @property
    def now_s(self) -> float:
        return self._now

    @property
    def num_prefill(self) -> int:
        return len(self.prefill)

    @property
    def num_decode(self) -> int:
        return len(self.decode)

    @property
    def decode_max_batch(self) -> int:
        return self._max_batch

    @property
    def colocated(self) -> bool:
        return self._colocated

    @property
    def block_tokens(self) -> int:
        return self._block_tokens

    def prefill_queue_s(self, instance: int) -> float:
        inst = self.prefill[instance]
        ratio = self._ratios[instance]
        queue = inst.queue_s(self._now, ratio)
        if self._colocated:   # a prefill also waits for a free slot
            # the queue is in the model's time (the policy's estimate is scaled by the
            # ratio); the slot wait is predicted in seconds: taken back to model time
            queue = max(queue, inst.slot_wait_s(self._now, self._max_batch,
                                                self._decode_step_s(inst), ratio) / ratio)
        return queue

    def _decode_step_s(self, inst: Instance) -> float:
        """A full batch's decode step on ``inst`` (the model's, at the measured pace)."""
        return self._step_s * (inst.tbt.ratio if self._correct else 1.0)

    def cached_prefix(self, instance: int, hash_ids: Sequence[int]) -> PrefixHit:
        blocks, ready = self.prefill[instance].prefix(hash_ids)
        return PrefixHit(blocks, ready)

    def pool_prefix(self, hash_ids: Sequence[int]) -> PrefixHit:
        return PrefixHit(self._pool_blocks, self._now)

    def decode_forecast(self, instance: int, at_s: float) -> DecodeForecast:
        """Requests decoding on ``instance`` at ``at_s``: those decoding now and not
        predicted to have ended by then, those prefilling here (they decode here next),
        P/D requests prefilling elsewhere predicted to have reached it by then and not
        ended, and the external requests the engine last reported (those running until
        :meth:`~.instances.Instance.external_end_s`, those waiting until they prefilled
        one after the other from the reading and decoded its mean output)."""
        inst = self.decode[instance]
        requests, context = 0, 0
        for rid, tokens in inst.decoding.items():
            if inst.decode_ends.get(rid, math.inf) > at_s:
                requests, context = requests + 1, context + tokens
        for f in inst.flights.values():
            if not f.first_token:
                requests, context = requests + 1, context + f.context_tokens
        for first_s, last_s, tokens in inst.joining.values():
            if first_s <= at_s < last_s:
                requests, context = requests + 1, context + tokens
        step_s = self._decode_step_s(inst)
        # those waiting at the reading prefill one after the other from it, then decode
        decoded_s = inst.external_seen_s + inst.external_output * step_s
        external = sum(at_s < decoded_s + k * inst.external_prefill_s
                       for k in range(1, inst.external_waiting + 1))
        if at_s < inst.external_end_s(step_s):
            external += inst.external_running
        requests, context = requests + external, context + external * inst.external_context
        return DecodeForecast(requests, float(context))

    def expected_ttft_s(self, instance: int, model_ttft_s: float) -> float:
        return model_ttft_s * self._ratios[instance]

    def ttft_ratio(self, instance: int) -> float:
        """Measured / model time to first token that prefill ``instance`` is priced at."""
        return self._ratios[instance]
