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
from harness import store_config

pytestmark = pytest.mark.slow


def ours(address: str) -> dict:
    return {"kv_connector": "MooncakePluginsStoreConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": store_config(address)}


# The master keeps a silent client's objects listed for 5 minutes, so after the holder is
# killed the next engine still finds the blocks and its loads fail. One sequence, so that
# the five engine starts (about 40 s each here) are not multiplied per fault.
@pytest.mark.master_flags("--client_ttl", "300")
def test_store_connector_end_to_end_and_under_faults(store, tiny_llama, baseline, tmp_path):
    (first,), _ = run_engine(tiny_llama, tmp_path, "first", ours(store.address))
    assert first["num_cached_tokens"] == 0
    same_answer(first, baseline[0])

    # a fresh process (vLLM's own prefix cache is empty) loads every full prompt block
    (second,), _ = run_engine(tiny_llama, tmp_path, "second", ours(store.address))
    assert second["num_cached_tokens"] >= 0.9 * FULL_BLOCK_TOKENS
    same_answer(second, baseline[0])

    # the holder dies: the bytes are gone, the index not yet; loads fail, vLLM recomputes
    os.killpg(store.holder.proc.pid, signal.SIGKILL)
    store.holder.proc.wait()
    (third,), log = run_engine(tiny_llama, tmp_path, "third", ours(store.address))
    same_answer(third, baseline[0])
    assert "not loaded" in log and "recomputes" in log

    # the master is down: every lookup misses, the engine computes and says why
    store.stop_master()
    (fourth,), log = run_engine(tiny_llama, tmp_path, "fourth", ours(store.address))
    assert fourth["num_cached_tokens"] == 0
    same_answer(fourth, baseline[0])
    assert "unreachable" in log
