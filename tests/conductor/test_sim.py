"""Simulator on tiny hand-made traces whose outcome is known by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest

from mooncake_plugins.conductor.costmodel import CostModel
from mooncake_plugins.conductor.policies import (CacheAwarePolicy, ConductorPolicy,
                                                 LoadBalancePolicy, Policy, Slo)
from mooncake_plugins.conductor.sim import (ClusterConfig, LruBlockCache, SimResult,
                                            find_capacity, simulate)
from mooncake_plugins.conductor.traces import TraceRequest
from mooncake_plugins.errors import InvalidArgument

COST = CostModel()
SLO = Slo()


def _req(ts_ms: float, hash_ids: tuple[int, ...], output: int = 2,
         tokens: int | None = None) -> TraceRequest:
    return TraceRequest(ts_ms, tokens if tokens is not None else 512 * len(hash_ids), output,
                        hash_ids)


def _run(requests: list[TraceRequest], policy: Policy, *, num_prefill: int = 2,
         cache_tokens: int = 1_000_000, pool_tokens: int = 0) -> SimResult:
    config = ClusterConfig(num_prefill=num_prefill, num_decode=1, cache_tokens=cache_tokens,
                           pool_tokens=pool_tokens)
    return simulate(requests, policy, config, SLO, keep_outcomes=True)


# ---- LRU ---------------------------------------------------------------------------------

def test_lru_evicts_the_least_recently_used_block() -> None:
    cache = LruBlockCache(3)
    cache.insert([1, 2, 3], 0.0)
    cache.insert([4], 0.0)
    assert cache.blocks() == [2, 3, 4] and cache.evictions == 1
    cache.touch([2])
    cache.insert([5], 0.0)
    assert cache.blocks() == [4, 2, 5]


def test_lru_prefix_stops_at_the_first_missing_block() -> None:
    cache = LruBlockCache(10)
    cache.insert([1, 2, 3], 5.0)
    cache.insert([7], 9.0)
    assert cache.prefix([1, 2, 3, 4]) == (3, 5.0)
    assert cache.prefix([2, 3]) == (2, 5.0)
    assert cache.prefix([9, 1]) == (0, 0.0)
    assert cache.prefix([1, 2, 3, 7]) == (4, 9.0)
    assert cache.blocks() == [1, 2, 3, 7]  # lookups are not uses


def test_zero_capacity_cache_holds_nothing() -> None:
    cache = LruBlockCache(0)
    cache.insert([1, 2], 0.0)
    assert len(cache) == 0 and 1 not in cache


def test_lru_eviction_in_a_replay_breaks_the_prefix() -> None:
    # one instance, 2 blocks of cache: A=(1,2), B=(3) evicts 1, so C=(1,2) finds nothing
    requests = [_req(0, (1, 2)), _req(10_000, (3,)), _req(20_000, (1, 2))]
    result = _run(requests, LoadBalancePolicy(COST), num_prefill=1, cache_tokens=1024)
    assert [o.reused_blocks for o in result.outcomes] == [0, 0, 0]
    result = _run(requests, LoadBalancePolicy(COST), num_prefill=1, cache_tokens=1536)
    assert [o.reused_blocks for o in result.outcomes] == [0, 0, 2]


# ---- prefix reuse and prefill timing ------------------------------------------------------

def test_shared_prefix_hits_exactly_k_blocks_with_cache_aware() -> None:
    a = _req(0, (1, 2, 3, 4), tokens=2048)
    b = _req(10_000, (1, 2, 3, 7, 8), tokens=2400)
    result = _run([a, b], CacheAwarePolicy(COST))
    first, second = result.outcomes
    assert second.prefill == first.prefill
    assert (second.local_blocks, second.reused_blocks, second.pull_from) == (3, 3, None)
    assert result.hit_rate == pytest.approx(3 / 9)
    assert first.ttft_s == pytest.approx(COST.prefill_s(2048))
    assert second.ttft_s == pytest.approx(COST.prefill_s(2400, 3 * 512))
    assert second.ttft_s == pytest.approx(COST.prefill_s(2400 - 1536))


def test_fifo_queue_adds_the_previous_prefill() -> None:
    requests = [_req(0, (1, 2, 3, 4)), _req(0, (5, 6))]
    result = _run(requests, LoadBalancePolicy(COST), num_prefill=1)
    first, second = result.outcomes
    assert second.ttft_s == pytest.approx(COST.prefill_s(2048) + COST.prefill_s(1024))


def test_load_balance_sends_the_second_request_to_the_idle_instance() -> None:
    requests = [_req(0, tuple(range(64))), _req(1, (100,))]
    result = _run(requests, LoadBalancePolicy(COST))
    assert [o.prefill for o in result.outcomes] == [0, 1]
    assert result.outcomes[1].ttft_s == pytest.approx(COST.prefill_s(512))


def test_conductor_migrates_a_hot_prefix_to_an_idle_instance() -> None:
    prefix = tuple(range(1, 9))
    a = _req(0, prefix)                              # instance 0 computes the prefix
    busy = _req(10_000, tuple(range(100, 164)))      # then gets a long prompt
    c = _req(10_001, prefix + (9, 10))               # shares the prefix, instance 0 is busy
    result = _run([a, busy, c], ConductorPolicy(COST, SLO))
    out = result.outcomes[2]
    assert (out.prefill, out.local_blocks, out.reused_blocks, out.pull_from) == (1, 0, 8, 0)
    expected = COST.kv_transfer_s(8 * 512) + COST.prefill_s(10 * 512, 8 * 512)
    assert out.ttft_s == pytest.approx(expected)
    assert result.pulled_blocks == 8


def test_pool_serves_a_prefix_to_another_instance() -> None:
    prefix = tuple(range(1, 9))
    requests = [_req(0, prefix), _req(10_000, tuple(range(100, 164))),
                _req(10_001, prefix + (9,))]
    with_pool = _run(requests, LoadBalancePolicy(COST), pool_tokens=100_000)
    out = with_pool.outcomes[2]
    assert (out.prefill, out.reused_blocks, out.pull_from) == (1, 8, "pool")
    without = _run(requests, LoadBalancePolicy(COST))
    assert (without.outcomes[2].reused_blocks, without.outcomes[2].pull_from) == (0, None)


# ---- decode ---------------------------------------------------------------------------------

FLAT = CostModel(decode_fixed_s=0.01, decode_s_per_request=0.0, decode_s_per_context_token=0.0,
                 transfer_latency_s=0.0)


def test_decode_waits_for_a_slot_and_tbt_counts_the_wait() -> None:
    # two 1024-token prompts at t=0, one prefill instance, batch of 1; 100 tokens each to decode
    requests = [_req(0, (1, 2), output=101), _req(0, (3, 4), output=101)]
    config = ClusterConfig(num_prefill=1, num_decode=1, decode_max_batch=1, cost=FLAT)
    result = simulate(requests, LoadBalancePolicy(FLAT), config, SLO, keep_outcomes=True)
    p = FLAT.prefill_s(1024)
    first_a, first_b = p, 2 * p
    finish_a = first_a + 100 * 0.01
    assert first_b < finish_a  # B's KV is there before A leaves: it waits for the slot
    finish_b = finish_a + 100 * 0.01
    a, b = result.outcomes
    assert a.tbt_s == pytest.approx((finish_a - first_a) / 100)
    assert b.tbt_s == pytest.approx((finish_b - first_b) / 100)
    assert result.makespan_s == pytest.approx(finish_b)


def test_batched_decode_step_time_depends_on_batch() -> None:
    cost = CostModel(decode_fixed_s=0.01, decode_s_per_request=0.005,
                     decode_s_per_context_token=0.0, transfer_latency_s=0.0)
    requests = [_req(0, (1,), output=101), _req(0, (2,), output=101)]
    config = ClusterConfig(num_prefill=2, num_decode=1, decode_max_batch=2, cost=cost)
    result = simulate(requests, LoadBalancePolicy(cost), config, SLO, keep_outcomes=True)
    # both join at the same time p and share 100 steps of 0.01 + 2 x 0.005 s
    assert [o.tbt_s for o in result.outcomes] == pytest.approx([0.02, 0.02])


def test_colocated_decode_pauses_while_its_instance_prefills() -> None:
    # one ordinary engine: A (1024 tokens) decodes 100 tokens of 0.01 s; B (2048 tokens)
    # arrives 0.5 s after A's first token and is prefilled on the same instance
    slow = CostModel(decode_fixed_s=0.01, decode_s_per_request=0.0,
                     decode_s_per_context_token=0.0, transfer_latency_s=5.0,
                     transfer_bytes_per_s=1.0)   # a KV transfer would show
    p_a, p_b = slow.prefill_s(1024), slow.prefill_s(2048)
    requests = [_req(0, (1, 2), output=101), _req((p_a + 0.5) * 1e3, (3, 4, 5, 6), output=2)]
    config = ClusterConfig(num_prefill=1, num_decode=3, decode_max_batch=4, cost=slow,
                           colocated=True)
    assert config.num_decode == 1
    result = simulate(requests, LoadBalancePolicy(slow), config, SLO, keep_outcomes=True)
    a, b = result.outcomes
    assert a.decode == a.prefill == 0 and b.decode == 0
    assert a.ttft_s == pytest.approx(p_a) and b.ttft_s == pytest.approx(p_b)
    # A's 100 steps take 1 s of stepping, interrupted for B's whole prefill
    assert a.tbt_s == pytest.approx((1.0 + p_b) / 100)
    # B joins at its prefill's end (no transfer) and shares A's remaining steps
    assert b.tbt_s == pytest.approx(0.01)
    disaggregated = simulate(requests, LoadBalancePolicy(slow),
                             ClusterConfig(num_prefill=1, num_decode=1, decode_max_batch=4,
                                           cost=slow), SLO, keep_outcomes=True)
    assert disaggregated.outcomes[0].tbt_s > 5.0 / 100   # the transfer delays its join


@pytest.mark.parametrize("slots", [1, 2])
def test_colocated_prefills_wait_for_a_slot(slots: int) -> None:
    # A decodes 100 tokens of 0.01 s; B arrives with it. One slot (vLLM --max-num-seqs 1):
    # B's prefill waits until A's last token and A is never paused. Two: B prefills at
    # once after A's prefill, and A's decode waits for it.
    requests = [_req(0, (1, 2), output=101), _req(0, (3, 4), output=2)]
    config = ClusterConfig(num_prefill=1, decode_max_batch=slots, cost=FLAT, colocated=True)
    a, b = simulate(requests, LoadBalancePolicy(FLAT), config, SLO, keep_outcomes=True).outcomes
    p = FLAT.prefill_s(1024)
    if slots == 1:
        assert a.tbt_s == pytest.approx(0.01)
        assert b.ttft_s == pytest.approx(p + 1.0 + p)
    else:
        assert a.tbt_s == pytest.approx((1.0 + p) / 100)
        assert b.ttft_s == pytest.approx(2 * p)


def test_colocated_queue_estimate_includes_the_slot_wait() -> None:
    # one slot, A decoding until p + 1 s: at B's arrival the queue is the rest of A
    p = FLAT.prefill_s(1024)
    seen: list[float] = []

    class Recording(LoadBalancePolicy):
        def choose(self, request, view):
            seen.append(view.prefill_queue_s(0))
            return super().choose(request, view)

    requests = [_req(0, (1, 2), output=101), _req(p * 1e3 + 500, (3, 4), output=2),
                _req(p * 1e3 + 500, (5, 6), output=1)]
    config = ClusterConfig(num_prefill=1, decode_max_batch=1, cost=FLAT, colocated=True)
    result = simulate(requests, Recording(FLAT), config, SLO, keep_outcomes=True)
    assert seen[:2] == pytest.approx([0.0, 0.5])
    # the third waits for A, then B's prefill and B's one decode step
    assert seen[2] == pytest.approx(0.5 + p + 0.01)
    assert result.outcomes[2].ttft_s == pytest.approx(seen[2] + p)


def test_colocated_requests_decode_where_they_prefill() -> None:
    # both prefill on instance 0 (the shared prefix); disaggregated, the second decodes on
    # the idle decode instance 1; colocated, it stays on 0
    requests = [_req(0, (1, 2), output=50), _req(0, (1, 2, 3), output=50)]
    split = simulate(requests, CacheAwarePolicy(FLAT), ClusterConfig(num_prefill=2, num_decode=2,
                     cost=FLAT), SLO, keep_outcomes=True)
    assert [(o.prefill, o.decode) for o in split.outcomes] == [(0, 0), (0, 1)]
    together = simulate(requests, CacheAwarePolicy(FLAT), ClusterConfig(num_prefill=2, cost=FLAT,
                        colocated=True), SLO, keep_outcomes=True)
    assert [(o.prefill, o.decode) for o in together.outcomes] == [(0, 0), (0, 0)]


def test_single_token_outputs_finish_at_prefill() -> None:
    result = _run([_req(0, (1, 2), output=1)], LoadBalancePolicy(COST))
    out = result.outcomes[0]
    assert out.decode == -1 and math.isnan(out.tbt_s)
    assert result.slo_attainment == 1.0
    assert math.isnan(result.tbt.p50)


# ---- rejection and SLO accounting ------------------------------------------------------------

@pytest.mark.parametrize(("factor", "rejected"), [(1.0001, 0), (0.9999, 1)])
def test_sim_rejects_exactly_when_predicted_ttft_exceeds_slo(factor: float, rejected: int) -> None:
    requests = [_req(0, tuple(range(8)))]
    slo = Slo(ttft_s=COST.prefill_s(4096) * factor)
    config = ClusterConfig(num_prefill=1, num_decode=1)
    result = simulate(requests, ConductorPolicy(COST, slo), config, slo, keep_outcomes=True)
    assert result.rejected == rejected
    assert result.slo_attainment == 1 - rejected
    if rejected:
        assert result.outcomes[0].prefill == -1
        assert "TTFT" in result.outcomes[0].reject_reason


def test_second_request_rejected_when_queue_pushes_it_over_the_slo() -> None:
    requests = [_req(0, tuple(range(8))), _req(0, tuple(range(10, 18)))]
    slo = Slo(ttft_s=1.5 * COST.prefill_s(4096))
    config = ClusterConfig(num_prefill=1, num_decode=1)
    result = simulate(requests, ConductorPolicy(COST, slo), config, slo, keep_outcomes=True)
    assert [o.reject_reason is None for o in result.outcomes] == [True, False]
    assert result.slo_attainment == 0.5
    assert result.hit_rate == 0.0


def test_served_requests_over_the_slo_count_as_misses() -> None:
    requests = [_req(0, tuple(range(8))), _req(0, tuple(range(10, 18)))]
    slo = Slo(ttft_s=1.5 * COST.prefill_s(4096))
    config = ClusterConfig(num_prefill=1, num_decode=1)
    result = simulate(requests, LoadBalancePolicy(COST), config, slo)
    assert (result.rejected, result.ttft_attainment, result.slo_attainment) == (0, 0.5, 0.5)


def test_rate_scale_compresses_arrivals() -> None:
    requests = [_req(0, (1,)), _req(4000, (2,))]
    result = simulate(requests, LoadBalancePolicy(COST), ClusterConfig(), SLO, rate_scale=4.0,
                      keep_outcomes=True)
    assert [o.arrival_s for o in result.outcomes] == [0.0, 1.0]


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        simulate([], LoadBalancePolicy(COST), ClusterConfig(), SLO)
    with pytest.raises(InvalidArgument):
        simulate([_req(0, (1,))], LoadBalancePolicy(COST), ClusterConfig(), SLO, rate_scale=0)
    with pytest.raises(InvalidArgument):
        ClusterConfig(num_prefill=0)
    with pytest.raises(InvalidArgument):
        ClusterConfig(cache_tokens=-1)


def test_capacity_search_brackets_the_target() -> None:
    # one prefill instance, a request every 2 s, each taking per_request_s to prefill
    requests = [_req(i * 2000.0, tuple(range(14 * i, 14 * i + 14))) for i in range(200)]
    slo = Slo(ttft_s=5.0)
    config = ClusterConfig(num_prefill=1, num_decode=1)
    capacity = find_capacity(requests, lambda: LoadBalancePolicy(COST), config, slo,
                             target=0.9, iterations=8)
    assert capacity.policy == "load_balance"
    per_request_s = COST.prefill_s(14 * 512)
    saturating_scale = 2.0 / per_request_s
    assert 0.8 * saturating_scale < capacity.rate_scale < 1.2 * saturating_scale
    best = max(s for s, a in capacity.probes if a >= 0.9)
    assert best == capacity.rate_scale
    assert all(a < 0.9 for s, a in capacity.probes if s > capacity.rate_scale)
    assert capacity.requests_per_s == pytest.approx(capacity.rate_scale * 200 / 398.0)


def test_shared_slowdown_stretches_prefills_that_overlap_another() -> None:
    # two instances sharing a host: a prefill that starts while the other prefills
    # takes 1.5x; one that starts alone takes 1x
    p = FLAT.prefill_s(1024)
    requests = [_req(0, (1, 2)), _req(0, (3, 4)), _req(10 * p * 1e3, (5, 6))]
    config = ClusterConfig(num_prefill=2, num_decode=1, cost=FLAT, shared_slowdown=1.5)
    result = simulate(requests, LoadBalancePolicy(FLAT), config, SLO, keep_outcomes=True)
    assert [o.ttft_s for o in result.outcomes] == pytest.approx([p, 1.5 * p, p])
    with pytest.raises(InvalidArgument):
        ClusterConfig(shared_slowdown=0.5)


def test_a_kv_handoff_after_prefill_delays_the_first_token() -> None:
    # P/D behind vLLM's handoff: A's KV (1024 tokens) moves in 0.5 s + 1024 x 1 ms after
    # its prefill; its first token comes from the decode then, and its 100 steps follow
    # (a load's own 5 s setup and 1 kB/s are not the handoff's)
    after = CostModel(decode_fixed_s=0.01, decode_s_per_request=0.0,
                      decode_s_per_context_token=0.0, transfer_latency_s=5.0,
                      handoff_latency_s=0.5, kv_bytes_per_token=1000,
                      transfer_bytes_per_s=1e3, handoff_bytes_per_s=1e6,
                      kv_streamed_during_prefill=False)
    requests = [_req(0, (1, 2), output=101)]
    pd = ClusterConfig(num_prefill=1, num_decode=1, decode_max_batch=4, cost=after)
    (a,) = simulate(requests, LoadBalancePolicy(after), pd, SLO, keep_outcomes=True).outcomes
    assert a.ttft_s == pytest.approx(after.prefill_s(1024) + 1.524)
    assert a.tbt_s == pytest.approx(0.01)   # the transfer is in the TTFT, not the TBT
    # streamed during prefill, the same transfer outlasts the prefill: TTFT is the
    # prefill's end, and the late join shows in the TBT
    during = dataclasses.replace(after, kv_streamed_during_prefill=True,
                                 transfer_bytes_per_s=1e6)
    (b,) = simulate(requests, LoadBalancePolicy(during),
                    ClusterConfig(num_prefill=1, num_decode=1, decode_max_batch=4, cost=during),
                    SLO, keep_outcomes=True).outcomes
    assert b.ttft_s == pytest.approx(during.prefill_s(1024)) and b.tbt_s > 0.01
    # an ordinary engine moves nothing
    (c,) = simulate(requests, LoadBalancePolicy(after),
                    ClusterConfig(num_prefill=1, num_decode=1, decode_max_batch=4, cost=after,
                                  colocated=True), SLO, keep_outcomes=True).outcomes
    assert c.ttft_s == pytest.approx(after.prefill_s(1024))


def test_the_pool_shows_a_prefix_only_once_its_prefill_ended() -> None:
    """As a live store holds only saved blocks: a request arriving while its prefix is
    still being computed on another instance finds nothing in the pool and computes it
    too; one arriving after that prefill ended loads it."""
    prefix = tuple(range(1, 9))
    a = _req(0, prefix + tuple(range(200, 256)))     # a long prefill on instance 0
    during = _req(2, prefix + (9,))                  # instance 1: a's prefill goes on
    result = _run([a, during], LoadBalancePolicy(COST), pool_tokens=100_000)
    assert result.outcomes[0].ttft_s > 1.0
    assert result.outcomes[1].prefill == 1
    assert (result.outcomes[1].reused_blocks, result.outcomes[1].pull_from) == (0, None)
    busy = _req(9_999, tuple(range(300, 302)))       # instance 0 again
    after = _req(10_000, prefix + (10,))
    result = _run([a, busy, after], LoadBalancePolicy(COST), pool_tokens=100_000)
    assert result.outcomes[2].prefill == 1
    assert (result.outcomes[2].reused_blocks, result.outcomes[2].pull_from) == (8, "pool")


# ---- prefill steps (vLLM's --max-num-batched-tokens) -------------------------------------

def _stepped(requests: list[TraceRequest], steps: int, **config) -> SimResult:
    config = {"num_prefill": 1, "num_decode": 1, "decode_max_batch": 8, **config}
    cluster = ClusterConfig(cost=FLAT, prefill_step_tokens=steps, **config)
    return simulate(requests, LoadBalancePolicy(FLAT), cluster, SLO, keep_outcomes=True)


@pytest.mark.parametrize("colocated", [True, False])
def test_prompts_prefilled_in_one_step_get_their_first_tokens_together(colocated: bool) -> None:
    """Four 1024-token prompts arrive together: the first starts alone; the other three
    wait and share one step of 8192 tokens, so their first tokens come with the last's,
    and they join the decode batch together then (the JOINs first planned are dropped).
    In steps of 2048 the second shares its step with the third only. The last prompt's
    first token is where one prompt after the other puts it."""
    requests = [_req(0, (2 * i + 1, 2 * i + 2), output=11) for i in range(4)]
    p = FLAT.prefill_s(1024)
    alone = _stepped(requests, 0, colocated=colocated)
    assert [o.ttft_s for o in alone.outcomes] == pytest.approx([p, 2 * p, 3 * p, 4 * p])
    big = _stepped(requests, 8192, colocated=colocated)
    assert [o.ttft_s for o in big.outcomes] == pytest.approx([p, 4 * p, 4 * p, 4 * p])
    _, b, c, d = big.outcomes
    assert b.tbt_s == pytest.approx(c.tbt_s) and c.tbt_s == pytest.approx(d.tbt_s)
    assert b.tbt_s == pytest.approx(0.01)   # all three decode together from 4p on
    small = _stepped(requests, 2048, colocated=colocated)
    assert [o.ttft_s for o in small.outcomes] == pytest.approx([p, 3 * p, 3 * p, 4 * p])
    assert all(o.tbt_s > 0 for o in big.outcomes + small.outcomes)


def test_a_step_delay_moves_when_the_prefix_is_ready_and_a_single_token_finish() -> None:
    """A queued prompt that shares its step with a later one has its blocks computed at
    that step's end: the one after them that reuses its prefix starts no earlier. A
    single-token request finishes with its (later) first token."""
    p = FLAT.prefill_s(1024)
    requests = [_req(0, (1, 2)), _req(0, (3, 4), output=1), _req(0, (5, 6))]
    (_, b, c) = _stepped(requests, 8192).outcomes
    assert b.ttft_s == pytest.approx(3 * p) and c.ttft_s == pytest.approx(3 * p)
    cluster = ClusterConfig(num_prefill=1, num_decode=1, cost=FLAT, prefill_step_tokens=8192)
    from mooncake_plugins.conductor.sim import _Replay
    replay = _Replay(requests, LoadBalancePolicy(FLAT), cluster, SLO, 1.0)
    replay.run(None)
    assert replay.caches[0].prefix((3, 4)) == (2, pytest.approx(3 * p))
    assert replay.finish[1] == pytest.approx(3 * p)


def test_back_to_back_prefills_never_step_a_colocated_batch_backwards() -> None:
    """A span two back-to-back prefills cover has no decode stepping: exactly 0, not
    the -2.8e-17 its float arithmetic gave, which once moved a batch's step count back,
    unsorted its join list and crashed a replay (IndexError) in conductor_bench."""
    from mooncake_plugins.conductor.sim import _Replay
    cluster = ClusterConfig(num_prefill=1, num_decode=1, cost=FLAT, colocated=True)
    replay = _Replay([_req(0, (1, 2))], RoundRobinPolicy(FLAT), cluster, SLO, 1.0)
    replay.prefills[0].extend([(0.14412841961525394, 0.37756124510907396),
                               (0.37756124510907396, 0.5422092011553494)])
    assert replay._stepping_s(0, 0.15, 0.43244389712449915) == 0.0
    assert replay._stepping_s(0, 0.1, 0.6) == pytest.approx(0.5 - (0.5422092011553494
                                                                   - 0.14412841961525394))


def test_a_prompt_that_waits_for_a_slot_shares_no_step_with_those_before() -> None:
    """One slot: A decodes 100 steps; B waits for A's last token, C for B's. C starts
    after a gap, so B's first token does not wait for C's tokens."""
    requests = [_req(0, (1, 2), output=101), _req(0, (3, 4), output=2),
                _req(0, (5, 6), output=2)]
    p = FLAT.prefill_s(1024)
    a, b, c = _stepped(requests, 8192, colocated=True, decode_max_batch=1).outcomes
    assert b.ttft_s == pytest.approx(p + 1.0 + p)
    assert c.ttft_s == pytest.approx(b.ttft_s + 0.01 + p)


def test_prefill_steps_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="prefill_step_tokens"):
        ClusterConfig(prefill_step_tokens=-1)


def test_a_prompt_delayed_by_its_step_holds_its_slot_until_then() -> None:
    """Three slots: A decodes; B (one decode step) and C wait and share a step, so both
    hold a slot until 3p. D, arriving at 2.5p, finds no slot free before B's step after
    3p (not at once, as if B had joined its batch at 2p)."""
    p = FLAT.prefill_s(1024)
    requests = [_req(0, (1, 2), output=101), _req(0, (3, 4), output=2),
                _req(0, (5, 6), output=101), _req(2.5 * p * 1e3, (7, 8), output=2)]
    a, b, c, d = _stepped(requests, 8192, colocated=True, decode_max_batch=3).outcomes
    assert b.ttft_s == pytest.approx(3 * p) and c.ttft_s == pytest.approx(3 * p)
    assert d.ttft_s == pytest.approx(3 * p + 0.01 + p - 2.5 * p)


def test_a_request_whose_step_ends_later_joins_its_decode_batch_once_then() -> None:
    """P/D, a decode batch of three: A decodes 100 steps from p. B and C share their
    prefill step with D, so they join at 4p (not at 2p and 3p as first planned) and take
    the two free places at once; D waits for A's last token."""
    p = FLAT.prefill_s(1024)
    requests = [_req(0, (2 * i + 1, 2 * i + 2), output=101) for i in range(4)]
    a, b, c, d = _stepped(requests, 8192, decode_max_batch=3).outcomes
    assert [o.ttft_s for o in (b, c, d)] == pytest.approx([4 * p] * 3)
    assert b.tbt_s == pytest.approx(0.01) and c.tbt_s == pytest.approx(0.01)
    assert d.tbt_s == pytest.approx(0.01 + (p + 1.0 - 4 * p) / 100)


def test_a_prompt_that_started_shares_no_step_with_later_arrivals() -> None:
    """A, B and C arrive together (B and C share a step: both first at 3p); D arrives
    at 1.5p, when B has started: D's tokens join C's step, not B's."""
    p = FLAT.prefill_s(1024)
    requests = [_req(0, (2 * i + 1, 2 * i + 2), output=11) for i in range(3)]
    requests.append(_req(1.5 * p * 1e3, (7, 8), output=11))
    a, b, c, d = _stepped(requests, 8192).outcomes
    assert [o.ttft_s for o in (a, b, c, d)] == pytest.approx([p, 3 * p, 4 * p, 2.5 * p])


# ---- prefill steps: properties over random traces -----------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mooncake_plugins.conductor.policies import RoundRobinPolicy  # noqa: E402

_traces = st.lists(
    st.tuples(st.integers(0, 400),                       # ms after the previous arrival
              st.integers(1, 6),                         # blocks of 512 tokens
              st.integers(1, 30),                        # output tokens
              st.integers(0, 3)),                        # prefix family (0: unique)
    min_size=1, max_size=25)


def _trace(spec: list[tuple[int, int, int, int]]) -> list[TraceRequest]:
    out, ts = [], 0
    for i, (gap, blocks, output, family) in enumerate(spec):
        ts += gap
        ids = tuple((family * 1000 if family else 10_000 + 100 * i) + b for b in range(blocks))
        out.append(_req(ts, ids, output=output))
    return out


def _outcomes(requests, steps: int, **config) -> list[tuple[float, float]]:
    """(TTFT, TBT) of each request; and every decode instance ends the replay empty, with
    nothing still counted as on its way to it (each request joined once)."""
    from mooncake_plugins.conductor.sim import _Replay

    cluster = ClusterConfig(cost=FLAT, prefill_step_tokens=steps, **config)
    replay = _Replay(requests, RoundRobinPolicy(FLAT), cluster, SLO, 1.0)
    replay.run(None)
    for d in replay.decodes:
        assert (d.running, list(d.waiting), d.incoming, d.pending_input) == ([], [], 0, 0)
    result = replay.result(0.0, keep_outcomes=True)
    return [(o.ttft_s, o.tbt_s) for o in result.outcomes]


@settings(max_examples=150, deadline=None)
@given(_traces, st.booleans(), st.integers(1, 3), st.integers(1, 4),
       st.sampled_from([512, 2048, 8192]))
def test_steps_lose_no_request_and_steps_of_one_token_change_nothing(
        spec, colocated: bool, prefill: int, batch: int, steps: int) -> None:
    """Any trace, any cluster: with prefill steps every request gets its first token and,
    with more than one, every later one (a JOIN moved is joined once); steps of one
    token share nothing, so they give what one prompt after the other gives."""
    requests = _trace(spec)
    config = {"num_prefill": prefill, "num_decode": 2, "decode_max_batch": batch,
              "colocated": colocated}
    alone = _outcomes(requests, 0, **config)
    assert _outcomes(requests, 1, **config) == alone
    for request, (ttft, tbt) in zip(requests, _outcomes(requests, steps, **config)):
        assert math.isfinite(ttft) and ttft > 0
        if request.output_length > 1:
            assert math.isfinite(tbt) and tbt >= 0.01 - 1e-9


@settings(max_examples=150, deadline=None)
@given(_traces, st.integers(1, 3), st.sampled_from([512, 2048, 8192, 1 << 30]))
def test_steps_only_delay_first_tokens_and_never_the_newest_on_an_instance(
        spec, prefill: int, steps: int) -> None:
    """P/D, round robin (decisions that do not depend on the replay): a step shared with
    later prompts makes a first token later, never earlier; the last request on each
    instance has no later prompt in its step, so its first token does not move."""
    requests = _trace(spec)
    config = {"num_prefill": prefill, "num_decode": 1, "decode_max_batch": 64}
    alone = _outcomes(requests, 0, **config)
    stepped = _outcomes(requests, steps, **config)
    for (ttft0, _), (ttft, _) in zip(alone, stepped):
        assert ttft >= ttft0 - 1e-9
    for instance in range(prefill):
        last = max(range(instance, len(requests), prefill), default=None)
        if last is not None:
            assert stepped[last][0] == pytest.approx(alone[last][0])
