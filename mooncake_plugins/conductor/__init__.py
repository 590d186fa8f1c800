"""The Conductor: Mooncake's KVCache-centric global scheduler and its trace-replay simulator.

- :mod:`.traces`: loader and validator of the open Mooncake JSONL traces (plain or gzipped);
  the two open traces ship, gzipped, in ``data/`` (:func:`.traces.bundled_trace`).
- :mod:`.costmodel`: prefill, decode-step and KV-transfer times (defaults: a 70B-class
  model on 8 GPUs, as in the Mooncake paper).
- :mod:`.policies`: scheduling policies behind one ``choose(request, view)`` interface,
  usable by the simulator and by a request proxy alike.
- :mod:`.prefill_steps`: vLLM's prefill steps (``--max-num-batched-tokens``), priced
  alike by the simulator and the router.
- :mod:`.sim`: discrete-event replay of a trace on N prefill + M decode instances with
  LRU block caches and an optional global pool; hit rate, TTFT/TBT, SLO attainment and
  effective request capacity.
"""

from .costmodel import CostModel
from .policies import (POLICY_NAMES, POOL, CacheAwarePolicy, ClusterView, ConductorPolicy,
                       Decision, DecodeForecast, LoadBalancePolicy, Policy, PrefixHit,
                       RandomPolicy, Slo, make_policy)
from .sim import (CapacityResult, ClusterConfig, LruBlockCache, Percentiles, RequestOutcome,
                  SimResult, find_capacity, simulate)
from .traces import (BLOCK_TOKENS, BUNDLED_TRACES, TraceRequest, bundled_trace, iter_trace,
                     load_trace)

__all__ = [
    "BLOCK_TOKENS", "BUNDLED_TRACES", "CacheAwarePolicy", "CapacityResult", "ClusterConfig",
    "ClusterView", "ConductorPolicy", "CostModel", "Decision", "DecodeForecast",
    "LoadBalancePolicy", "LruBlockCache", "POLICY_NAMES", "POOL", "Percentiles", "Policy",
    "PrefixHit", "RandomPolicy", "RequestOutcome", "SimResult", "Slo", "TraceRequest",
    "bundled_trace", "find_capacity", "iter_trace", "load_trace", "make_policy", "simulate",
]
