"""A live :class:`~..policies.ClusterView` over the router's instances, taken per request."""

from __future__ import annotations

from typing import Sequence

from ..policies import DecodeForecast, PrefixHit
from .instances import Instance, Pool


class LiveView:
    """The cluster as a policy sees it at one request: the usable prefill and decode
    instances (index ``i`` of the decision is ``prefill[i]`` / ``decode[i]``), their
    queues, caches and decode batches as the router knows them.

    The global pool (the store) is not consulted yet: ``pool_prefix`` reports no blocks,
    so policies price only what the instances hold.
    """

    def __init__(self, pool: Pool, block_tokens: int, decode_max_batch: int) -> None:
        self.prefill: list[Instance] = pool.prefill_side()
        self.decode: list[Instance] = pool.decode_side()
        self._colocated = not pool.disaggregated()
        self._block_tokens = block_tokens
        self._max_batch = decode_max_batch
        self._now = pool.now()

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
        return self.prefill[instance].queue_s(self._now)

    def cached_prefix(self, instance: int, hash_ids: Sequence[int]) -> PrefixHit:
        blocks, ready = self.prefill[instance].prefix(hash_ids)
        return PrefixHit(blocks, ready)

    def pool_prefix(self, hash_ids: Sequence[int]) -> PrefixHit:
        return PrefixHit(0, self._now)

    def decode_forecast(self, instance: int, at_s: float) -> DecodeForecast:
        inst = self.decode[instance]
        pending = [f for f in inst.flights.values() if not f.first_token]
        return DecodeForecast(len(inst.decoding) + len(pending),
                              float(sum(inst.decoding.values())
                                    + sum(f.context_tokens for f in pending)))
