"""vLLM's in-tree ``MooncakeStoreConnector``, unchanged, on our drop-in ``mooncake`` package:
a fresh engine loads the prompt another engine saved and answers as an engine without a
connector does.
"""

from __future__ import annotations

import json

import mooncake.store
import pytest
from engines import FULL_BLOCK_TOKENS, run_engine, same_answer

pytestmark = pytest.mark.slow

INTREE_STORE = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute"}


def test_drop_in_is_ours():
    assert mooncake.store.__file__.startswith(str(__import__("pathlib").Path(
        __file__).resolve().parents[3])), "the venv's `mooncake` must be this repository's"


def test_intree_store_connector_runs_on_the_drop_in(store, tiny_llama, baseline, tmp_path):
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({
        "metadata_server": "P2PHANDSHAKE", "master_server_address": store.address,
        "protocol": "tcp", "device_name": "", "mode": "standalone-store",
        "global_segment_size": 0, "local_buffer_size": "64MB"}))
    env = {"MOONCAKE_CONFIG_PATH": str(config)}
    (first,), _ = run_engine(tiny_llama, tmp_path, "first", INTREE_STORE, env)
    assert first["num_cached_tokens"] == 0
    same_answer(first, baseline[0])
    (second,), _ = run_engine(tiny_llama, tmp_path, "second", INTREE_STORE, env)
    assert second["num_cached_tokens"] >= 0.9 * FULL_BLOCK_TOKENS
    same_answer(second, baseline[0])
