"""The store connector under vLLM's own Scheduler and Requests, with a live store.

Each "engine" is vLLM's scheduler plus our worker-side connector over a CPU KV cache
(:mod:`harness`); the store is a real master and a holder process.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
from harness import BLOCK, MiniEngine, store_config
from vllm.v1.request import RequestStatus

from mooncake_plugins.errors import StoreTransferFailed
from mooncake_plugins.store.client import StoreClient

PROMPT = [(i * 37) % 1000 + 3 for i in range(100)]   # 6 full blocks and 4 tokens


def saved_blocks(engine: MiniEngine) -> list[int]:
    return [len(job.block_ids) for meta in engine.metas for job in meta.saves]


def resaved(engine: MiniEngine) -> list[tuple[int, bool]]:
    """Each save job's (blocks, whether it replaces stored copies)."""
    return [(len(job.block_ids), job.replace) for meta in engine.metas for job in meta.saves]


def objects(store) -> int:
    with StoreClient(store.address, global_segment_size=0) as c:
        return c.stats()["objects"]


def test_a_fresh_engine_loads_the_prefix_another_one_saved(store, engines):
    a = engines(store_config(store.address))
    a.add("a", PROMPT)
    a.run()
    # chunked prefill (64 tokens a step): 4 full blocks after step 1, 2 more after step 2
    assert saved_blocks(a) == [4, 2]
    assert a.connector.get_num_new_matched_tokens(_request("x", PROMPT), 0) == (96, False)

    b = engines(store_config(store.address))
    b.add("b", PROMPT)
    out = b.step()
    assert out.num_scheduled_tokens == {"b": 4}, "96 of 100 prompt tokens come from the store"
    (load,) = b.metas[0].loads
    assert len(load.block_ids) == 6
    for i, block in enumerate(load.block_ids):
        assert b.block_ok(block, PROMPT[i * BLOCK:(i + 1) * BLOCK], i * BLOCK)
    b.run()
    assert saved_blocks(b) == [], "blocks already in the store are not saved again"
    stats = [o.kv_connector_output.kv_connector_stats for o in b.outputs]
    loaded = sum(s.data["bytes_loaded"] for s in stats if s is not None)
    assert loaded == 6 * 2 * BLOCK * 2 * 4   # 6 blocks x 2 layers x 16 slots x 2 floats


def _request(req_id, prompt):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(request_id=req_id, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def test_partial_prefix_hits_and_other_deployments_miss(store, engines):
    a = engines(store_config(store.address))
    a.add("a", PROMPT)
    a.run()
    b = engines(store_config(store.address))
    diverging = PROMPT[:3 * BLOCK] + [5] * 52
    assert b.connector.get_num_new_matched_tokens(_request("d", diverging), 0) == (48, False)
    # vLLM's own prefix cache already has 2 blocks: only the rest is external
    assert b.connector.get_num_new_matched_tokens(_request("d", diverging), 32) == (16, False)
    other = engines(store_config(store.address, key_prefix="other-deployment/"))
    assert other.connector.get_num_new_matched_tokens(_request("o", PROMPT), 0) == (0, False)


def test_whole_prompt_in_store_still_computes_its_last_token(store, engines):
    prompt = PROMPT[:6 * BLOCK]     # exactly 6 blocks: the 6th holds the token to sample from
    a = engines(store_config(store.address))
    a.add("a", prompt)
    a.run()
    b = engines(store_config(store.address))
    assert b.connector.get_num_new_matched_tokens(_request("b", prompt), 0) == (80, False)


def test_an_aborted_request_keeps_its_blocks_until_saved(store, engines):
    a = engines(store_config(store.address))
    a.add("a", PROMPT)
    a.step()                                   # 64 tokens computed, 4 blocks being saved
    a.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert "a" in a.scheduler.requests, "freeing waits for the worker's saves"
    a.run()
    assert saved_blocks(a) == [4]
    with StoreClient(store.address, global_segment_size=0) as c:
        keys = a.worker._worker._keys.keys(a.metas[0].saves[0].block_hashes, 0)
        assert c.batch_exists(keys) == [True] * 4


def test_preempted_requests_saves_finish_before_their_blocks_are_reused(store, engines):
    # 11 usable blocks; two requests that grow to 8 blocks each: one gets preempted
    a = engines(store_config(store.address), num_blocks=12, batch_tokens=128)
    waited = []
    worker = a.worker._worker
    original = worker.handle_preemptions

    def checked(meta):
        original(meta)
        for r in meta.preempted:
            waited.append(all(f.done() for f in worker._saves.get(r, ())))

    worker.handle_preemptions = checked
    a.add("x", PROMPT[:64], max_tokens=60)
    a.add("y", [9] * 64, max_tokens=60)
    a.run()
    assert any(m.preempted for m in a.metas), "the scenario must preempt"
    assert waited and all(waited)
    b = engines(store_config(store.address))
    assert b.connector.get_num_new_matched_tokens(_request("y2", [9] * 64 + [1]), 0) == (64, False)


def test_master_down_serves_by_computing(store, engines, caplog):
    a = engines(store_config(store.address))
    a.add("a", PROMPT)
    a.run()
    store.stop_master()
    b = engines(store_config(store.address))
    with caplog.at_level(logging.WARNING):
        b.add("b", PROMPT)
        out = b.step()
        assert out.num_scheduled_tokens == {"b": 64}, "nothing external: computed from scratch"
        b.run()
    assert "unreachable" in caplog.text


def test_blocks_lost_after_lookup_are_recomputed(store, engines, caplog):
    a = engines(store_config(store.address))
    a.add("a", PROMPT)
    a.run()
    b = engines(store_config(store.address))
    lookup = b.connector._scheduler.get_num_new_matched_tokens

    def lookup_then_evict(request, num_computed):
        result = lookup(request, num_computed)
        with StoreClient(store.address, global_segment_size=0) as c:
            c.remove_all(force=True)            # gone between lookup and load
        return result

    b.connector._scheduler.get_num_new_matched_tokens = lookup_then_evict
    b.add("b", PROMPT)
    with caplog.at_level(logging.WARNING):
        b.step()                                # loads fail: reported as invalid blocks
        b.connector._scheduler.get_num_new_matched_tokens = lookup
        b.run()
    assert "not loaded" in caplog.text and "Recovered from KV load failure" in caplog.text
    (load,) = b.metas[0].loads
    assert b.outputs[0].kv_connector_output.invalid_block_ids == set(load.block_ids)
    for i, block in enumerate(load.block_ids):
        assert b.block_ok(block, PROMPT[i * BLOCK:(i + 1) * BLOCK], i * BLOCK), \
            "recomputed blocks hold the computed values"
    # recomputed from block 0 (64 tokens a step), and saved back
    assert resaved(b) == [(4, True), (2, True)]
    assert b.stat("blocks_saved") == 6 and objects(store) == 6


def _loading_engine(store, engines, **extra):
    """Engine "a" saved PROMPT; a fresh engine "b" (``extra`` settings) is about to load
    its 6 blocks."""
    a = engines(store_config(store.address))
    a.add("a", PROMPT)
    a.run()
    b = engines(store_config(store.address, **extra))
    worker = b.worker._worker
    return b, worker, worker._client()


def test_layers_are_waited_for_one_by_one_and_a_failed_layer_fails_only_its_blocks(
        store, engines):
    b, worker, client = _loading_engine(store, engines, load_mode="layerwise")
    layer_nbytes = worker._layout.layer_nbytes
    calls = {"locate": 0, "reads": []}
    layer1_may_read = threading.Event()
    real_locate, real_reads = client.locate, client.batch_get_ranges_into

    def locate(keys):
        calls["locate"] += 1
        return real_locate(keys)

    def reads(located, ranges):
        layer = ranges[0][1] // layer_nbytes
        calls["reads"].append(layer)
        if layer == 0:   # slow: waiting for layer 0 must really wait
            time.sleep(0.3)
        if layer == 1:   # held back until the forward pass has computed layer 0
            assert layer1_may_read.wait(10)
        got = real_reads(located, ranges)
        if layer == 1:   # a transport error on blocks 1 and 4 of the load, this layer only
            got = [StoreTransferFailed("injected") if j in (1, 4) else r
                   for (j, _, _), r in zip(ranges, got)]
        return got

    layer1_read_pending = []
    landed = {}          # layer -> its loaded bytes were in place when its wait returned
    real_wait = worker.wait_for_layer_load

    def wait_for_layer_load(name):
        if name == "layer.1":
            layer1_read_pending.append(not layer1_may_read.is_set())
            layer1_may_read.set()
        real_wait(name)
        if not b.metas[-1].loads:
            return
        (job,) = b.metas[-1].loads
        landed[name] = all(b.block_ok(block, PROMPT[i * BLOCK:(i + 1) * BLOCK], i * BLOCK,
                                      [name])
                           for i, block in enumerate(job.block_ids)
                           if name == "layer.0" or i not in (1, 4))

    client.locate, client.batch_get_ranges_into = locate, reads
    worker.wait_for_layer_load = wait_for_layer_load
    b.add("b", PROMPT)
    b.step()
    assert layer1_read_pending == [True], "layer 0 was computed while layer 1 was being read"
    assert landed == {"layer.0": True, "layer.1": True}, "each wait ends when its layer is in"
    assert calls == {"locate": 1, "reads": [0, 1]}, "one lookup, then one read per layer"
    (load,) = b.metas[0].loads
    bad = {load.block_ids[1], load.block_ids[4]}
    assert b.outputs[0].kv_connector_output.invalid_block_ids == bad
    assert b.stat("blocks_loaded") == 4 and b.stat("load_errors") == 2
    for i, block in enumerate(load.block_ids):
        if block not in bad:
            assert b.block_ok(block, PROMPT[i * BLOCK:(i + 1) * BLOCK], i * BLOCK)
    b.run()
    for i, block in enumerate(load.block_ids):
        assert b.block_ok(block, PROMPT[i * BLOCK:(i + 1) * BLOCK], i * BLOCK), \
            "failed blocks are recomputed (all their layers)"
    # the stored copies of blocks 1..5 stay listed (the reads failed, not the objects):
    # the recomputed blocks replace them, none is refused as already there
    assert resaved(b) == [(4, True), (1, True)]
    assert b.stat("blocks_saved") == 5 and b.stat("save_errors") == 0


@pytest.mark.master_flags("--default_kv_lease_ttl", "300")
def test_a_lease_that_runs_out_between_layers_fails_every_block_of_the_load(
        store, engines, caplog):
    b, worker, client = _loading_engine(store, engines, load_mode="layerwise")
    layer_nbytes = worker._layout.layer_nbytes
    real_reads = client.batch_get_ranges_into

    def slow_reads(located, ranges):
        if ranges[0][1] // layer_nbytes == 1:
            time.sleep(0.5)   # layer 1 is read after the objects' read lease ran out
        return real_reads(located, ranges)

    client.batch_get_ranges_into = slow_reads
    with caplog.at_level(logging.WARNING):
        b.add("b", PROMPT)
        b.step()
        b.run()
    (load,) = b.metas[0].loads
    assert b.outputs[0].kv_connector_output.invalid_block_ids == set(load.block_ids)
    assert "outlived its lease" in caplog.text and "not loaded" in caplog.text
    assert b.stat("blocks_loaded") == 0
    for i, block in enumerate(load.block_ids):
        assert b.block_ok(block, PROMPT[i * BLOCK:(i + 1) * BLOCK], i * BLOCK)


def test_whole_loads_read_every_layer_at_once_before_the_first_layer(store, engines):
    b, worker, client = _loading_engine(store, engines, load_mode="whole")
    calls = {"locate": 0, "reads": []}
    real_locate, real_reads = client.locate, client.batch_get_ranges_into

    def locate(keys):
        calls["locate"] += 1
        return real_locate(keys)

    def reads(located, ranges):
        calls["reads"].append(sorted({offset for _, offset, _ in ranges}))
        time.sleep(0.3)   # slow: the first layer's wait must really wait
        got = real_reads(located, ranges)
        return [StoreTransferFailed("injected") if j in (1, 4) else r
                for (j, _, _), r in zip(ranges, got)]

    landed = {}          # layer -> every layer's bytes were in place when its wait returned
    real_wait = worker.wait_for_layer_load

    def wait_for_layer_load(name):
        real_wait(name)
        if b.metas[-1].loads:
            (job,) = b.metas[-1].loads
            landed[name] = all(b.block_ok(block, PROMPT[i * BLOCK:(i + 1) * BLOCK], i * BLOCK)
                               for i, block in enumerate(job.block_ids) if i not in (1, 4))

    client.locate, client.batch_get_ranges_into = locate, reads
    worker.wait_for_layer_load = wait_for_layer_load
    b.add("b", PROMPT)
    b.step()
    assert calls == {"locate": 1, "reads": [[0]]}, "one lookup, one read of whole objects"
    assert landed == {"layer.0": True, "layer.1": True}
    (load,) = b.metas[0].loads
    bad = {load.block_ids[1], load.block_ids[4]}
    assert b.outputs[0].kv_connector_output.invalid_block_ids == bad
    assert b.stat("blocks_loaded") == 4 and b.stat("load_errors") == 2
    b.run()
    for i, block in enumerate(load.block_ids):
        assert b.block_ok(block, PROMPT[i * BLOCK:(i + 1) * BLOCK], i * BLOCK)
    assert resaved(b) == [(4, True), (1, True)]
