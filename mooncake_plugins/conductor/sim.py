"""Discrete-event replay of a request trace on a disaggregated prefill/decode cluster.

Model (one replay, single-threaded, deterministic for a given policy seed):

- ``num_prefill`` prefill instances, each a FIFO queue that runs one prefill at a time
  (cost: :meth:`CostModel.prefill_s` of the prompt part not reused). Because the queue
  is FIFO and costs are known, a prefill's start and end are fixed when it is scheduled.
- Each prefill instance keeps a KV cache of ``cache_tokens`` tokens, LRU over
  ``block_tokens``-token blocks keyed by the trace's ``hash_ids``. A request reuses the
  longest prefix of its blocks found there. Its blocks enter the cache (and refresh) when
  it is scheduled, marked ready at the end of its prefill; FIFO order makes them usable
  by every later request on the same instance.
- An optional global pool (the Mooncake Store, ``pool_tokens``, LRU too) receives every
  prefilled block; writing it back is asynchronous and not charged, and a block is in
  the pool from its prefill's end (as a live store shows only saved blocks: a request
  arriving while its prefix is still being computed elsewhere does not find it there).
  A prefix pulled from the pool or from a peer instance costs
  :meth:`CostModel.kv_transfer_s`; a peer's pull starts when the peer has computed the
  blocks; either overlaps the wait in the destination's queue.
- The prompt's KV streams to the chosen decode instance layer by layer while prefill
  runs, as in Mooncake, so it lands at ``max(prefill end, prefill start + transfer)``.
  Prefill emits the first token. With ``CostModel.kv_streamed_during_prefill`` False
  (vLLM's P/D protocol) the KV moves after the prefill's end (:meth:`CostModel.handoff_s`),
  and the first token comes from the decode when it lands. Decode runs continuous batching with at most
  ``decode_max_batch`` requests; extra requests wait for a slot. Step time
  (:meth:`CostModel.decode_step_s`) is recomputed whenever the batch changes and held
  constant in between.
- ``colocated=True`` models ordinary engines that prefill and decode (vLLM without
  P/D roles): instance ``i`` decodes what it prefilled (``num_decode`` is taken equal
  to ``num_prefill``), no KV moves to a decode instance, and its decode batch makes no
  progress while it prefills (vLLM runs a prefill and the batch's next tokens in the
  same steps, so a step lasts as long as its prefill; the one token each decode gets
  per prefill step is ignored). A request holds one of the instance's
  ``decode_max_batch`` slots (vLLM's ``--max-num-seqs``) from its prefill's start to
  its last token, so a prefill also waits for a free slot: the wait counts in TTFT,
  and a decode is paused only by the prefills admitted beside it. Requests scheduled
  earlier on an instance fix its timeline up to a new request's start (FIFO, and later
  prefills start later), so that start is found when the request is scheduled, by
  running the instance's batch forward.
- ``prefill_step_tokens`` (vLLM's ``--max-num-batched-tokens``; 0: off): the prompts
  waiting at an instance are prefilled together in steps of so many tokens
  (:mod:`.prefill_steps`). A prompt that joins a queue of prompts not yet started moves
  the first token, the decode join, the blocks' ready time (and, colocated, the slot
  release) of each prompt sharing its step later; the instance is no busier. Those
  JOIN events already pushed are superseded (``join_at``).
- Metrics: TTFT = first token - arrival. TBT = (finish - first token) / (output - 1),
  the mean gap after the first token (vLLM's TPOT), so a late KV transfer and waiting
  for a decode slot count against it. A request meets the SLO when it is served and both
  hold; rejected requests count as misses. Hit rate = reused prompt blocks / prompt
  blocks of served requests.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import InvalidArgument
from .costmodel import CostModel
from .policies import POOL, DecodeForecast, Policy, PrefixHit, Slo
from .prefill_steps import queue_at, step_delays
from .traces import BLOCK_TOKENS, TraceRequest

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int], None]
"""Called with the number of requests replayed since the previous call."""

_PROGRESS_EVERY = 1024
_JOIN, _FINISH = 0, 1


@dataclass(frozen=True)
class ClusterConfig:
    """Shape of the simulated cluster.

    Defaults: 8 prefill + 4 decode instances of 8 GPUs each (the trace at its own rate
    keeps them busy but not saturated under the default cost model), 1M cached tokens per
    prefill instance (about 320 GB of KV at 320 KiB/token: what 8 x 80 GB of HBM leaves
    after 140 GB of weights and working memory), no global pool, batches of up to 64.

    Attributes:
        num_prefill: prefill instances.
        num_decode: decode instances.
        cache_tokens: KV cache capacity of each prefill instance, in tokens.
        pool_tokens: capacity of the global pool in tokens; 0 disables it.
        decode_max_batch: most requests one decode instance runs per step.
        block_tokens: tokens per KV block.
        decode_tokens_prior: expected decode length used by the load forecast until the
            first request finishes (afterwards: the mean of finished requests).
        cost: the cost model.
        colocated: every instance prefills and decodes its own requests (ordinary
            engines, no P/D); ``num_decode`` is then ``num_prefill``.
        shared_slowdown: how much longer a prefill takes while every other prefill
            instance prefills too (instances sharing one host's cores, as in a test bed:
            time one engine alone and all side by side); scaled by the share of the
            others busy when it starts. 1.0: instances have their own hardware.
        prefill_step_tokens: the engines' ``--max-num-batched-tokens``: prompts waiting
            at an instance are prefilled together in steps of so many tokens, and a
            prompt's first token comes at the end of the step holding its last token
            (:mod:`.prefill_steps`); 0: one prompt after the other.
    """

    num_prefill: int = 8
    num_decode: int = 4
    cache_tokens: int = 1_000_000
    pool_tokens: int = 0
    decode_max_batch: int = 64
    block_tokens: int = BLOCK_TOKENS
    decode_tokens_prior: int = 256
    cost: CostModel = field(default_factory=CostModel)
    colocated: bool = False
    shared_slowdown: float = 1.0
    prefill_step_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.shared_slowdown >= 1.0:
            raise InvalidArgument(f"ClusterConfig.shared_slowdown must be >= 1, "
                                  f"got {self.shared_slowdown}")
        if self.colocated:
            object.__setattr__(self, "num_decode", self.num_prefill)
        for name in ("num_prefill", "num_decode", "decode_max_batch", "block_tokens"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"ClusterConfig.{name} must be >= 1, "
                                      f"got {getattr(self, name)}")
        for name in ("cache_tokens", "pool_tokens", "decode_tokens_prior",
                     "prefill_step_tokens"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"ClusterConfig.{name} must be >= 0, "
                                      f"got {getattr(self, name)}")


@dataclass(frozen=True)
class Percentiles:
    """p50/p90/p99 of a latency in seconds (NaN when there was no sample)."""

    p50: float
    p90: float
    p99: float


@dataclass(frozen=True)
class RequestOutcome:
    """What happened to one request (kept when ``simulate(keep_outcomes=True)``).

    Attributes:
        index: position in the trace.
        arrival_s: arrival time after rate scaling.
        prefill: prefill instance, -1 when rejected.
        decode: decode instance, -1 when rejected or when there is nothing to decode.
        local_blocks: prefix blocks found in the prefill instance's own cache.
        reused_blocks: prefix blocks not recomputed (local plus pulled).
        pull_from: source of the pulled blocks (instance index, ``"pool"``) or None.
        ttft_s: time to first token (NaN when rejected).
        tbt_s: mean time between tokens (NaN when rejected or output <= 1).
        reject_reason: the policy's reason, or None when served.
    """

    index: int
    arrival_s: float
    prefill: int
    decode: int
    local_blocks: int
    reused_blocks: int
    pull_from: int | str | None
    ttft_s: float
    tbt_s: float
    reject_reason: str | None


@dataclass
class SimResult:
    """Summary of one replay.

    Attributes:
        policy: policy name.
        rate_scale: arrival-rate multiplier (timestamps were divided by it).
        requests: requests in the trace.
        served: requests that were prefilled (and decoded).
        rejected: requests the policy refused.
        hit_rate: reused prompt blocks / prompt blocks, over served requests.
        local_hit_rate: the part of ``hit_rate`` found in the instance's own cache.
        pulled_blocks: blocks moved from peers or the pool.
        evicted_blocks: blocks evicted from prefill caches.
        ttft: TTFT percentiles over served requests.
        tbt: TBT percentiles over served requests with output > 1.
        ttft_attainment: fraction of all requests served within the TTFT SLO.
        tbt_attainment: fraction of all requests served within the TBT SLO.
        slo_attainment: fraction of all requests served within both.
        makespan_s: simulated time from the first arrival to the last finish.
        wall_s: wall-clock time of the replay.
        outcomes: per-request records when asked for, else None.
    """

    policy: str
    rate_scale: float
    requests: int
    served: int
    rejected: int
    hit_rate: float
    local_hit_rate: float
    pulled_blocks: int
    evicted_blocks: int
    ttft: Percentiles
    tbt: Percentiles
    ttft_attainment: float
    tbt_attainment: float
    slo_attainment: float
    makespan_s: float
    wall_s: float
    outcomes: list[RequestOutcome] | None = None


@dataclass
class CapacityResult:
    """Effective request capacity: the highest load meeting an SLO attainment target.

    Attributes:
        policy: policy name.
        target: required SLO attainment.
        rate_scale: highest rate scale found that meets ``target`` (0.0 when even the
            lowest scale tried misses it).
        requests_per_s: the trace's mean arrival rate times ``rate_scale``.
        probes: ``(rate_scale, slo_attainment)`` of every replay, in the order run.
    """

    policy: str
    target: float
    rate_scale: float
    requests_per_s: float
    probes: list[tuple[float, float]]


class LruBlockCache:
    """A KV cache of whole blocks with least-recently-used eviction.

    Values are the times the blocks' KV is (or will be) computed. Not thread-safe: one
    replay owns it.

    Args:
        capacity_blocks: most blocks held; 0 makes a cache that holds nothing.
    """

    __slots__ = ("capacity_blocks", "evictions", "_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise InvalidArgument(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.evictions = 0
        self._blocks: OrderedDict[int, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def blocks(self) -> list[int]:
        """Cached block ids from least to most recently used."""
        return list(self._blocks)

    def prefix(self, hash_ids: Sequence[int], ready_by: float = math.inf) -> tuple[int, float]:
        """Longest cached prefix of ``hash_ids``; does not count as a use.

        Args:
            hash_ids: the prompt's block ids.
            ready_by: count only blocks computed by then.

        Returns:
            ``(blocks, ready_s)``: the prefix length and when its last block is computed.
        """
        get = self._blocks.get
        blocks, ready_s = 0, 0.0
        for block in hash_ids:
            at = get(block)
            if at is None or at > ready_by:
                break
            if at > ready_s:
                ready_s = at
            blocks += 1
        return blocks, ready_s

    def touch(self, hash_ids: Sequence[int]) -> None:
        """Mark the cached ones of ``hash_ids`` as just used."""
        blocks = self._blocks
        for block in hash_ids:
            if block in blocks:
                blocks.move_to_end(block)

    def delay(self, hash_ids: Sequence[int], ready_s: float, later_s: float) -> None:
        """The blocks of ``hash_ids`` added to be computed at ``ready_s`` are computed at
        ``later_s`` instead; does not count as a use."""
        blocks = self._blocks
        for block in hash_ids:
            if blocks.get(block) == ready_s:
                blocks[block] = later_s

    def insert(self, hash_ids: Sequence[int], ready_s: float) -> None:
        """Use ``hash_ids``: refresh the cached ones, add the rest, then evict down to capacity.

        Args:
            hash_ids: block ids in prompt order.
            ready_s: when the added blocks' KV is computed.
        """
        blocks = self._blocks
        for block in hash_ids:
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = ready_s
        excess = len(blocks) - self.capacity_blocks
        if excess > 0:
            self.evictions += excess
            for _ in range(excess):
                blocks.popitem(last=False)


class _Queued:
    """A prompt scheduled on a prefill instance that has not started to prefill."""

    __slots__ = ("index", "start_s", "end_s", "tokens", "prefill_s", "counted", "at")

    def __init__(self, index: int, start_s: float, end_s: float, tokens: int,
                 prefill_s: float) -> None:
        self.index, self.start_s, self.end_s = index, start_s, end_s
        self.tokens, self.prefill_s, self.counted = tokens, prefill_s, 0
        self.at = 0   # prompt tokens queued before it since its queue's first prompt


class _DecodeInstance:
    """Continuous batching on one decode instance, tracked with a virtual step clock.

    ``v`` counts the steps done since the start; it advances at ``1 / step_s`` per second
    while the batch is non-empty. A request that joins at ``v0`` with ``n`` tokens to
    decode finishes when ``v`` reaches ``v0 + n``, so the batch is a heap on that target.
    """

    __slots__ = ("running", "join_vs", "waiting", "v", "t", "step_s", "version",
                 "sum_input", "sum_join_v", "incoming", "pending_input")

    def __init__(self) -> None:
        self.running: list[tuple[float, int, float]] = []  # (target v, request, join v)
        self.join_vs: list[float] = []  # join v of running requests, sorted
        self.waiting: deque[int] = deque()
        self.v = 0.0
        self.t = 0.0
        self.step_s = 1.0
        self.version = 0
        self.sum_input = 0
        self.sum_join_v = 0.0
        self.incoming = 0
        self.pending_input = 0  # prompt tokens of waiting and incoming requests


class _Replay:
    """One replay; implements :class:`~.policies.ClusterView` for the policy."""

    def __init__(self, requests: Sequence[TraceRequest], policy: Policy,
                 cluster: ClusterConfig, slo: Slo, rate_scale: float) -> None:
        self.requests = requests
        self.policy = policy
        self.cluster = cluster
        self.slo = slo
        self.rate_scale = rate_scale
        self.cost = cluster.cost
        bt = cluster.block_tokens
        self.caches = [LruBlockCache(cluster.cache_tokens // bt)
                       for _ in range(cluster.num_prefill)]
        self.pool = LruBlockCache(cluster.pool_tokens // bt) if cluster.pool_tokens else None
        self.busy_until = [0.0] * cluster.num_prefill
        self.decodes = [_DecodeInstance() for _ in range(cluster.num_decode)]
        # colocated: each instance's prefills, (start, end), in order; its decode pauses
        self.prefills: list[deque[tuple[float, float]]] = [
            deque() for _ in range(cluster.num_prefill if cluster.colocated else 0)]
        # colocated: requests holding a slot but not yet decoding, (prefill end, index)
        self.holding: list[deque[tuple[float, int]]] = [deque() for _ in self.prefills]
        # prefill steps: each instance's prompts not started, back to back, in order
        self.queued: list[deque[_Queued]] = [
            deque() for _ in range(cluster.num_prefill if cluster.prefill_step_tokens else 0)]
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        n = len(requests)
        self.ttft = [math.nan] * n
        self.first_token = [0.0] * n
        self.join_at = [math.nan] * n   # a request's JOIN event in effect (steps move it)
        self.finish = [math.nan] * n
        self.decisions: list[tuple[int, int, int, int, int | str | None, str | None]] = []
        self.done_decode_tokens = 0
        self.done_requests = 0

    # ---- ClusterView ------------------------------------------------------------------

    @property
    def now_s(self) -> float:
        return self.now

    @property
    def num_prefill(self) -> int:
        return self.cluster.num_prefill

    @property
    def num_decode(self) -> int:
        return self.cluster.num_decode

    @property
    def decode_max_batch(self) -> int:
        return self.cluster.decode_max_batch

    @property
    def colocated(self) -> bool:
        return self.cluster.colocated

    @property
    def block_tokens(self) -> int:
        return self.cluster.block_tokens

    def prefill_queue_s(self, instance: int) -> float:
        start_s = max(self.now, self.busy_until[instance])
        if self.prefills:
            start_s = self._slot_free_s(instance, start_s)
        return start_s - self.now

    def cached_prefix(self, instance: int, hash_ids: Sequence[int]) -> PrefixHit:
        return PrefixHit(*self.caches[instance].prefix(hash_ids))

    def pool_prefix(self, hash_ids: Sequence[int]) -> PrefixHit:
        if self.pool is None:
            return PrefixHit(0, 0.0)
        return PrefixHit(*self.pool.prefix(hash_ids, self.now))

    def decode_forecast(self, instance: int, at_s: float) -> DecodeForecast:
        """Requests still decoding at ``at_s``, assuming each decodes the observed mean length."""
        d = self.decodes[instance]
        n = len(d.running)
        queued = len(d.waiting) + d.incoming
        if n == 0:
            return DecodeForecast(queued, float(d.pending_input))
        if self.done_requests:
            expected = self.done_decode_tokens / self.done_requests
        else:
            expected = float(self.cluster.decode_tokens_prior)
        v_now = d.v + self._stepping_s(instance, d.t, self.now) / d.step_s
        v_at = v_now + self._stepping_s(instance, self.now, at_s) / d.step_s
        remaining = n - bisect.bisect_right(d.join_vs, v_at - expected)
        context_avg = (d.sum_input + n * v_now - d.sum_join_v) / n
        return DecodeForecast(remaining + queued, remaining * context_avg + d.pending_input)

    # ---- event loop -------------------------------------------------------------------

    def expected_ttft_s(self, instance: int, model_ttft_s: float) -> float:
        return model_ttft_s   # the replay's costs are the model's

    def run(self, progress: ProgressFn | None) -> None:
        events = self.events
        scale = 0.001 / self.rate_scale
        pending = 0
        for index, request in enumerate(self.requests):
            arrival_s = request.timestamp_ms * scale
            while events and events[0][0] <= arrival_s:
                self._handle(heapq.heappop(events))
            self.now = arrival_s
            self._schedule(index, request)
            pending += 1
            if progress is not None and pending == _PROGRESS_EVERY:
                progress(pending)
                pending = 0
        while events:
            self._handle(heapq.heappop(events))
        if progress is not None and pending:
            progress(pending)

    def _push(self, time_s: float, kind: int, a: int, b: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time_s, self.seq, kind, a, b))

    def _schedule(self, index: int, request: TraceRequest) -> None:
        decision = self.policy.choose(request, self)
        cluster = self.cluster
        if decision.rejected:
            self.decisions.append((-1, -1, 0, 0, None, decision.reject_reason))
            return
        instance, decode = decision.prefill, decision.decode
        if cluster.colocated:
            decode = instance
        if not 0 <= instance < cluster.num_prefill or not 0 <= decode < cluster.num_decode:
            raise InvalidArgument(f"policy {self.policy.name} chose prefill {instance} / "
                                  f"decode {decode}, outside the cluster")
        now, bt, cost = self.now, cluster.block_tokens, self.cost
        length, ids = request.input_length, request.hash_ids
        cache = self.caches[instance]
        local, ready_s = cache.prefix(ids)
        after_s = self.busy_until[instance]
        start_s = max(now, after_s, ready_s)
        if cluster.colocated:
            start_s = self._slot_free_s(instance, start_s)
        reused = local
        source = decision.pull_from
        if source is not None:
            src = self._source(source, instance)
            # the pool holds a block once it is saved, at its prefill's end
            blocks, src_ready_s = src.prefix(ids, now if source == POOL else math.inf)
            if blocks > local:
                moved = min(blocks * bt, length) - min(local * bt, length)
                start_s = max(start_s, max(now, src_ready_s) + cost.kv_transfer_s(moved))
                reused = blocks
                src.touch(ids[:blocks])
        prefill_s = cost.prefill_s(length, min(reused * bt, length))
        if cluster.shared_slowdown != 1.0 and cluster.num_prefill > 1:
            busy = sum(until > start_s for until in self.busy_until) - \
                (self.busy_until[instance] > start_s)
            prefill_s *= 1.0 + (cluster.shared_slowdown - 1.0) * busy / (cluster.num_prefill - 1)
        end_s = start_s + prefill_s
        self.busy_until[instance] = end_s
        if cluster.colocated:
            self._pause_decode(instance, start_s, end_s)
            self.holding[instance].append((end_s, index))
        cache.insert(ids, end_s)
        if self.pool is not None:
            self.pool.insert(ids, end_s)
        first_s, joins_s = self._first_and_join(start_s, end_s, length)
        self.ttft[index] = first_s - now
        self.first_token[index] = first_s
        if self.queued:
            self._batch_prefills(instance, _Queued(index, start_s, end_s,
                                                   length - min(reused * bt, length), prefill_s),
                                 start_s > after_s)
        if request.output_length <= 1:
            self.finish[index] = first_s
            self.decisions.append((instance, -1, local, reused, source, None))
            return
        self.decisions.append((instance, decode, local, reused, source, None))
        d = self.decodes[decode]
        d.incoming += 1
        d.pending_input += length
        self.join_at[index] = joins_s
        self._push(joins_s, _JOIN, decode, index)

    def _first_and_join(self, start_s: float, end_s: float, length: int
                        ) -> tuple[float, float]:
        """A prefill of ``length`` tokens over ``[start_s, end_s]``: when its first token
        comes and when it joins its decode batch."""
        cost = self.cost
        if self.cluster.colocated:
            return end_s, end_s
        if cost.kv_streamed_during_prefill:
            return end_s, max(end_s, start_s + cost.kv_transfer_s(length))
        first_s = end_s + cost.handoff_s(length)
        return first_s, first_s

    def _batch_prefills(self, instance: int, new: _Queued, after_gap: bool) -> None:
        """``new`` was scheduled on ``instance``: the prompts there that have not started
        and that it follows back to back (``after_gap``: it waits for a prefix or a slot
        after them, so it shares no step with them) are prefilled with it in steps of
        ``prefill_step_tokens``; those its tokens join in their last step get their first
        token (and their decode, and their blocks) later by the prefill time of those
        tokens."""
        queue = self.queued[instance]
        while queue and queue[0].start_s <= self.now:
            queue.popleft()   # started: its steps are under way
        if after_gap:
            queue.clear()
        if new.start_s <= self.now:
            return   # it starts now, so every prompt before it has started
        new.at = queue_at(queue)
        queue.append(new)
        for q, counted, delay in step_delays(queue, self.cluster.prefill_step_tokens):
            q.counted = counted
            self._delay_prefill(instance, q, delay)

    def _delay_prefill(self, instance: int, q: _Queued, delay: float) -> None:
        """Queued ``q``'s prefill on ``instance`` ends ``delay`` seconds later (its
        instance is no busier: its step is shared with later prompts)."""
        index, request = q.index, self.requests[q.index]
        ended_s, q.end_s = q.end_s, q.end_s + delay
        self.caches[instance].delay(request.hash_ids, ended_s, q.end_s)
        if self.pool is not None:
            self.pool.delay(request.hash_ids, ended_s, q.end_s)
        first_s, joins_s = self._first_and_join(q.start_s, q.end_s, request.input_length)
        self.ttft[index] += first_s - self.first_token[index]
        self.first_token[index] = first_s
        if self.holding:
            holding = self.holding[instance]
            for k in range(len(holding) - 1, -1, -1):
                if holding[k][1] == index:
                    holding[k] = (q.end_s, index)
                    break
        if request.output_length <= 1:
            self.finish[index] = first_s
        else:   # the JOIN pushed before no longer counts
            self.join_at[index] = joins_s
            self._push(joins_s, _JOIN, self.decisions[index][1], index)

    def _source(self, source: int | str, instance: int) -> LruBlockCache:
        if source == POOL:
            if self.pool is None:
                raise InvalidArgument(f"policy {self.policy.name} pulled from the pool, "
                                      f"but the cluster has none (pool_tokens=0)")
            return self.pool
        if not isinstance(source, int) or not 0 <= source < self.cluster.num_prefill \
                or source == instance:
            raise InvalidArgument(f"policy {self.policy.name} pulled from {source!r}; expected "
                                  f"'pool' or another prefill instance")
        return self.caches[source]

    def _handle(self, event: tuple[float, int, int, int, int]) -> None:
        time_s, _, kind, instance, arg = event
        d = self.decodes[instance]
        if kind == _FINISH and arg != d.version:
            return  # superseded by a later change of the batch
        if kind == _JOIN and time_s != self.join_at[arg]:
            return  # moved later: its prefill step was shared with later prompts
        if d.running:
            d.v += self._stepping_s(instance, d.t, time_s) / d.step_s
        d.t = time_s
        if self.prefills:
            done = self.prefills[instance]
            while done and done[0][1] <= time_s:
                done.popleft()
            holding = self.holding[instance]
            while holding and holding[0][0] <= time_s:
                holding.popleft()
        max_batch = self.cluster.decode_max_batch
        if kind == _JOIN:
            d.incoming -= 1
            if len(d.running) >= max_batch:
                d.waiting.append(arg)
                return
            self._join(d, arg)
        else:
            running, limit = d.running, d.v + 1e-6
            while running and running[0][0] <= limit:
                _, index, join_v = heapq.heappop(running)
                self.finish[index] = time_s
                del d.join_vs[bisect.bisect_left(d.join_vs, join_v)]
                d.sum_input -= self.requests[index].input_length
                d.sum_join_v -= join_v
                self.done_decode_tokens += self.requests[index].output_length - 1
                self.done_requests += 1
            while d.waiting and len(running) < max_batch:
                self._join(d, d.waiting.popleft())
        self._reschedule(instance, d)

    def _join(self, d: _DecodeInstance, index: int) -> None:
        request = self.requests[index]
        d.pending_input -= request.input_length
        heapq.heappush(d.running, (d.v + request.output_length - 1, index, d.v))
        d.join_vs.append(d.v)  # v never decreases, so the list stays sorted
        d.sum_input += request.input_length
        d.sum_join_v += d.v

    def _reschedule(self, instance: int, d: _DecodeInstance) -> None:
        d.version += 1
        n = len(d.running)
        if n:
            d.step_s = self.cost.decode_step_s(n, d.sum_input + n * d.v - d.sum_join_v)
            steps = d.running[0][0] - d.v
            self._push(self._after_stepping(instance, d.t, max(steps, 0.0) * d.step_s),
                       _FINISH, instance, d.version)

    # ---- colocated instances: a decode batch waits while its instance prefills ----------

    def _pause_decode(self, instance: int, start_s: float, end_s: float) -> None:
        """Record a prefill on colocated ``instance`` and move its batch's next finish."""
        d = self.decodes[instance]
        if d.running:
            d.v += self._stepping_s(instance, d.t, self.now) / d.step_s
        d.t = self.now
        self.prefills[instance].append((start_s, end_s))
        self._reschedule(instance, d)

    def _slot_free_s(self, instance: int, t_min: float) -> float:
        """First time from ``t_min`` on when colocated ``instance`` has a free slot: its
        batch (and the requests scheduled to join it) run forward until enough finish."""
        d = self.decodes[instance]
        holding = self.holding[instance]
        while holding and holding[0][0] <= self.now:
            holding.popleft()   # single-token requests, done (the others joined by now)
        limit = self.cluster.decode_max_batch
        need = len(d.running) + len(holding) - limit + 1
        if need <= 0:
            return t_min
        requests, cost = self.requests, self.cost
        v, t, n = d.v, d.t, len(d.running)
        sum_input, sum_join_v = d.sum_input, d.sum_join_v
        targets = [(target, index, join_v) for target, index, join_v in d.running]
        heapq.heapify(targets)
        joins = list(holding)
        j = 0
        while True:
            step_s = cost.decode_step_s(n, sum_input + n * v - sum_join_v) if n else 0.0
            finish_s = (self._after_stepping(instance, t, max(targets[0][0] - v, 0.0) * step_s)
                        if n else math.inf)
            if j < len(joins) and joins[j][0] <= finish_s:
                join_s, index = joins[j]
                j += 1
                if n:
                    v += self._stepping_s(instance, t, join_s) / step_s
                t = max(t, join_s)
                if requests[index].output_length <= 1:
                    need -= 1   # its slot frees with its prefill
                else:
                    heapq.heappush(targets, (v + requests[index].output_length - 1, index, v))
                    n += 1
                    sum_input += requests[index].input_length
                    sum_join_v += v
            elif n:
                v, t = targets[0][0], finish_s
                while targets and targets[0][0] <= v + 1e-9:
                    _, index, join_v = heapq.heappop(targets)
                    n -= 1
                    need -= 1
                    sum_input -= requests[index].input_length
                    sum_join_v -= join_v
            else:   # nothing left to free a slot: cannot happen while need > 0
                return max(t, t_min)
            if need <= 0:
                return max(t, t_min)

    def _stepping_s(self, instance: int, t0: float, t1: float) -> float:
        """Seconds of ``[t0, t1]`` decode ``instance`` steps (not paused by a prefill)."""
        span = t1 - t0
        if span <= 0.0:
            return 0.0
        if self.prefills:
            for a, b in self.prefills[instance]:
                if b <= t0:
                    continue
                if a >= t1:
                    break
                span -= min(b, t1) - max(a, t0)
        # never below 0: back-to-back prefills covering the span can round it to -3e-17,
        # and a batch's step count must not go back (its join list is kept sorted by it)
        return max(0.0, span)

    def _after_stepping(self, instance: int, t0: float, stepping_s: float) -> float:
        """When decode ``instance`` has stepped ``stepping_s`` seconds from ``t0``."""
        t = t0
        if self.prefills:
            for a, b in self.prefills[instance]:
                if b <= t:
                    continue
                if a > t:
                    if t + stepping_s <= a:
                        return t + stepping_s
                    stepping_s -= a - t
                t = b
        return t + stepping_s

    # ---- results ----------------------------------------------------------------------

    def result(self, wall_s: float, keep_outcomes: bool) -> SimResult:
        requests, slo = self.requests, self.slo
        n = len(requests)
        tbt = [math.nan] * n
        ttfts: list[float] = []
        tbts: list[float] = []
        ttft_ok = tbt_ok = both_ok = 0
        total_blocks = local = reused = 0
        for index, (request, decision) in enumerate(zip(requests, self.decisions)):
            if decision[0] < 0:
                continue
            total_blocks += len(request.hash_ids)
            local += decision[2]
            reused += decision[3]
            ttfts.append(self.ttft[index])
            ttft_met = self.ttft[index] <= slo.ttft_s
            tbt_met = True
            if request.output_length > 1:
                tbt[index] = ((self.finish[index] - self.first_token[index])
                              / (request.output_length - 1))
                tbts.append(tbt[index])
                tbt_met = tbt[index] <= slo.tbt_s
            ttft_ok += ttft_met
            tbt_ok += tbt_met
            both_ok += ttft_met and tbt_met
        first_s = requests[0].timestamp_ms * 0.001 / self.rate_scale
        last_s = max((t for t in self.finish if not math.isnan(t)), default=first_s)
        outcomes = None
        if keep_outcomes:
            outcomes = [
                RequestOutcome(i, r.timestamp_ms * 0.001 / self.rate_scale, d[0], d[1], d[2],
                               d[3], d[4], self.ttft[i], tbt[i], d[5])
                for i, (r, d) in enumerate(zip(requests, self.decisions))]
        return SimResult(
            policy=self.policy.name,
            rate_scale=self.rate_scale,
            requests=n,
            served=len(ttfts),
            rejected=n - len(ttfts),
            hit_rate=reused / total_blocks if total_blocks else 0.0,
            local_hit_rate=local / total_blocks if total_blocks else 0.0,
            pulled_blocks=reused - local,
            evicted_blocks=sum(c.evictions for c in self.caches),
            ttft=_percentiles(ttfts),
            tbt=_percentiles(tbts),
            ttft_attainment=ttft_ok / n,
            tbt_attainment=tbt_ok / n,
            slo_attainment=both_ok / n,
            makespan_s=last_s - first_s,
            wall_s=wall_s,
            outcomes=outcomes,
        )


def _percentiles(samples: list[float]) -> Percentiles:
    """p50/p90/p99 with linear interpolation between order statistics (numpy's default)."""
    if not samples:
        return Percentiles(math.nan, math.nan, math.nan)
    ordered = sorted(samples)
    last = len(ordered) - 1

    def at(q: float) -> float:
        position = last * q
        low = int(position)
        high = min(low + 1, last)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return Percentiles(at(0.50), at(0.90), at(0.99))


def simulate(requests: Sequence[TraceRequest], policy: Policy, cluster: ClusterConfig,
             slo: Slo, *, rate_scale: float = 1.0, progress: ProgressFn | None = None,
             keep_outcomes: bool = False) -> SimResult:
    """Replay ``requests`` through ``policy`` on ``cluster``; blocks until done.

    Args:
        requests: the trace, in arrival order.
        policy: the scheduling policy; it keeps its state (e.g. a random generator), so
            pass a fresh one for an independent replay.
        cluster: the cluster shape and cost model.
        slo: the objectives that attainment is measured against.
        rate_scale: arrival-rate multiplier; timestamps are divided by it.
        progress: called with the count of requests replayed since the last call.
        keep_outcomes: attach one :class:`RequestOutcome` per request to the result.

    Returns:
        The replay's summary.

    Raises:
        InvalidArgument: empty trace, ``rate_scale <= 0``, or an impossible decision.
    """
    if not requests:
        raise InvalidArgument("cannot replay an empty trace")
    if not rate_scale > 0:
        raise InvalidArgument(f"rate_scale must be > 0, got {rate_scale}")
    started = time.perf_counter()
    replay = _Replay(requests, policy, cluster, slo, rate_scale)
    replay.run(progress)
    result = replay.result(time.perf_counter() - started, keep_outcomes)
    logger.info("%s x%.3g: hit %.3f, ttft p50 %.2f s, slo %.3f, rejected %d, %.2f s wall",
                result.policy, rate_scale, result.hit_rate, result.ttft.p50,
                result.slo_attainment, result.rejected, result.wall_s)
    return result


def find_capacity(requests: Sequence[TraceRequest], policy_factory: Callable[[], Policy],
                  cluster: ClusterConfig, slo: Slo, *, target: float = 0.9,
                  min_scale: float = 1 / 16, max_scale: float = 16.0, iterations: int = 6,
                  progress: ProgressFn | None = None) -> CapacityResult:
    """Find the highest rate scale at which SLO attainment stays >= ``target``.

    Starts at scale 1, doubles or halves until the target is bracketed (within
    ``[min_scale, max_scale]``), then bisects geometrically ``iterations`` times.
    Attainment is assumed to fall as the rate grows.

    Args:
        requests: the trace.
        policy_factory: builds a fresh policy for each replay.
        cluster: the cluster shape and cost model.
        slo: the objectives.
        target: required SLO attainment in (0, 1].
        min_scale: lowest scale tried.
        max_scale: highest scale tried.
        iterations: bisection steps once bracketed.
        progress: passed on to every replay.

    Returns:
        The capacity and every probe.

    Raises:
        InvalidArgument: bad target or scale range.
    """
    if not 0 < target <= 1:
        raise InvalidArgument(f"target must be in (0, 1], got {target}")
    if not 0 < min_scale <= 1 <= max_scale:
        raise InvalidArgument(f"need 0 < min_scale <= 1 <= max_scale, got {min_scale}, "
                              f"{max_scale}")
    probes: list[tuple[float, float]] = []
    name = policy_factory().name

    def meets(scale: float) -> bool:
        result = simulate(requests, policy_factory(), cluster, slo, rate_scale=scale,
                          progress=progress)
        probes.append((scale, result.slo_attainment))
        return result.slo_attainment >= target

    good, bad = 0.0, math.inf
    if meets(1.0):
        good = 1.0
        while good < max_scale:
            scale = min(good * 2, max_scale)
            if not meets(scale):
                bad = scale
                break
            good = scale
    else:
        bad = 1.0
        while bad > min_scale:
            scale = max(bad / 2, min_scale)
            if meets(scale):
                good = scale
                break
            bad = scale
    if good > 0 and bad < math.inf:
        for _ in range(iterations):
            middle = math.sqrt(good * bad)
            if meets(middle):
                good = middle
            else:
                bad = middle
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) * 0.001
    base_rate = len(requests) / span_s if span_s > 0 else math.nan
    return CapacityResult(name, target, good, good * base_rate, probes)
