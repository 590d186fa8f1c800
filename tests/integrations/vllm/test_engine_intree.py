"""vLLM's in-tree ``MooncakeStoreConnector``, unchanged, on our drop-in ``mooncake`` package:
a fresh engine loads the prompt another engine saved and answers as an engine without a
connector does. Both engines start side by side; the second one serves only after the
first has quit (its connector's saves are done then).
"""

from __future__ import annotations

import json
from pathlib import Path

import mooncake.store
import pytest
from engines import FULL_BLOCK_TOKENS, PROMPT_LEN, EngineSpec, engines_running, same_answer
from run_llm import prompt_tokens

pytestmark = pytest.mark.slow

INTREE_STORE = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute"}


def test_drop_in_is_ours():
    assert mooncake.store.__file__.startswith(str(Path(__file__).resolve().parents[3])), \
        "the venv's `mooncake` must be this repository's"


def test_intree_store_connector_runs_on_the_drop_in(store, tiny_llama, baseline, tmp_path):
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({
        "metadata_server": "P2PHANDSHAKE", "master_server_address": store.address,
        "protocol": "tcp", "device_name": "", "mode": "standalone-store",
        "global_segment_size": 0, "local_buffer_size": "64MB"}))
    env = {"MOONCAKE_CONFIG_PATH": str(config)}
    prompt = prompt_tokens(PROMPT_LEN, 0)
    specs = [EngineSpec("first", INTREE_STORE, "0", env), EngineSpec("second", INTREE_STORE,
                                                                     "1", env)]
    with engines_running(tiny_llama, tmp_path, specs) as (first, second):
        got = first.generate(prompt)
        assert got["num_cached_tokens"] == 0
        same_answer(got, baseline[0])
        first.close()
        got = second.generate(prompt)
        assert got["num_cached_tokens"] >= 0.9 * FULL_BLOCK_TOKENS
        same_answer(got, baseline[0])
