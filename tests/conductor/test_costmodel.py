"""Cost model: shape of prefill, decode and transfer costs."""

from __future__ import annotations

import pytest

from mooncake_plugins.conductor.costmodel import CostModel
from mooncake_plugins.errors import InvalidArgument


def test_cached_prefix_costs_only_the_suffix() -> None:
    cost = CostModel()
    for cached in (0, 512, 4096, 8000):
        assert cost.prefill_s(8192, cached) == pytest.approx(cost.prefill_s(8192 - cached))


def test_fully_cached_prompt_costs_the_fixed_overhead() -> None:
    cost = CostModel()
    assert cost.prefill_s(4096, 4096) == cost.prefill_fixed_s


def test_prefill_is_quadratic_plus_linear() -> None:
    cost = CostModel(prefill_fixed_s=0.0, prefill_s_per_token=2e-4, prefill_s_per_token_sq=1e-9)
    assert cost.prefill_s(1000) == pytest.approx(2e-4 * 1000 + 1e-9 * 1000 ** 2)
    assert cost.prefill_s(64_000) > 2 * cost.prefill_s(32_000)


def test_prefill_rejects_impossible_cache() -> None:
    with pytest.raises(InvalidArgument):
        CostModel().prefill_s(100, 101)
    with pytest.raises(InvalidArgument):
        CostModel().prefill_s(100, -1)


def test_decode_step_grows_with_batch_and_context() -> None:
    cost = CostModel()
    assert cost.decode_step_s(1, 1000) < cost.decode_step_s(32, 1000)
    assert cost.decode_step_s(32, 1000) < cost.decode_step_s(32, 10**6)
    assert cost.decode_step_s(0, 0) == cost.decode_fixed_s


def test_transfer_time_from_bandwidth() -> None:
    cost = CostModel(kv_bytes_per_token=1000, transfer_bytes_per_s=1e6, transfer_latency_s=0.5)
    assert cost.kv_transfer_s(0) == 0.0
    assert cost.kv_transfer_s(2000) == pytest.approx(0.5 + 2.0)
    assert cost.kv_nbytes(3) == 3000


def test_default_kv_size_matches_70b_gqa() -> None:
    # 2 (K, V) x 80 layers x 8 KV heads x 128 dims x 2 bytes
    assert CostModel().kv_bytes_per_token == 2 * 80 * 8 * 128 * 2


def test_negative_or_zero_bandwidth_is_refused() -> None:
    with pytest.raises(InvalidArgument):
        CostModel(prefill_s_per_token=-1.0)
    with pytest.raises(InvalidArgument):
        CostModel(transfer_bytes_per_s=0.0)
