"""What a vLLM engine reports of its own load on ``/metrics``: the requests it runs and
holds waiting, and the mean prompt and output lengths of those it finished. The router
counts what exceeds its own requests there as external load (requests from clients that
bypass it, or from another router): :meth:`.instances.Instance.observe_engine`. The page
also gives the engine's KV block size (``vllm:cache_config_info``), which the router's
prefix hashes must share."""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PROMPT = "vllm:request_prompt_tokens"
OUTPUT = "vllm:request_generation_tokens"
CACHE_CONFIG = "vllm:cache_config_info"
_SAMPLES = (RUNNING, WAITING, f"{PROMPT}_sum", f"{PROMPT}_count", f"{OUTPUT}_sum",
            f"{OUTPUT}_count", CACHE_CONFIG)


@dataclass(frozen=True)
class EngineLoad:
    """An engine's counts, summed over its label sets (data-parallel ranks, models)."""

    running: int
    waiting: int
    mean_prompt_tokens: float | None = None
    """Mean prompt length of the requests it finished; None before the first."""
    mean_output_tokens: float | None = None
    """Mean output length of the requests it finished; None before the first."""
    block_size: int | None = None
    """Tokens per KV block (its ``--block-size``); None where the page does not say."""


def parse_engine_load(page: str) -> EngineLoad | None:
    """The load in ``page``, a Prometheus text page from a vLLM server; None where it has
    no ``vllm:num_requests_running`` (not a vLLM engine). ValueError: a malformed line
    among those read (:func:`_read_lines`; the others are not looked at), or a count
    that is negative or not finite."""
    sums: dict[str, float] = {}
    block_size = None
    for family in text_string_to_metric_families(_read_lines(page)):
        for sample in family.samples:
            if sample.name == CACHE_CONFIG and block_size is None:
                size = sample.labels.get("block_size", "")
                block_size = int(size) if size.isdigit() and int(size) > 0 else None
            if sample.name in (RUNNING, WAITING, f"{PROMPT}_sum", f"{PROMPT}_count",
                               f"{OUTPUT}_sum", f"{OUTPUT}_count"):
                if not (math.isfinite(sample.value) and sample.value >= 0):
                    raise ValueError(f"{sample.name} is {sample.value}")
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    if RUNNING not in sums:
        return None

    def mean(name: str) -> float | None:
        count = sums.get(f"{name}_count", 0.0)
        return sums.get(f"{name}_sum", 0.0) / count if count else None

    return EngineLoad(round(sums[RUNNING]), round(sums.get(WAITING, 0.0)), mean(PROMPT),
                      mean(OUTPUT), block_size)


def _read_lines(page: str) -> str:
    """The lines of ``page`` that start with the name of a sample read here. A vLLM
    page has hundreds of lines, mostly histogram buckets: parsed whole, one of 614 lines
    took 24-28 ms on this project's 2-core VM, while the router's event loop, which
    forwards every stream, waited. Fed only these lines the parser reads the same
    samples (a family's type and help lines are not needed for them) in about 1 ms."""
    lines = [line for line in page.splitlines() if line.startswith(_SAMPLES)]
    return "\n".join(lines) + "\n" if lines else ""
