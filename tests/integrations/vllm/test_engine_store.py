"""Real vLLM CPU engines in their own processes, with our store connector.

One sequence over three engines started side by side (engine starts are most of this
test's time), each used in turn; every answer must equal an engine's without a connector:

* the engines start while no master answers: engine A serves by computing and says why;
  once the store is up it picks it up on its own and saves the prompt's blocks;
* engine B, fresh (vLLM's own prefix cache is empty), loads them (at least 90% of the
  prompt's full blocks);
* the store evicts them while B runs: B computes the prompt again and saves it back;
* the holder of the blocks is killed: engine C (which never read from it) finds them
  listed but cannot read them, recomputes, and says so; then the master stops: C
  computes, and says why.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np
import pytest
from engines import FULL_BLOCK_TOKENS, PROMPT_LEN, EngineSpec, engines_running, same_answer
from framework_fixtures import running_store
from harness import store_config
from helpers import unclaimable_port, wait_until
from run_llm import prompt_tokens

from mooncake_plugins.store.client import StoreClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RETRY_S = 5.0             # StoreLink: the least time between two connection attempts
HOLDER_SEGMENT = 64 << 20
PROMPT_BLOCKS = FULL_BLOCK_TOKENS // 128   # the blocks a prompt saves (CPU block size 128)


def ours(address: str) -> dict:
    return {"kv_connector": "MooncakePluginsStoreConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": store_config(address)}


def objects(address: str) -> int:
    """Complete objects in the store."""
    with StoreClient(address, global_segment_size=0) as c:
        return c.stats()["objects"]


def evict_everything(address: str) -> int:
    """Fill the store past its capacity with other objects, then remove those: every
    object that was there before is evicted (LRU). Returns how many the master evicted."""
    filler = np.ones(1 << 20, dtype=np.uint8)
    with StoreClient(address, global_segment_size=0) as c:
        before = c.stats()["evicted"]
        for i in range(0, 3 * (HOLDER_SEGMENT >> 20) // 2, 8):
            keys = [f"filler/{i + j}" for j in range(8)]
            assert c.batch_put(keys, [filler] * 8) == [None] * 8
        c.remove_by_regex("^filler/", force=True)
        return c.stats()["evicted"] - before


def test_store_connector_end_to_end_and_under_faults(tiny_llama, baseline, tmp_path):
    p0, p1 = prompt_tokens(PROMPT_LEN, 0), prompt_tokens(PROMPT_LEN, 1)
    # the master comes up on this port after engine A started; 1 s read leases, so that
    # blocks B read a moment ago may be evicted; a killed holder's objects stay listed
    port = unclaimable_port()
    address = f"127.0.0.1:{port}"
    flags = ["--rpc_port", str(port), "--default_kv_lease_ttl", "1000", "--client_ttl", "300"]
    # each in vLLM's own three processes: C re-saves what it recomputes, and only an engine
    # core that steps by itself frees a finished request's blocks once their saves are done
    # (in one process, nothing steps between two generate calls)
    specs = [EngineSpec("a", ours(address), "0"), EngineSpec("b", ours(address), "1"),
             EngineSpec("c", ours(address), "0")]
    with engines_running(tiny_llama, tmp_path, specs) as (a, b, c), \
            contextlib.ExitStack() as stack:
        got = a.generate(p1)
        down_since = time.monotonic()
        assert got["num_cached_tokens"] == 0
        same_answer(got, baseline[1])
        assert "unreachable" in a.log_text()

        store = stack.enter_context(running_store(flags, segment=HOLDER_SEGMENT))
        time.sleep(max(0.0, down_since + RETRY_S + 0.5 - time.monotonic()))
        got = a.generate(p0)            # A reconnects by itself, computes p0 and saves it
        same_answer(got, baseline[0])
        assert wait_until(lambda: objects(address) == PROMPT_BLOCKS, 30), \
            "A saved the prompt's full blocks"

        got = b.generate(p0)
        assert got["num_cached_tokens"] >= 0.9 * FULL_BLOCK_TOKENS
        same_answer(got, baseline[0])

        # evicted mid-run: B computes the prompt again, and saves it back
        time.sleep(1.2)                 # B's read leases end
        assert evict_everything(address) >= PROMPT_BLOCKS
        assert objects(address) == 0
        b.reset_prefix_cache()
        got = b.generate(p0)
        assert got["num_cached_tokens"] == 0
        same_answer(got, baseline[0])
        assert wait_until(lambda: objects(address) == PROMPT_BLOCKS, 30)

        # the holder dies: C finds the blocks listed but cannot read them; vLLM recomputes
        os.killpg(store.holder.proc.pid, signal.SIGKILL)
        store.holder.proc.wait()
        got = c.generate(p0)
        same_answer(got, baseline[0])
        log = c.log_text()
        assert "not loaded" in log and "recomputes" in log

        # the master stops: every lookup fails, C computes and says why
        store.stop_master()
        c.reset_prefix_cache()
        got = c.generate(p0)
        assert got["num_cached_tokens"] == 0
        same_answer(got, baseline[0])
        assert "store lookup failed" in c.log_text()
