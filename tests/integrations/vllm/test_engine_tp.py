"""Tensor parallelism end to end: vLLM CPU engines of two workers each (TP=2, one worker
per core) with our store connector.

Store: each rank saves its own half of every block's KV under its own key (``tp{r}of2``);
a fresh TP=2 engine loads both halves; a block counts as a hit only when every rank has
it. Engine A computes the prompt (its answer is the TP=2 computation; it must agree with
the single-worker baseline); engine B, fresh, must load the prompt's full blocks and
answer exactly as A did.
"""

from __future__ import annotations

import pytest
from engines import FULL_BLOCK_TOKENS, PROMPT_LEN, EngineSpec, engines_running, same_answer
from harness import store_config
from helpers import wait_until
from run_llm import prompt_tokens

from mooncake_plugins.store.client import StoreClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT_BLOCKS = FULL_BLOCK_TOKENS // 128   # CPU block size 128
TP = 2


def close_to(got: dict, want: dict) -> None:
    """Equal tokens, logprobs close: two workers reduce in another order than one."""
    assert got["tokens"] == want["tokens"]
    assert max(abs(x - y) for x, y in zip(got["logprobs"], want["logprobs"])) < 1e-3


def objects(address: str) -> int:
    with StoreClient(address, global_segment_size=0) as c:
        return c.stats()["objects"]


def remove_rank(address: str, rank: int) -> int:
    """Remove every block object of TP rank ``rank``; how many there were."""
    with StoreClient(address, global_segment_size=0) as c:
        return c.remove_by_regex(f"/tp{rank}of{TP}/", force=True)


def test_tp2_store_connector_saves_each_rank_and_loads_both(tiny_llama, baseline, store,
                                                            tmp_path):
    kv = {"kv_connector": "MooncakePluginsStoreConnector", "kv_role": "kv_both",
          "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": store_config(store.address)}
    specs = [EngineSpec("tp-a", kv, "0|1", tp=TP), EngineSpec("tp-b", kv, "0|1", tp=TP)]
    p0 = prompt_tokens(PROMPT_LEN, 0)
    with engines_running(tiny_llama, tmp_path, specs) as (a, b):
        computed = a.generate(p0)
        assert computed["num_cached_tokens"] == 0
        close_to(computed, baseline[0])
        assert wait_until(lambda: objects(store.address) == TP * PROMPT_BLOCKS, 30), \
            "each of A's two ranks saved the prompt's full blocks"
        for rank in range(TP):
            assert f"worker {rank}" in a.log_text()

        got = b.generate(p0)
        assert got["num_cached_tokens"] >= 0.9 * FULL_BLOCK_TOKENS
        same_answer(got, computed)

        # one rank's half gone: no block is a hit any more, B computes and saves it again
        assert remove_rank(store.address, 1) == PROMPT_BLOCKS
        b.reset_prefix_cache()
        got = b.generate(p0)
        assert got["num_cached_tokens"] == 0
        same_answer(got, computed)
        assert wait_until(lambda: objects(store.address) == TP * PROMPT_BLOCKS, 30), \
            "B's rank 1 saved its half back"
        assert remove_rank(store.address, 0) == PROMPT_BLOCKS
        assert remove_rank(store.address, 1) == PROMPT_BLOCKS

