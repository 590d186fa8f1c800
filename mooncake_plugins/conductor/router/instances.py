"""The instances behind the router, their roles and what the router knows of their load.

An instance is a vLLM OpenAI server: ``both`` (prefill and decode, an ordinary engine),
``prefill`` (a P/D producer) or ``decode`` (a P/D consumer). The router learns each one's
load from what it has in flight there (requests waiting for their first token, requests
decoding), plus what the engine's own metrics count beyond that (external load: requests
that did not come through this router), and its cache from the prompts it routed there
(block ids, least recently used dropped past ``cache_blocks``). Instances are added,
drained (no new requests; those in flight finish) and removed at run time; a failed
request or health check takes one out until its ``/health`` answers again.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..prefill_steps import queue_at, step_delays
from .engine_load import EngineLoad
from .measured_ratio import BOUNDS, MeasuredRatio

ROLES = ("both", "prefill", "decode")
OVERDUE_MIN_S = 0.05
"""A request waiting for its first token counts as evidence of a slower instance only
where the model gave it at least this long (shorter ones are mostly HTTP overhead)."""
DEFAULT_OUTPUT_TOKENS = 256
"""Tokens a request is expected to decode when its client set no ``max_tokens``."""
UNKNOWN_PROMPT_TOKENS = 1024
"""An external request (one the engine holds that the router did not send) is priced as
a prompt of the engine's mean finished prompt length; of this many tokens before the
engine finished any."""


@dataclass
class _Flight:
    started_s: float
    prefill_s: float          # predicted prefill time (queue excluded)
    context_tokens: int
    hash_ids: tuple[int, ...] = ()
    first_token: bool = False
    output_tokens: int = DEFAULT_OUTPUT_TOKENS   # its max_tokens, where the client set one
    model_ttft_s: float = 0.0   # the cost model's TTFT estimate, before correction
    expected_ttft_s: float = 0.0   # the estimate the request was admitted on
    timed: bool = False         # streamed: its first answer byte is its first token, and
                                # teaches the TTFT ratio
    tokens: int = 0             # prompt tokens it computes (not cached)
    counted: int = 0            # later prompts' tokens counted in its last prefill step
    at: int = 0                 # prompt tokens queued before it (see .prefill_steps)


@dataclass
class Instance:
    """One engine and what the router knows of it."""

    url: str
    role: str = "both"
    kv_events: str | None = None
    """ZMQ endpoint of the engine's KV events (``tcp://host:port``), when it publishes them."""
    healthy: bool = True
    draining: bool = False
    failures: int = 0
    slow_checks: int = 0   # health checks in a row that timed out
    flights: dict[int, _Flight] = field(default_factory=dict)
    decoding: dict[int, int] = field(default_factory=dict)   # request -> context tokens
    decode_ends: dict[int, float] = field(default_factory=dict)   # request -> last token at
    joining: dict[int, tuple[float, float, int]] = field(default_factory=dict)
    """P/D decode side: requests still prefilling elsewhere -> (predicted first token,
    predicted last token, context tokens): they take a slot here only from their first
    token on."""
    blocks: OrderedDict[int, float] = field(default_factory=OrderedDict)  # id -> ready at
    ttft: MeasuredRatio = field(default_factory=MeasuredRatio)
    """Measured / model time to first token of streamed requests prefilled here (P/D:
    to the decode's first token)."""
    tbt: MeasuredRatio = field(default_factory=MeasuredRatio)
    """Measured / model decode time (streamed answers, first token to last)."""
    external_waiting: int = 0
    """Requests the engine last reported waiting beyond the router's own."""
    external_running: int = 0
    """Requests the engine last reported running beyond the router's own."""
    external_prefill_s: float = 0.0   # model prefill time of one external request
    external_context: int = 0          # its context tokens
    external_output: int = DEFAULT_OUTPUT_TOKENS   # tokens it decodes
    external_seen_s: float = 0.0       # when the engine's counts were read (Pool.now)
    block_size: int | None = None
    """The engine's KV block size, as its metrics last said (None: not said)."""

    def observe_engine(self, load: EngineLoad | None,
                       prefill_s: Callable[[int], float], now: float) -> None:
        """Take the engine's own counts, read at ``now`` (None: it gave none, so no
        external load): what exceeds the router's requests there is external load,
        counted as waiting first; each external request is priced like the engine's mean
        finished one (:data:`UNKNOWN_PROMPT_TOKENS` before it finished any),
        ``prefill_s`` giving the model's prefill time of a prompt of so many tokens."""
        self.external_seen_s = now
        if load is not None and load.block_size is not None:
            self.block_size = load.block_size
        if load is None:
            self.external_waiting = self.external_running = 0
            return
        own = len(self.flights.keys() | self.decoding.keys())
        external = max(0, load.running + load.waiting - own)
        self.external_waiting = min(load.waiting, external)
        self.external_running = external - self.external_waiting
        self.external_context = max(1, round(load.mean_prompt_tokens or UNKNOWN_PROMPT_TOKENS))
        self.external_prefill_s = prefill_s(self.external_context)
        self.external_output = max(1, round(load.mean_output_tokens or DEFAULT_OUTPUT_TOKENS))

    def external_end_s(self, step_s: float) -> float:
        """When the external requests the engine ran at its last reading are taken to
        end: half their mean output (on average half done) at ``step_s`` a token after
        that reading. Until the next reading they age like the router's own requests."""
        return self.external_seen_s + self.external_output / 2 * step_s

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining

    def queue_s(self, now: float, ratio: float = 1.0) -> float:
        """Seconds of prefill ahead of a new request, in the cost model's time: the
        predicted prefill time of every request still waiting for its first token, less
        what has run since the oldest came; an instance ``ratio`` times slower than the
        model got through ``1 / ratio`` of the model's work a second. External
        requests waiting at the engine's last reading go first: their prefill, less what
        has run since that reading; the router's own start after them."""
        left = max(0.0, self._external_prefill_s - (now - self.external_seen_s) / ratio)
        waiting = self._waiting()
        if not waiting:
            return left
        start = self._chain_start_s(waiting[0], ratio)
        return left + max(0.0, sum(f.prefill_s for f in waiting) - max(0.0, now - start) / ratio)

    @property
    def _external_prefill_s(self) -> float:
        """Model prefill time of the external requests waiting at the last reading."""
        return self.external_waiting * self.external_prefill_s

    def _waiting(self) -> list[_Flight]:
        """The router's requests here still waiting for their first token, oldest first."""
        return sorted((f for f in self.flights.values() if not f.first_token),
                      key=lambda f: f.started_s)

    def _chain_start_s(self, oldest: _Flight, ratio: float) -> float:
        """When the router's waiting requests start to prefill, one after the other: as
        the oldest came, but not before the external ones waiting at the last reading
        are through (``ratio`` times the model's time after it)."""
        external = self._external_prefill_s
        if not external:
            return oldest.started_s
        return max(oldest.started_s, self.external_seen_s + external * ratio)

    def batch_prefills(self, step_tokens: int, now: float, ratio: float = 1.0) -> None:
        """vLLM prefills what waits in steps of up to ``step_tokens`` tokens (its
        ``--max-num-batched-tokens``), first come first served, the last prompt of a step
        chunked; a prompt's first token comes at the end of the step that holds its last
        token, so the prompts that came after it and fill that step delay it. After a
        request joined: each request waiting here that has not started (in the queue
        order of :meth:`queue_s`, one after the other at ``ratio`` times the model's
        time) and shares its last step with the new one (steps as
        :mod:`~mooncake_plugins.conductor.prefill_steps` counts them) has its expected
        TTFT moved later by the model's time for the new tokens in that step, which keeps
        the TTFT ratio learned from it and the overdue rule of :meth:`ttft_ratio` true
        to what the model predicts."""
        waiting = self._waiting()
        if len(waiting) < 2:
            return
        t = self._chain_start_s(waiting[0], ratio)
        future = []   # not started: they are prefilled in steps after the current one
        for f in waiting:
            t = max(t, f.started_s)
            if t > now or f is waiting[-1]:
                future.append(f)
            t += f.prefill_s * ratio
        future[-1].at = queue_at(future[:-1])
        for f, counted, delay in step_delays(future, step_tokens):
            f.counted = counted
            f.model_ttft_s += delay
            f.expected_ttft_s += delay * ratio

    def slot_wait_s(self, now: float, slots: int, step_s: float, ratio: float = 1.0
                    ) -> float:
        """Seconds until one of ``slots`` (vLLM's ``--max-num-seqs``) is free for a new
        request on an engine that prefills and decodes. Decoding requests end when
        predicted (not before ``now``: they have not ended yet); each request waiting
        for its first token took the first slot free from when it came (external ones:
        from the engine's last reading, ahead of the router's own), prefills ``ratio``
        times the model's time after the one before it and holds the slot for
        ``output_tokens`` steps of ``step_s``: so what ran since is not counted again,
        as in :meth:`queue_s`, but no prefill ends before ``now`` (its first token has
        not come). External requests running hold a slot until
        :meth:`external_end_s`."""
        ends = [max(now, end) for end in (
            *self.decode_ends.values(),
            *[self.external_end_s(step_s)] * self.external_running)]
        heapq.heapify(ends)
        queued = [(self.external_seen_s, self.external_prefill_s, self.external_output)
                  ] * self.external_waiting
        queued += [(f.started_s, f.prefill_s, f.output_tokens) for f in self._waiting()]
        prefill_free = 0.0
        for came, prefill_s, output_tokens in queued:
            start = max(came, heapq.heappop(ends)) if len(ends) >= slots else came
            prefill_free = max(now, max(start, prefill_free) + prefill_s * ratio)
            heapq.heappush(ends, prefill_free + (output_tokens - 1) * step_s)
        return max(0.0, ends[0] - now) if len(ends) >= slots else 0.0

    def ttft_ratio(self, now: float) -> float:
        """Measured / model TTFT to expect here now: the learned ratio, or more where a
        timed request still waiting for its first token is already later than the
        learned ratio predicts (its lateness bounds the ratio from below before its
        answer comes: in a burst no answer comes back before the next decisions)."""
        ratio = self.ttft.ratio
        for f in self.flights.values():
            if f.timed and not f.first_token and f.model_ttft_s >= OVERDUE_MIN_S:
                ratio = max(ratio, (now - f.started_s) / f.model_ttft_s)
        return min(ratio, BOUNDS[1])

    def prefix(self, hash_ids: Iterable[int]) -> tuple[int, float]:
        """Leading blocks of ``hash_ids`` this instance holds, and when the last is ready."""
        count, ready = 0, 0.0
        for h in hash_ids:
            at = self.blocks.get(h)
            if at is None:
                break
            count, ready = count + 1, max(ready, at)
        return count, ready

    def learn(self, hash_ids: Iterable[int], ready_s: float, capacity: int) -> None:
        for h in hash_ids:
            self.blocks[h] = min(self.blocks.get(h, ready_s), ready_s)
            self.blocks.move_to_end(h)
        while len(self.blocks) > capacity:
            self.blocks.popitem(last=False)

    def describe(self) -> dict:
        return {"url": self.url, "role": self.role, "kv_events": self.kv_events,
                "healthy": self.healthy,
                "draining": self.draining, "in_flight": len(self.flights),
                "decoding": len(self.decoding), "cached_blocks": len(self.blocks),
                "external_running": self.external_running,
                "external_waiting": self.external_waiting, "block_size": self.block_size,
                "ttft_ratio": round(self.ttft.ratio, 3), "ttft_samples": self.ttft.samples,
                "tbt_ratio": round(self.tbt.ratio, 3), "tbt_samples": self.tbt.samples}


class Pool:
    """The instances, by URL, in the order they were added."""

    def __init__(self, cache_blocks: int = 1 << 20) -> None:
        self.cache_blocks = cache_blocks
        self._by_url: dict[str, Instance] = {}

    def add(self, url: str, role: str = "both", kv_events: str | None = None) -> Instance:
        """Add (or re-add, undraining) the instance at ``url``; ValueError on bad input."""
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"instance URL {url!r} must start with http:// or https://")
        if role not in ROLES:
            raise ValueError(f"instance role {role!r} must be one of {', '.join(ROLES)}")
        if kv_events is not None and (not isinstance(kv_events, str)
                                      or not kv_events.startswith(("tcp://", "ipc://"))):
            raise ValueError(f"KV events endpoint {kv_events!r} must be tcp://host:port or "
                             f"ipc://path")
        inst = self._by_url.get(url)
        if inst is None:
            inst = self._by_url[url] = Instance(url, role)
        inst.role, inst.draining = role, False
        inst.kv_events = kv_events or inst.kv_events
        return inst

    def get(self, url: str) -> Instance:
        inst = self._by_url.get(url.rstrip("/"))
        if inst is None:
            raise KeyError(f"no instance {url!r}")
        return inst

    def drain(self, url: str) -> Instance:
        inst = self.get(url)
        inst.draining = True
        return inst

    def remove(self, url: str) -> Instance:
        return self._by_url.pop(self.get(url).url)

    def __iter__(self):
        return iter(list(self._by_url.values()))

    def __len__(self) -> int:
        return len(self._by_url)

    def disaggregated(self) -> bool:
        """Whether prefill and decode run on different instances (any P/D role present)."""
        return any(i.role != "both" for i in self._by_url.values())

    def prefill_side(self) -> list[Instance]:
        return [i for i in self if i.usable and i.role in ("both", "prefill")]

    def decode_side(self) -> list[Instance]:
        if not self.disaggregated():
            return self.prefill_side()
        return [i for i in self if i.usable and i.role in ("both", "decode")]

    @staticmethod
    def now() -> float:
        return time.monotonic()
