"""vLLM's in-tree P/D ``MooncakeConnector``, unchanged, on our drop-in ``mooncake.engine``:
a prefill engine and a decode engine in two processes hand a prompt's KV over (the
prefill writes it into the decode's KV cache with ``batch_transfer_sync_write``), and the
decode answers as a single engine does.

On CPU torch the connector's worker needs one test-only shim (``cpu_accelerator/``, see
its docstring); the connector itself runs as shipped.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Iterator

import pytest
from engines import (MAX_TOKENS, PROMPT_LEN, SAMPLING, Engine, EngineSpec, engines_running,
                     same_answer)
from helpers import unclaimable_port
from run_llm import prompt_tokens

HERE = Path(__file__).resolve().parent
PREFILL_ENGINE_ID = "intree-prefill"

pytestmark = pytest.mark.timeout(600)


def _spec(name: str, core: str, role: str, bootstrap: int) -> EngineSpec:
    kv = {"kv_connector": "MooncakeConnector", "kv_role": role,
          "kv_load_failure_policy": "recompute", "engine_id": f"intree-{name}",
          "kv_connector_extra_config": {"mooncake_protocol": "tcp", "num_workers": 2}}
    path = ":".join(filter(None, [str(HERE / "cpu_accelerator"), os.environ.get("PYTHONPATH")]))
    return EngineSpec(name, kv, core, {"PYTHONPATH": path,
                                       "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap)})


@pytest.fixture(scope="module")
def engines(tiny_llama, tmp_path_factory) -> Iterator[tuple[Engine, Engine, int]]:
    bootstrap = unclaimable_port()
    specs = [_spec("decode", "1", "kv_consumer", bootstrap),
             _spec("prefill", "0", "kv_producer", bootstrap)]
    with engines_running(tiny_llama, tmp_path_factory.mktemp("pd-intree"),
                         specs) as (decode, prefill):
        yield prefill, decode, bootstrap


def test_intree_pd_connector_runs_on_the_drop_in(engines, baseline):
    prefill, decode, bootstrap = engines
    prompt = prompt_tokens(PROMPT_LEN, 0)
    transfer_id = uuid.uuid4().hex
    prefill.generate(prompt, {**SAMPLING, "max_tokens": 1},
                     {"do_remote_decode": True, "transfer_id": transfer_id})
    got = decode.generate(prompt, SAMPLING, {
        "do_remote_prefill": True, "remote_engine_id": PREFILL_ENGINE_ID,
        "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap}", "transfer_id": transfer_id})
    same_answer(got, baseline[0])
    assert got["num_cached_tokens"] >= PROMPT_LEN - 128, "the prompt's KV came from the prefill"
    assert len(got["tokens"]) == MAX_TOKENS
