"""vLLM's prefill steps: what a prompt's first token waits for besides the prompts ahead.

vLLM prefills the prompts waiting at an instance first come first served, in steps of up
to ``--max-num-batched-tokens`` tokens; the last prompt of a step is chunked and goes on
in the next. A prompt's first token comes at the end of the step that holds its last
token, so the prompts that came after it and fill that step delay it, while the newest
prompt gets its first token when it would have one after the other. The router
(:meth:`~.router.instances.Instance.batch_prefills`) and the simulator
(``ClusterConfig.prefill_step_tokens``) price it with :func:`step_delays`.

The steps of a queue are counted from its first prompt: one that came while another
prefilled and found no other waiting (that one is taken to prefill alone in its steps).
They do not move as the prompts ahead start: a step once planned keeps its prompts.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class Queued(Protocol):
    """A prompt waiting to prefill, none of it started."""

    tokens: int        # prompt tokens it computes (not cached)
    prefill_s: float   # its prefill time alone
    counted: int       # later prompts' tokens already counted in its last step
    at: int            # prompt tokens queued before it since its queue's first prompt


def queue_at(queue: Sequence[Queued]) -> int:
    """The ``at`` of a prompt joining ``queue`` (its prompts not started, in order)."""
    return queue[-1].at + queue[-1].tokens if queue else 0


def step_delays(queue: Sequence[Queued], step_tokens: int
                ) -> list[tuple[Queued, int, float]]:
    """The newest prompt (``queue[-1]``) joined: for each earlier prompt whose last step
    holds some of its tokens, ``(prompt, counted, delay)``: the later prompts' tokens in
    that step, and the prefill time of those not yet ``counted`` (each later prompt's
    time spread evenly over its tokens). Its first token comes ``delay`` later than one
    prompt after the other predicts. Only the prompts of the newest one's first step are
    looked at, so a long queue costs no more than a short one."""
    if step_tokens < 1:
        raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
    if not queue:
        return []
    new = queue[-1]
    step_start = new.at // step_tokens * step_tokens
    tail: list[Queued] = []
    for q in reversed(queue):
        if q is not new and q.at + q.tokens <= step_start:
            break
        tail.append(q)
    tail.reverse()
    total = new.at + new.tokens
    out = []
    for i, q in enumerate(tail[:-1]):
        end = q.at + q.tokens
        extra = min(-(-end // step_tokens) * step_tokens, total) - end
        if extra <= q.counted:
            continue
        lo, hi, delay = end + q.counted, end + extra, 0.0
        for later in tail[i + 1:]:
            overlap = min(hi, later.at + later.tokens) - max(lo, later.at)
            if overlap > 0:   # a prompt of no tokens has no overlap
                delay += later.prefill_s * overlap / later.tokens
            if later.at + later.tokens >= hi:
                break
        out.append((q, extra, delay))
    return out
