"""Policies driven through a hand-built ClusterView, as a request proxy would drive them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from mooncake_plugins.conductor.costmodel import CostModel
from mooncake_plugins.conductor.policies import (POLICY_NAMES, POOL, CacheAwarePolicy,
                                                 ConductorPolicy, DecodeForecast,
                                                 LoadBalancePolicy, PrefixHit, RandomPolicy,
                                                 Slo, make_policy)
from mooncake_plugins.conductor.traces import TraceRequest
from mooncake_plugins.errors import InvalidArgument

COST = CostModel()


@dataclass
class FakeView:
    """A ClusterView whose every answer is set by the test."""

    queues_s: list[float]
    prefixes: dict[int, PrefixHit] = field(default_factory=dict)
    pool: PrefixHit = PrefixHit(0, 0.0)
    forecasts: list[DecodeForecast] = field(default_factory=lambda: [DecodeForecast(0, 0.0)])
    now_s: float = 100.0
    decode_max_batch: int = 8
    block_tokens: int = 512
    colocated: bool = False
    slowdowns: dict[int, float] = field(default_factory=dict)   # measured / model TTFT

    @property
    def num_prefill(self) -> int:
        return len(self.queues_s)

    @property
    def num_decode(self) -> int:
        return len(self.forecasts)

    def prefill_queue_s(self, instance: int) -> float:
        return self.queues_s[instance]

    def cached_prefix(self, instance: int, hash_ids: Sequence[int]) -> PrefixHit:
        return self.prefixes.get(instance, PrefixHit(0, 0.0))

    def pool_prefix(self, hash_ids: Sequence[int]) -> PrefixHit:
        return self.pool

    def decode_forecast(self, instance: int, at_s: float) -> DecodeForecast:
        return self.forecasts[instance]

    def expected_ttft_s(self, instance: int, model_ttft_s: float) -> float:
        return model_ttft_s * self.slowdowns.get(instance, 1.0)


def _request(blocks: int = 8) -> TraceRequest:
    return TraceRequest(0.0, blocks * 512, 100, tuple(range(blocks)))


def test_load_balance_picks_the_idle_instance() -> None:
    decision = LoadBalancePolicy(COST).choose(_request(), FakeView([5.0, 0.0, 3.0]))
    assert decision.prefill == 1
    assert decision.pull_from is None
    assert decision.predicted_ttft_s == pytest.approx(COST.prefill_s(4096))


def test_cache_aware_picks_the_longest_prefix_then_the_shortest_queue() -> None:
    view = FakeView([9.0, 1.0, 0.0, 2.0],
                    prefixes={0: PrefixHit(5, 0.0), 1: PrefixHit(5, 0.0), 2: PrefixHit(2, 0.0)})
    decision = CacheAwarePolicy(COST).choose(_request(), view)
    assert (decision.prefill, decision.reused_blocks) == (1, 5)


def test_random_is_reproducible_per_seed() -> None:
    view = FakeView([0.0] * 8)

    def picks(seed: int) -> list[int]:
        policy = RandomPolicy(COST, seed)
        return [policy.choose(_request(), view).prefill for _ in range(100)]

    assert picks(1) == picks(1) != picks(2)
    assert set(picks(3)) == set(range(8))


def test_baselines_read_a_longer_prefix_from_the_pool() -> None:
    view = FakeView([0.0, 0.0], prefixes={0: PrefixHit(2, 0.0)}, pool=PrefixHit(6, 0.0))
    decision = LoadBalancePolicy(COST).choose(_request(), view)
    assert (decision.prefill, decision.pull_from, decision.reused_blocks) == (0, POOL, 6)
    expected = COST.kv_transfer_s(4 * 512) + COST.prefill_s(4096, 6 * 512)
    assert decision.predicted_ttft_s == pytest.approx(expected)


def test_conductor_minimises_queue_plus_prefill() -> None:
    # instance 0 holds 6 blocks but is 2 s busy; instance 1 is idle with nothing cached.
    view = FakeView([2.0, 0.0], prefixes={0: PrefixHit(6, 0.0)})
    policy = ConductorPolicy(COST, Slo(), migrate=False)
    decision = policy.choose(_request(), view)
    on_0 = 2.0 + COST.prefill_s(4096, 3072)
    on_1 = COST.prefill_s(4096)
    assert decision.prefill == (0 if on_0 < on_1 else 1)
    assert decision.predicted_ttft_s == pytest.approx(min(on_0, on_1))


def _migration_view() -> FakeView:
    # the prefix is on busy instance 0; instance 1 is idle and holds nothing
    return FakeView([50.0, 0.0], prefixes={0: PrefixHit(6, 0.0)})


@pytest.mark.parametrize("ratio", [0.9, 1.1])
def test_conductor_pulls_exactly_when_transfer_beats_recompute(ratio: float) -> None:
    recompute_s = COST.prefill_s(4096) - COST.prefill_s(4096, 6 * 512)
    # pick the bandwidth that makes the transfer take ratio x the recompute time saved
    transfer_s = ratio * recompute_s
    cost = CostModel(transfer_latency_s=0.0,
                     transfer_bytes_per_s=6 * 512 * COST.kv_bytes_per_token / transfer_s)
    decision = ConductorPolicy(cost, Slo()).choose(_request(), _migration_view())
    assert decision.prefill == 1
    if ratio < 1:
        assert (decision.pull_from, decision.reused_blocks) == (0, 6)
        assert decision.predicted_ttft_s == pytest.approx(transfer_s + cost.prefill_s(4096, 3072))
    else:
        assert (decision.pull_from, decision.reused_blocks) == (None, 0)
        assert decision.predicted_ttft_s == pytest.approx(cost.prefill_s(4096))


def test_conductor_waits_for_blocks_still_being_computed() -> None:
    view = FakeView([50.0, 0.0], prefixes={0: PrefixHit(6, 100.0 + 0.3)})
    decision = ConductorPolicy(COST, Slo()).choose(_request(), view)
    assert decision.pull_from == 0
    expected = 0.3 + COST.kv_transfer_s(3072) + COST.prefill_s(4096, 3072)
    assert decision.predicted_ttft_s == pytest.approx(expected)


def test_conductor_without_migration_never_pulls_from_peers() -> None:
    decision = ConductorPolicy(COST, Slo(), migrate=False).choose(_request(),
                                                                 _migration_view())
    assert decision.pull_from is None


@pytest.mark.parametrize(("slo_factor", "rejected"), [(1.0001, False), (0.9999, True)])
def test_early_rejection_exactly_at_the_ttft_slo(slo_factor: float, rejected: bool) -> None:
    ttft_s = 3.0 + COST.prefill_s(4096)
    policy = ConductorPolicy(COST, Slo(ttft_s=ttft_s * slo_factor))
    decision = policy.choose(_request(), FakeView([3.0]))
    assert decision.predicted_ttft_s == pytest.approx(ttft_s)
    assert decision.rejected is rejected
    if rejected:
        assert "TTFT" in decision.reject_reason


def test_early_rejection_on_predicted_tbt() -> None:
    forecast = DecodeForecast(3, 40_000.0)
    step_s = COST.decode_step_s(4, 40_000.0 + 4096)
    view = FakeView([0.0], forecasts=[forecast])
    assert not ConductorPolicy(COST, Slo(tbt_s=step_s * 1.001)).choose(_request(), view).rejected
    decision = ConductorPolicy(COST, Slo(tbt_s=step_s * 0.999)).choose(_request(), view)
    assert decision.rejected and "TBT" in decision.reject_reason
    assert decision.predicted_tbt_s == pytest.approx(step_s)


def test_full_decode_batch_is_rejected_and_lighter_decode_chosen() -> None:
    full = DecodeForecast(8, 0.0)
    view = FakeView([0.0], forecasts=[full, full])
    decision = ConductorPolicy(COST, Slo()).choose(_request(), view)
    assert decision.rejected and "slot" in decision.reject_reason
    view = FakeView([0.0], forecasts=[full, DecodeForecast(2, 10.0), DecodeForecast(2, 5.0)])
    decision = ConductorPolicy(COST, Slo()).choose(_request(), view)
    assert (decision.decode, decision.rejected) == (2, False)


def test_no_early_rejection_serves_everything() -> None:
    policy = ConductorPolicy(COST, Slo(ttft_s=0.001), early_reject=False)
    assert not policy.choose(_request(), FakeView([10.0])).rejected


def test_make_policy_names() -> None:
    for name in POLICY_NAMES:
        assert make_policy(name, COST, Slo()).name == name
    with pytest.raises(InvalidArgument, match="unknown policy"):
        make_policy("fastest", COST, Slo())


def test_slo_must_be_positive() -> None:
    with pytest.raises(InvalidArgument):
        Slo(ttft_s=0.0)


def test_colocated_views_decode_on_the_prefill_instance() -> None:
    # instance 1 is the idle prefill; its decode batch is the busier one, yet colocated
    # requests decode where they prefill, and the TBT estimate is that batch's
    forecasts = [DecodeForecast(0, 0.0), DecodeForecast(6, 6000.0)]
    for policy in (LoadBalancePolicy(COST), ConductorPolicy(COST, Slo(100, 100))):
        split = policy.choose(_request(), FakeView([5.0, 0.0], forecasts=forecasts))
        assert (split.prefill, split.decode) == (1, 0)
        together = policy.choose(_request(), FakeView([5.0, 0.0], forecasts=forecasts,
                                                      colocated=True))
        assert (together.prefill, together.decode) == (1, 1)
        assert together.predicted_tbt_s == pytest.approx(
            COST.decode_step_s(7, 6000.0 + _request().input_length))


def test_the_views_measured_correction_decides_and_rejects() -> None:
    """Instance 0's model TTFT is the lower, but it was measured 3x slower than the model:
    the conductor takes instance 1; the expectation, not the model, is checked against
    the SLO; every policy reports both."""
    fast_model = COST.prefill_s(4096)
    view = FakeView([0.0, 0.5 * fast_model], slowdowns={0: 3.0})
    decision = ConductorPolicy(COST, Slo(ttft_s=30.0)).choose(_request(), view)
    assert decision.prefill == 1
    assert decision.predicted_ttft_s == decision.model_ttft_s == pytest.approx(1.5 * fast_model)
    view = FakeView([0.0], slowdowns={0: 3.0})
    for slo_s, rejected in ((2.5 * fast_model, True), (3.5 * fast_model, False)):
        decision = ConductorPolicy(COST, Slo(ttft_s=slo_s)).choose(_request(), view)
        assert decision.rejected is rejected
        assert decision.predicted_ttft_s == pytest.approx(3 * fast_model)
        assert decision.model_ttft_s == pytest.approx(fast_model)
    decision = LoadBalancePolicy(COST).choose(_request(), view)
    assert (decision.predicted_ttft_s, decision.model_ttft_s) == (
        pytest.approx(3 * fast_model), pytest.approx(fast_model))


@pytest.mark.parametrize("colocated", [False, True])
def test_a_kv_handoff_after_prefill_counts_in_p_d_estimates(colocated: bool) -> None:
    # vLLM's P/D handoff: the decode pulls the prompt's 4096 tokens after the prefill, and
    # the first token comes from it 0.5 s later; an ordinary engine moves nothing
    after = CostModel(kv_streamed_during_prefill=False, handoff_latency_s=0.5)
    handoff = 0.0 if colocated else after.handoff_s(4096)
    assert handoff == 0.0 or handoff > 0.5
    view = FakeView([0.2, 0.0], colocated=colocated,
                    forecasts=[DecodeForecast(0, 0.0)] * (2 if colocated else 1))
    prefill = after.prefill_s(4096)
    for policy in (LoadBalancePolicy(after), CacheAwarePolicy(after),
                   ConductorPolicy(after, Slo(ttft_s=100.0))):
        decision = policy.choose(_request(), view)
        assert decision.predicted_ttft_s == pytest.approx(prefill + handoff), policy.name
    # within the SLO on the prefill alone, refused with the handoff
    edge = ConductorPolicy(after, Slo(ttft_s=prefill + 0.25))
    assert edge.choose(_request(), view).rejected is not colocated
    # streamed during prefill (Mooncake's layer-wise transfer): nothing after it
    assert ConductorPolicy(COST, Slo(ttft_s=100.0)).choose(_request(), view) \
        .predicted_ttft_s == pytest.approx(COST.prefill_s(4096))
