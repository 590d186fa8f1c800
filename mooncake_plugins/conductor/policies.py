"""Scheduling policies: where a request is prefilled and decoded, and whether it is served.

A policy is a plain object with one method, ``choose(request, view) -> Decision``. It reads
the cluster only through the :class:`ClusterView` protocol, so the simulator in
:mod:`.sim` and a real request proxy can drive the same policy object; ``choose`` has no
side effects on the view (the caller applies the decision) and does not block.

Policies:

``random``
    a uniformly random prefill instance.
``round_robin``
    the prefill instances in turn.
``load_balance``
    the prefill instance with the least queued work.
``cache_aware``
    the prefill instance holding the longest prefix of the prompt (ties: least queued work).
``conductor``
    Mooncake's KVCache-centric choice. For every prefill instance it estimates
    TTFT = queue time + prefill time of the part of the prompt not already cached there.
    Hot-block migration: when a longer prefix sits in another instance's cache or in the
    global pool, it also prices pulling it; the pull is chosen when the part of the transfer
    not hidden behind the queue is shorter than the recompute time it saves. The instance
    with the lowest estimate wins. Early rejection: the decode instance's batch is
    forecast for the moment the request would reach it; when the predicted TTFT or TBT
    breaks the SLO, the request is rejected before any work is spent on it.

Every policy reads from the global pool (the Mooncake Store) when it holds a longer prefix
than the chosen instance, as a store connector does; only ``conductor`` also pulls from
peer instances and rejects. Every policy sends the request to the decode instance with
the lightest forecast batch. Output lengths are never read: a proxy does not know them.
"""

from __future__ import annotations

import logging
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

from ..errors import InvalidArgument
from .costmodel import CostModel

logger = logging.getLogger(__name__)

POOL: Literal["pool"] = "pool"
"""``Decision.pull_from`` value for the global KV pool."""

PullSource = int | Literal["pool"]
"""Where a prefix is pulled from: a prefill instance index or :data:`POOL`."""


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """A cached prefix of a prompt somewhere in the cluster.

    Attributes:
        blocks: number of leading blocks of the prompt found there.
        ready_s: when the last of them is computed (it may still be in a queued prefill).
    """

    blocks: int
    ready_s: float


@dataclass(frozen=True, slots=True)
class DecodeForecast:
    """Predicted occupancy of a decode instance at some time, before adding a new request.

    Attributes:
        requests: requests predicted to be running, waiting for a slot, or on their way.
        context_tokens: total KV tokens those requests attend to.
    """

    requests: int
    context_tokens: float


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency objectives of one request.

    Attributes:
        ttft_s: time to first token, from arrival to the end of prefill.
        tbt_s: mean time between the following tokens, ``(e2e - ttft) / (output - 1)``.
    """

    ttft_s: float = 30.0
    tbt_s: float = 0.1

    def __post_init__(self) -> None:
        if not self.ttft_s > 0 or not self.tbt_s > 0:
            raise InvalidArgument(f"SLOs must be > 0 s, got ttft_s={self.ttft_s}, "
                                  f"tbt_s={self.tbt_s}")


@dataclass(frozen=True, slots=True)
class Decision:
    """What a policy chose for one request.

    Attributes:
        prefill: index of the prefill instance.
        decode: index of the decode instance.
        pull_from: where the reused prefix beyond the local cache comes from: a prefill
            instance index, :data:`POOL`, or None for no pull.
        reused_blocks: prefix blocks that will not be recomputed (local hit plus pull).
        predicted_ttft_s: the policy's TTFT estimate (the view's expectation).
        predicted_tbt_s: the policy's TBT estimate.
        reject_reason: why the request is refused, or None when it is served.
        model_ttft_s: the cost model's TTFT estimate before the view corrected it
            (:meth:`ClusterView.expected_ttft_s`); None where it is ``predicted_ttft_s``.
    """

    prefill: int
    decode: int
    pull_from: PullSource | None
    reused_blocks: int
    predicted_ttft_s: float
    predicted_tbt_s: float
    reject_reason: str | None = None
    model_ttft_s: float | None = None

    @property
    def rejected(self) -> bool:
        """True when the request is refused."""
        return self.reject_reason is not None


class PrefixRequest(Protocol):
    """What a policy reads from a request: its length and block ids, never its output."""

    @property
    def input_length(self) -> int: ...

    @property
    def hash_ids(self) -> Sequence[int]: ...


class ClusterView(Protocol):
    """Read-only state of a disaggregated cluster, as a policy sees it.

    Implemented by the simulator; a proxy implements it from the instances' load reports.
    """

    @property
    def now_s(self) -> float:
        """Current time in seconds."""

    @property
    def num_prefill(self) -> int:
        """Number of prefill instances."""

    @property
    def num_decode(self) -> int:
        """Number of decode instances."""

    @property
    def decode_max_batch(self) -> int:
        """Most requests one decode instance runs in a batch."""

    @property
    def colocated(self) -> bool:
        """Every instance decodes what it prefilled (ordinary engines, no P/D roles):
        prefill instance ``i`` is decode instance ``i``."""

    @property
    def block_tokens(self) -> int:
        """Tokens per KV block."""

    def prefill_queue_s(self, instance: int) -> float:
        """Seconds of prefill work queued on ``instance`` ahead of a new request."""

    def cached_prefix(self, instance: int, hash_ids: Sequence[int]) -> PrefixHit:
        """Longest prefix of ``hash_ids`` in the KV cache of prefill ``instance``."""

    def pool_prefix(self, hash_ids: Sequence[int]) -> PrefixHit:
        """Longest prefix of ``hash_ids`` in the global pool (0 blocks when there is none)."""

    def decode_forecast(self, instance: int, at_s: float) -> DecodeForecast:
        """Predicted batch of decode ``instance`` at time ``at_s``."""

    def expected_ttft_s(self, instance: int, model_ttft_s: float) -> float:
        """The TTFT prefill ``instance`` is expected to show where the cost model (with
        the view's queues) estimates ``model_ttft_s``: a live view corrects it by what
        it measured there; the simulator, whose costs are the model's, returns it."""


class Policy(ABC):
    """Base of the scheduling policies: shared estimates plus the ``choose`` contract.

    Args:
        cost: the cost model used for every estimate.
    """

    name: ClassVar[str]

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    @abstractmethod
    def choose(self, request: PrefixRequest, view: ClusterView) -> Decision:
        """Pick prefill and decode instances for ``request``; pure with respect to ``view``.

        Args:
            request: the arriving request.
            view: the cluster state at the request's arrival.

        Returns:
            The decision; the caller applies it.
        """

    # ---- shared estimates -------------------------------------------------------------

    def _local_ttft_s(self, request: PrefixRequest, view: ClusterView, instance: int,
                      hit: PrefixHit) -> float:
        """TTFT on ``instance`` using only its own cache."""
        now = view.now_s
        start = max(now + view.prefill_queue_s(instance), hit.ready_s)
        cached = min(hit.blocks * view.block_tokens, request.input_length)
        return (start + self.cost.prefill_s(request.input_length, cached) - now
                + self._handoff_s(request, view))

    def _handoff_s(self, request: PrefixRequest, view: ClusterView) -> float:
        """From the prefill's end to the first token (see :meth:`CostModel.handoff_s`)."""
        return 0.0 if view.colocated else self.cost.handoff_s(request.input_length)

    def _pull_ttft_s(self, request: PrefixRequest, view: ClusterView, instance: int,
                     local: PrefixHit, source: PrefixHit) -> float:
        """TTFT on ``instance`` after pulling the ``source`` prefix beyond ``local``.

        The pull starts at once (or when the source has computed the blocks) and overlaps
        the wait in the instance's queue; prefill starts when both are over.
        """
        now = view.now_s
        block_tokens, length = view.block_tokens, request.input_length
        have = min(local.blocks * block_tokens, length)
        cached = min(source.blocks * block_tokens, length)
        pulled_s = max(now, source.ready_s) + self.cost.kv_transfer_s(cached - have)
        start = max(now + view.prefill_queue_s(instance), local.ready_s, pulled_s)
        return (start + self.cost.prefill_s(request.input_length, cached) - now
                + self._handoff_s(request, view))

    def _with_pool(self, request: PrefixRequest, view: ClusterView, instance: int) -> Decision:
        """Prefill on ``instance``, reading the pool when it holds a longer prefix."""
        local = view.cached_prefix(instance, request.hash_ids)
        pool = view.pool_prefix(request.hash_ids)
        if pool.blocks > local.blocks:
            model_s = self._pull_ttft_s(request, view, instance, local, pool)
            pull_from: PullSource | None = POOL
            reused = pool.blocks
        else:
            model_s = self._local_ttft_s(request, view, instance, local)
            pull_from, reused = None, local.blocks
        ttft_s = view.expected_ttft_s(instance, model_s)
        decode, tbt_s = self._pick_decode(request, view, instance, view.now_s + ttft_s)
        return Decision(instance, decode, pull_from, reused, ttft_s, tbt_s,
                        model_ttft_s=model_s)

    def _pick_decode(self, request: PrefixRequest, view: ClusterView, prefill: int,
                     first_token_s: float) -> tuple[int, float]:
        """Decode instance with the lightest forecast batch (``prefill`` itself where
        instances are colocated), and the request's TBT there.

        The request joins its decode batch at its first token (when the KV streams
        during prefill, the prefill's end; else a transfer later), where the forecast
        is taken. When no slot is forecast to be free, the request would wait for one and
        its TBT is unbounded (``inf``).
        """
        best, best_key = -1, (0, 0.0)
        for instance in ([prefill] if view.colocated else range(view.num_decode)):
            forecast = view.decode_forecast(instance, first_token_s)
            key = (forecast.requests, forecast.context_tokens)
            if best < 0 or key < best_key:
                best, best_key = instance, key
        requests = best_key[0] + 1
        max_batch = view.decode_max_batch
        step_s = self.cost.decode_step_s(min(requests, max_batch),
                                         best_key[1] + request.input_length)
        # colocated, a request waits for its slot before its prefill (in its TTFT)
        return best, step_s if requests <= max_batch or view.colocated else math.inf


class RandomPolicy(Policy):
    """Uniformly random prefill instance.

    Args:
        cost: the cost model.
        seed: seed of the private random generator.
    """

    name = "random"

    def __init__(self, cost: CostModel, seed: int = 0) -> None:
        super().__init__(cost)
        self._rng = random.Random(seed)

    def choose(self, request: PrefixRequest, view: ClusterView) -> Decision:
        """Pick a random prefill instance (see :meth:`Policy.choose`)."""
        return self._with_pool(request, view, self._rng.randrange(view.num_prefill))


class RoundRobinPolicy(Policy):
    """The prefill instances in turn (the state is the policy's own counter)."""

    name = "round_robin"

    def __init__(self, cost: CostModel) -> None:
        super().__init__(cost)
        self._next = 0

    def choose(self, request: PrefixRequest, view: ClusterView) -> Decision:
        """Pick the next prefill instance (see :meth:`Policy.choose`)."""
        instance = self._next % view.num_prefill
        self._next = instance + 1
        return self._with_pool(request, view, instance)


class LoadBalancePolicy(Policy):
    """Prefill instance with the least queued work (lowest index on ties)."""

    name = "load_balance"

    def choose(self, request: PrefixRequest, view: ClusterView) -> Decision:
        """Pick the least loaded prefill instance (see :meth:`Policy.choose`)."""
        instance = min(range(view.num_prefill), key=view.prefill_queue_s)
        return self._with_pool(request, view, instance)


class CacheAwarePolicy(Policy):
    """Prefill instance with the longest cached prefix (least queued work on ties)."""

    name = "cache_aware"

    def choose(self, request: PrefixRequest, view: ClusterView) -> Decision:
        """Pick the instance with the longest prefix hit (see :meth:`Policy.choose`)."""
        hash_ids = request.hash_ids
        instance = min(range(view.num_prefill),
                       key=lambda i: (-view.cached_prefix(i, hash_ids).blocks,
                                      view.prefill_queue_s(i)))
        return self._with_pool(request, view, instance)


class ConductorPolicy(Policy):
    """Mooncake's Conductor: lowest estimated TTFT, hot-block pulls, early rejection.

    Args:
        cost: the cost model.
        slo: the objectives used for early rejection.
        early_reject: reject requests predicted to break the SLO.
        migrate: allow pulling a prefix from peer instances (the pool is always read).
    """

    name = "conductor"

    def __init__(self, cost: CostModel, slo: Slo, early_reject: bool = True,
                 migrate: bool = True) -> None:
        super().__init__(cost)
        self.slo = slo
        self.early_reject = early_reject
        self.migrate = migrate

    def choose(self, request: PrefixRequest, view: ClusterView) -> Decision:
        """Pick the prefill instance with the lowest TTFT estimate (see :meth:`Policy.choose`).

        Returns:
            The decision; ``reject_reason`` is set when early rejection applies.
        """
        hash_ids = request.hash_ids
        hits = [view.cached_prefix(i, hash_ids) for i in range(view.num_prefill)]
        pool = view.pool_prefix(hash_ids)
        # The two best peer caches, so every instance can exclude itself in O(1).
        order = sorted(range(len(hits)), key=lambda i: -hits[i].blocks)[:2]
        # (expected TTFT, instance, source, reused blocks, the model's TTFT)
        best: tuple[float, int, PullSource | None, int, float] | None = None
        for instance, local in enumerate(hits):
            model_s = self._local_ttft_s(request, view, instance, local)
            choice: tuple[float, int, PullSource | None, int, float] = (
                model_s, instance, None, local.blocks, model_s)
            sources: list[tuple[PullSource, PrefixHit]] = [(POOL, pool)]
            if self.migrate:
                peer = next((i for i in order if i != instance), None)
                if peer is not None:
                    sources.append((peer, hits[peer]))
            for name, source in sources:
                if source.blocks > local.blocks:
                    pull_s = self._pull_ttft_s(request, view, instance, local, source)
                    if pull_s < choice[0]:
                        choice = (pull_s, instance, name, source.blocks, pull_s)
            choice = (view.expected_ttft_s(instance, choice[0]), *choice[1:])
            if best is None or choice[0] < best[0]:
                best = choice
        assert best is not None
        ttft_s, instance, pull_from, reused, model_s = best
        decode, tbt_s = self._pick_decode(request, view, instance, view.now_s + ttft_s)
        reason = None
        if self.early_reject:
            if ttft_s > self.slo.ttft_s:
                reason = f"predicted TTFT {ttft_s:.3f} s > SLO {self.slo.ttft_s:.3f} s"
            elif tbt_s == math.inf:
                reason = "no decode slot forecast to be free at the first token"
            elif tbt_s > self.slo.tbt_s:
                reason = f"predicted TBT {tbt_s * 1e3:.1f} ms > SLO {self.slo.tbt_s * 1e3:.1f} ms"
            if reason is not None:
                logger.debug("reject (%d tokens): %s", request.input_length, reason)
        return Decision(instance, decode, pull_from, reused, ttft_s, tbt_s, reason, model_s)


POLICY_NAMES: tuple[str, ...] = (RandomPolicy.name, RoundRobinPolicy.name,
                                 LoadBalancePolicy.name, CacheAwarePolicy.name,
                                 ConductorPolicy.name)


def make_policy(name: str, cost: CostModel, slo: Slo, *, seed: int = 0,
                early_reject: bool = True, migrate: bool = True) -> Policy:
    """Build a fresh policy by name.

    Args:
        name: one of :data:`POLICY_NAMES`.
        cost: the cost model.
        slo: the objectives (used by ``conductor``).
        seed: seed of ``random``.
        early_reject: whether ``conductor`` rejects early.
        migrate: whether ``conductor`` may pull prefixes from peer instances.

    Returns:
        A new policy object with its own state.

    Raises:
        InvalidArgument: unknown name.
    """
    if name == RandomPolicy.name:
        return RandomPolicy(cost, seed)
    if name == RoundRobinPolicy.name:
        return RoundRobinPolicy(cost)
    if name == LoadBalancePolicy.name:
        return LoadBalancePolicy(cost)
    if name == CacheAwarePolicy.name:
        return CacheAwarePolicy(cost)
    if name == ConductorPolicy.name:
        return ConductorPolicy(cost, slo, early_reject=early_reject, migrate=migrate)
    raise InvalidArgument(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
