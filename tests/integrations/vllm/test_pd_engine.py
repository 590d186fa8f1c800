"""Disaggregated prefill end to end: a prefill and a decode vLLM engine (CPU), each in
its own process, and the example proxy's routing function between them.

The decode side's greedy tokens and logprobs must equal a single engine's (``run_llm.py``
without a connector); a prefill killed before the transfer must leave the decode able
to answer by computing the prompt itself. Two engines share this 2-core machine: each
is bound to its own core, and they start side by side.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from engines import (PROMPT_LEN, SAMPLING, Engine, EngineSpec, engines_running, kill_engine,
                     same_answer)
from run_llm import prompt_tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from vllm_pd_proxy import disaggregated_generate, prefill_request  # noqa: E402

BLOCK_NBYTES = 2 * 2 * 64 * 2 * 128 * 4   # layers x kv heads x head dim x K,V x 128 x fp32

pytestmark = pytest.mark.timeout(600)


@dataclass
class Setup:
    baseline: list[dict[str, Any]]   # the session's no-connector engine, two prompts
    prefill: Engine
    decode: Engine


def _spec(name: str, core: str, role: str) -> EngineSpec:
    return EngineSpec(name, {"kv_connector": "MooncakePluginsPDConnector", "kv_role": role,
                             "kv_load_failure_policy": "recompute",
                             "kv_connector_extra_config": {"pull_wait_s": 20,
                                                           "transfer_timeout_s": 20}}, core)


@pytest.fixture(scope="module")
def setup(tiny_llama, baseline, tmp_path_factory) -> Iterator[Setup]:
    specs = [_spec("decode", "1", "kv_consumer"), _spec("prefill", "0", "kv_producer")]
    with engines_running(tiny_llama, tmp_path_factory.mktemp("pd-engines"),
                         specs) as (decode, prefill):
        yield Setup(baseline, prefill, decode)


def test_decode_generates_from_the_prefills_kv(setup):
    prompt = prompt_tokens(PROMPT_LEN, 0)
    got = disaggregated_generate(setup.prefill.generate, setup.decode.generate, prompt,
                                 SAMPLING)
    same_answer(got, setup.baseline[0])
    assert got["num_cached_tokens"] == PROMPT_LEN, "the transferred prompt counts as cached"
    sent = re.findall(r"wrote (\d+) blocks \((\d+) bytes\)", setup.prefill.log.read_text())
    received = re.findall(r"received (\d+) blocks \((\d+) bytes\)",
                          setup.decode.log.read_text())
    assert sent == received == [("6", str(6 * BLOCK_NBYTES))]


def test_a_prefill_killed_before_the_transfer_leaves_decode_computing(setup):
    prompt = prompt_tokens(PROMPT_LEN, 1)
    params = prefill_request(setup.prefill.generate, prompt, SAMPLING)
    assert params is not None and params["do_remote_prefill"]
    kill_engine(setup.prefill.child.proc)
    got = setup.decode.generate(prompt, SAMPLING, params)
    same_answer(got, setup.baseline[1])
    assert "not received" in setup.decode.log.read_text()
    assert got["num_cached_tokens"] == 0, "nothing was received: all of it was computed"
