"""Where the store connector's transfer threads run, and so how it loads: layer by layer
only when vLLM left a core free of compute threads."""

from __future__ import annotations

import pytest
from vllm.platforms import current_platform

from mooncake_vllm.store_worker import kv_cores, omp_cores


@pytest.mark.parametrize("env,cores", [
    ({"GOMP_CPU_AFFINITY": "0 1 2-3"}, {0, 1, 2, 3}),
    ({"OMP_PLACES": "{0,1,2}"}, {0, 1, 2}),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[4,5,7]"}, {4, 5, 7}),
    ({"OMP_PLACES": "{0:4}"}, None),          # a form vLLM does not write: not guessed
    ({}, None),
])
def test_omp_cores_reads_each_runtime_binding(env, cores):
    assert omp_cores(env) == cores


@pytest.mark.parametrize("topology,binding,ranks,expect", [
    ([[0, 1, 2, 3]], "{0,1,2}", "auto", ([3], True)),              # vLLM reserved core 3
    ([[0, 1, 2, 3]], "{0,1,2,3}", "auto", ([0, 1, 2, 3], False)),  # none to spare
    ([[0, 1], [2, 3]], "{0,2}", "auto", ([1, 3], True)),           # last core of each node
    ([[0, 1], [2, 3]], "{0,1,2}", "auto", ([3], True)),
    ([[0, 1]], "{0}", "0|1", ([0, 1], False)),     # TP=2 on two cores: rank 1 computes on 1
    ([[0, 1, 2]], "{0}", "0|1", ([2], True)),
])
def test_kv_cores_are_free_only_when_no_compute_thread_is_bound_there(
        monkeypatch, topology, binding, ranks, expect):
    for var in ("KMP_AFFINITY", "GOMP_CPU_AFFINITY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMP_PLACES", binding)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", ranks)
    monkeypatch.setattr(current_platform, "discover_numa_topology", lambda: topology)
    assert kv_cores() == expect
