"""Real vLLM CPU engines in their own processes, with our store connector: a fresh engine
loads a prompt's blocks another engine saved and answers exactly as an engine without a
connector; with the store's master down, or the holder of the blocks killed, it still
answers the same (recomputing) and says why in its log.
"""

from __future__ import annotations

import os
import signal

import pytest
from engines import FULL_BLOCK_TOKENS, run_engine, same_answer

from conftest import store_config

pytestmark = pytest.mark.slow


def ours(address: str) -> dict:
    return {"kv_connector": "MooncakePluginsStoreConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": store_config(address)}


def test_fresh_engine_loads_the_prompt_from_the_store(store, tiny_llama, baseline, tmp_path):
    first, _ = run_engine(tiny_llama, tmp_path, "first", ours(store.address))
    assert first["num_cached_tokens"] == 0
    same_answer(first, baseline)
    second, _ = run_engine(tiny_llama, tmp_path, "second", ours(store.address))
    # every full block of the prompt came from the store (a fresh process: vLLM's own
    # prefix cache is empty)
    assert second["num_cached_tokens"] >= 0.9 * FULL_BLOCK_TOKENS
    same_answer(second, baseline)


def test_engine_serves_with_the_master_down(store, tiny_llama, baseline, tmp_path):
    run_engine(tiny_llama, tmp_path, "first", ours(store.address))
    store.stop_master()
    second, log = run_engine(tiny_llama, tmp_path, "second", ours(store.address))
    assert second["num_cached_tokens"] == 0
    same_answer(second, baseline)
    assert "unreachable" in log


# the master keeps a silent client's objects listed for 5 minutes: the next engine finds
# them, and its loads fail
@pytest.mark.master_flags("--client_ttl", "300")
def test_engine_recomputes_when_the_holder_is_killed(store, tiny_llama, baseline, tmp_path):
    run_engine(tiny_llama, tmp_path, "first", ours(store.address))
    os.killpg(store.holder.proc.pid, signal.SIGKILL)   # the bytes are gone, the index not yet
    store.holder.proc.wait()
    second, log = run_engine(tiny_llama, tmp_path, "second", ours(store.address))
    same_answer(second, baseline)
    assert "not loaded" in log and "recomputes" in log
