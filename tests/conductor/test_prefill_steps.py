"""vLLM's prefill steps (--max-num-batched-tokens), as the router and simulator price them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mooncake_plugins.conductor.prefill_steps import queue_at, step_delays


@dataclass
class Prompt:
    tokens: int
    prefill_s: float
    counted: int = 0
    at: int = 0


def _join(queue: list[Prompt], prompt: Prompt, step: int) -> dict[int, float]:
    """``prompt`` joins ``queue``: the delays it causes, by position."""
    prompt.at = queue_at(queue)
    queue.append(prompt)
    out = {}
    for q, counted, delay in step_delays(queue, step):
        q.counted = counted
        out[queue.index(q)] = delay
    return out


def test_prompts_in_one_step_wait_for_the_later_ones_in_it() -> None:
    # three 1792-token prompts of 0.1 s each: 8192 holds all three in one step, so the
    # first waits for the other two and the second for the third
    queue: list[Prompt] = []
    assert _join(queue, Prompt(1792, 0.1), 8192) == {}
    assert _join(queue, Prompt(1792, 0.1), 8192) == pytest.approx({0: 0.1})
    assert _join(queue, Prompt(1792, 0.1), 8192) == pytest.approx({0: 0.1, 1: 0.1})
    assert [q.counted for q in queue] == [3584, 1792, 0]
    assert step_delays(queue, 8192) == []   # nothing new: nothing moves
    # 2048: a step holds one prompt's end and the next one's start (chunked)
    queue = []
    _join(queue, Prompt(1792, 0.1), 2048)
    assert _join(queue, Prompt(1792, 0.1), 2048) == pytest.approx({0: 0.1 * 256 / 1792})
    assert _join(queue, Prompt(1792, 0.1), 2048) == pytest.approx({1: 0.1 * 512 / 1792})


def test_a_later_prompt_counts_only_its_tokens_in_the_step() -> None:
    # 1000 + 3000 tokens in steps of 2048: the first's step holds 1048 of the second's
    # 3000 tokens (its time spread evenly over them); a cached prompt (no tokens) adds
    # none, and waits for the same tokens
    queue: list[Prompt] = []
    _join(queue, Prompt(1000, 0.1), 2048)
    _join(queue, Prompt(0, 0.02), 2048)
    assert _join(queue, Prompt(3000, 0.3), 2048) == pytest.approx(
        {0: 0.3 * 1048 / 3000, 1: 0.3 * 1048 / 3000})
    assert step_delays([], 2048) == []


def test_steps_before_the_newest_prompts_first_step_are_not_looked_at() -> None:
    # a queue of 1000 prompts of 100 tokens in steps of 1000 (left with nothing counted):
    # only the prompts of the newest one's first step can share a step with it, so a
    # long queue costs no more than a short one
    queue = [Prompt(100, 0.01, at=100 * i) for i in range(1000)]
    assert _join(queue, Prompt(100, 0.01), 1000) == {}   # it starts a step of its own
    assert _join(queue, Prompt(100, 0.01), 1000) == pytest.approx({1000: 0.01})


def test_a_step_of_no_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="step_tokens"):
        step_delays([Prompt(1, 0.1)], 0)
