"""Replays of the open Mooncake traces: sane invariants, and the Conductor beats random.

The whole traces ship gzipped with the package (``mooncake_plugins/conductor/data``), and
the samples in ``data/`` here (their first 500 requests) with the tests, so every test runs
from a plain clone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mooncake_plugins.conductor.policies import POLICY_NAMES, Slo, make_policy
from mooncake_plugins.conductor.sim import ClusterConfig, SimResult, simulate
from mooncake_plugins.conductor.traces import TraceRequest, bundled_trace, load_trace

SAMPLES_DIR = Path(__file__).resolve().parent / "data"
SAMPLE_NAMES = ("conversation_trace_head500.jsonl", "synthetic_trace_head500.jsonl")
CLUSTER = ClusterConfig()
SLO = Slo()

_loaded: dict[str, list[TraceRequest]] = {}


def _trace(name: str) -> list[TraceRequest]:
    """A sample of ``data/`` (``*_head500.jsonl``) or a whole bundled trace (its bare name)."""
    if name not in _loaded:
        _loaded[name] = load_trace(SAMPLES_DIR / name if name in SAMPLE_NAMES
                                   else bundled_trace(name))
    return _loaded[name]


def _replay(name: str, policy: str, rate_scale: float = 1.0) -> SimResult:
    return simulate(_trace(name), make_policy(policy, CLUSTER.cost, SLO), CLUSTER, SLO,
                    rate_scale=rate_scale, keep_outcomes=True)


def _reuse_bound(requests: list[TraceRequest], result: SimResult) -> float:
    """Best possible hit rate over the served requests: each distinct block is computed once."""
    assert result.outcomes is not None
    served = [r for r, o in zip(requests, result.outcomes) if o.prefill >= 0]
    total = sum(len(r.hash_ids) for r in served)
    distinct = len({block for r in served for block in r.hash_ids})
    return 1 - distinct / total


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_replay_invariants(name: str, policy: str) -> None:
    requests = _trace(name)
    result = _replay(name, policy)
    assert result.requests == len(requests) == result.served + result.rejected
    assert 0.0 <= result.local_hit_rate <= result.hit_rate <= _reuse_bound(requests, result) + 1e-12
    assert result.ttft.p50 <= result.ttft.p90 <= result.ttft.p99
    assert result.outcomes is not None
    served_ttft = [o.ttft_s for o in result.outcomes if o.prefill >= 0]
    expected = np.percentile(served_ttft, [50, 90, 99])
    assert [result.ttft.p50, result.ttft.p90, result.ttft.p99] == pytest.approx(expected)
    assert result.tbt.p50 <= result.tbt.p90 <= result.tbt.p99
    assert 0.0 < result.ttft.p50 and 0.0 < result.tbt.p50
    for attainment in (result.ttft_attainment, result.tbt_attainment):
        assert result.slo_attainment <= attainment <= 1.0
    assert result.slo_attainment <= result.served / result.requests
    assert result.makespan_s > 0.0
    if policy != "conductor":
        assert result.rejected == 0 and result.pulled_blocks == 0


def test_conductor_beats_random_under_load() -> None:
    # at twice the rate the 500 requests already overload the cluster for random placement
    random = _replay("conversation_trace_head500.jsonl", "random", rate_scale=2.0)
    conductor = _replay("conversation_trace_head500.jsonl", "conductor", rate_scale=2.0)
    assert conductor.slo_attainment > 0.9 > 0.6 > random.slo_attainment
    assert conductor.hit_rate > random.hit_rate


@pytest.mark.parametrize(("name", "count"), [("conversation_trace", 12_031),
                                             ("synthetic_trace", 3_993)])
def test_samples_are_the_heads_of_the_bundled_traces(name: str, count: int) -> None:
    whole = _trace(name)
    assert len(whole) == count
    assert _trace(f"{name}_head500.jsonl") == whole[:500]


def test_conductor_beats_random_under_load_whole_trace() -> None:
    # at twice the trace's rate the cluster is overloaded for every policy
    random = _replay("conversation_trace", "random", rate_scale=2.0)
    conductor = _replay("conversation_trace", "conductor", rate_scale=2.0)
    assert conductor.slo_attainment >= random.slo_attainment
    assert conductor.slo_attainment > 0.9 > 0.1 > random.slo_attainment
    assert conductor.hit_rate > random.hit_rate


def test_full_conversation_replay_is_fast() -> None:
    result = _replay("conversation_trace", "conductor")
    assert result.wall_s < 20.0
