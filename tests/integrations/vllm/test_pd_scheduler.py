"""The P/D connector under vLLM's own Scheduler: a prefill and a decode engine in one
process (:mod:`pd_harness`), moving KV over the real transfer engine and side channel."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import msgpack
import pytest
from harness import BLOCK
from pd_harness import PDEngine
from vllm.v1.request import RequestStatus

from mooncake_plugins.errors import TransferError
from mooncake_vllm.config import PDSettings, from_extra_config
from mooncake_vllm.pd_channel import ProtocolError, Pull, ask, parse_pull

PROMPT = [(i * 37) % 1000 + 3 for i in range(100)]   # 6 full blocks and 4 tokens
NBLOCKS = 7
BLOCK_NBYTES = 2 * BLOCK * 2 * 4                     # 2 layers x 16 slots x 2 floats


@pytest.fixture
def pd(tiny_llama_config):
    made: list[PDEngine] = []

    def make(role: str, **kw) -> PDEngine:
        e = PDEngine(tiny_llama_config, role, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def prefill(p: PDEngine, req_id: str, tid: str, prompt=PROMPT) -> dict | None:
    """Run a prefill request until it finished; the params it hands to the decode."""
    p.add_pd(req_id, prompt, {"do_remote_decode": True, "transfer_id": tid}, max_tokens=1)
    for _ in range(10):
        p.step()
        if req_id in p.answers:
            return p.answers[req_id]
    raise AssertionError("the prefill did not finish")


def step_until(engine: PDEngine, cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        if not engine.step().num_scheduled_tokens:
            time.sleep(0.01)


def holds_prompt(e: PDEngine, req_id: str, prompt=PROMPT) -> bool:
    """The request's blocks hold the values computing ``prompt`` writes."""
    ids = e.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
    full = len(prompt) // BLOCK
    return all(e.block_ok(ids[i], prompt[i * BLOCK:(i + 1) * BLOCK], i * BLOCK)
               for i in range(full))


def recompute(d: PDEngine) -> list[int]:
    """Run the decode's request "d" to the end; the prompt tokens of each step, checking
    the blocks then hold computed values."""
    computed = []
    while "d" in d.scheduler.requests:
        out = d.step()
        req = d.scheduler.requests.get("d")
        if req is not None and req.num_computed_tokens < req.num_prompt_tokens + 1:
            computed.append(out.num_scheduled_tokens.get("d", 0))
            if req.num_computed_tokens >= req.num_prompt_tokens:
                assert holds_prompt(d, "d"), "recomputed blocks hold the computed values"
    return computed


def pull_parked(monkeypatch, p: PDEngine) -> threading.Event:
    """Set once a pull served by ``p``'s worker waits for its transfer to be handed over."""
    worker = p.worker._worker
    parked = threading.Event()
    real_wait = worker._cond.wait

    def wait(timeout=None):
        parked.set()   # called with the lock held: the pull releases it by waiting
        return real_wait(timeout)

    monkeypatch.setattr(worker._cond, "wait", wait)
    return parked


def test_decode_waits_for_the_prefills_kv_then_computes_one_token(pd, caplog, monkeypatch):
    p, d = pd("kv_producer"), pd("kv_consumer")
    parked = pull_parked(monkeypatch, p)
    params = prefill(p, "p", "t1")
    assert params["do_remote_prefill"] and params["transfer_id"] == "t1"
    assert params["remote_ports"] == [params["remote_port"]] and params["remote_tp_size"] == 1
    assert "p" in p.scheduler.requests, "the prefill holds the blocks for the decode"
    held = p.scheduler.kv_cache_manager.get_block_ids("p")[0]

    d.add_pd("d", PROMPT, params)
    out = d.step()
    assert out.num_scheduled_tokens == {}
    assert d.scheduler.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (job,) = d.metas[0].recvs
    assert job.first_block == 0 and len(job.block_ids) == NBLOCKS
    assert parked.wait(30), "the pull did not reach the prefill's worker"
    assert p.worker._worker._sends == {}  # it arrived before the prefill worker knew
    d.step()
    assert d.scheduler.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    with caplog.at_level(logging.INFO, logger="mooncake_vllm"):
        p.step()                          # hands the finished request's blocks to its worker
        step_until(d, lambda: any(r.finished_recving for r in d.results))
    assert "d" in d.outputs[-1].kv_connector_output.finished_recving
    assert not d.outputs[-1].kv_connector_output.failed_recving
    assert holds_prompt(d, "d"), "the decode's blocks hold the prefill's KV"
    out = d.step()
    assert out.num_scheduled_tokens == {"d": 1}, "only the last prompt token is computed"
    d.run()
    step_until(p, lambda: not p.scheduler.requests)   # finished sending: blocks freed
    assert p.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() >= len(held)
    assert d.stat("bytes_loaded") == NBLOCKS * BLOCK_NBYTES == p.stat("bytes_sent")
    assert p.stat("send_seconds") > 0 and d.stat("blocks_loaded") == NBLOCKS
    assert f"wrote {NBLOCKS} blocks ({NBLOCKS * BLOCK_NBYTES} bytes)" in caplog.text


def test_decode_receives_only_what_its_prefix_cache_lacks(pd):
    p, d = pd("kv_producer"), pd("kv_consumer")
    d.add_pd("x", PROMPT[:4 * BLOCK] + [9] * 8, None)
    d.run()                                    # 4 of the prompt's blocks cached locally
    params = prefill(p, "p", "t1")
    p.step()
    d.add_pd("d", PROMPT, params)
    d.step()
    (job,) = d.metas[-1].recvs
    assert job.first_block == 4 and len(job.block_ids) == NBLOCKS - 4
    step_until(d, lambda: any(r.finished_recving for r in d.results))
    assert holds_prompt(d, "d")
    d.run()
    assert d.stat("bytes_loaded") == (NBLOCKS - 4) * BLOCK_NBYTES


def test_a_failed_write_makes_the_decode_recompute(pd, caplog):
    p, d = pd("kv_producer"), pd("kv_consumer")
    params = prefill(p, "p", "t1")
    p.step()

    def broken(*args, **kw):
        raise TransferError("injected: link down")

    p.worker._worker._engine.submit = broken
    d.add_pd("d", PROMPT, params)
    with caplog.at_level(logging.WARNING):
        step_until(d, lambda: any(r.failed_recving for r in d.results))
        assert recompute(d) == [64, 36]
    assert "injected: link down" in caplog.text
    step_until(p, lambda: not p.scheduler.requests)
    assert d.stat("load_errors") == NBLOCKS and p.stat("send_errors") == 1


def test_an_unreachable_prefill_makes_the_decode_recompute(pd, caplog):
    p, d = pd("kv_producer"), pd("kv_consumer")
    params = prefill(p, "p", "t1")
    p.worker.shutdown()                   # the prefill's workers are gone
    d.add_pd("d", PROMPT, params)
    with caplog.at_level(logging.WARNING):
        step_until(d, lambda: any(r.failed_recving for r in d.results))
        assert recompute(d) == [64, 36]
    assert "computes its prompt instead" in caplog.text


def test_prefill_abort_fails_the_pull_at_once_and_unasked_blocks_time_out(pd, caplog):
    p = pd("kv_producer", extra={"abort_timeout_s": 1.0})
    d = pd("kv_consumer")
    p.add_pd("a", PROMPT, {"do_remote_decode": True, "transfer_id": "t-abort"}, max_tokens=1)
    p.step()                                               # 64 of 100 tokens
    p.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert "a" not in p.scheduler.requests, "an aborted prefill frees its blocks at once"
    template = prefill(p, "b", "t-unasked")
    d.add_pd("d", PROMPT, dict(template, transfer_id="t-abort"))
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        step_until(d, lambda: any(r.failed_recving for r in d.results))
        assert time.monotonic() - t0 < 3, "no waiting for pull_wait_s"
        d.run()
        step_until(p, lambda: not p.scheduler.requests, timeout_s=5)
    assert "was aborted on the prefill" in caplog.text
    assert "no decode asked for transfer t-unasked" in caplog.text
    assert p.stat("sends_expired") == 1


def test_decode_abort_while_receiving_keeps_blocks_until_the_pull_ends(pd):
    p, d = pd("kv_producer"), pd("kv_consumer")
    params = prefill(p, "p", "t1")
    d.add_pd("d", PROMPT, params)
    d.step()                                   # pull out, waiting on the prefill
    d.scheduler.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert "d" in d.scheduler.requests, "blocks stay while the prefill may write them"
    p.step()
    step_until(d, lambda: not d.scheduler.requests)
    step_until(p, lambda: not p.scheduler.requests)


def test_decode_abort_before_scheduling_releases_the_prefill(pd):
    p, d = pd("kv_producer"), pd("kv_consumer")   # abort_timeout_s is 60 s
    params = prefill(p, "p", "t1")
    d.add_pd("d", PROMPT, params)
    d.scheduler.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    d.step()                                   # sends the release
    step_until(p, lambda: not p.scheduler.requests, timeout_s=5)
    assert p.stat("bytes_sent") == 0


@pytest.mark.parametrize("change, why", [
    ({"remote_tp_size": 2, "remote_ports": [1, 2]}, "needs equal TP sizes"),
    ({"remote_block_size": 32}, "block size"),
    ({"prompt_digest": "0" * 32}, "prompt differs"),
    ({"remote_ports": "x"}, "remote_ports must be"),
])
def test_unusable_params_compute_locally(pd, caplog, change, why):
    p, d = pd("kv_producer"), pd("kv_consumer")
    params = prefill(p, "p", "t1")
    d.add_pd("d", PROMPT, dict(params, **change))
    with caplog.at_level(logging.ERROR):
        out = d.step()
    assert out.num_scheduled_tokens == {"d": 64}
    assert why in caplog.text
    d.run()


def test_side_channel_survives_malformed_frames(pd, caplog):
    p = pd("kv_producer")
    params = prefill(p, "p", "t1")
    p.step()
    host, port = params["remote_host"], params["remote_port"]
    bad = [struct.pack(">I", 0xFFFFFFFF),
           struct.pack(">I", 3) + b"\xc1\xc1\xc1",
           _frame([1, 2]),
           _frame({"v": 1, "op": "pull", "transfer_id": "t1"})]
    with caplog.at_level(logging.ERROR):
        for frame in bad:
            with socket.create_connection((host, port), timeout=5) as s:
                s.sendall(frame)
                assert s.recv(16) == b"", "the server closed the connection"
    assert caplog.text.count("bad frame") == len(bad)
    wrong_rank = Pull("t1", params["remote_engine_id"], 1, 2).to_wire()
    ok, error, _ = ask(host, port, wrong_rank, 2, 5)
    assert not ok and "equal TP sizes" in error
    ok, error, _ = ask(host, port, Pull("t1", "other-engine", 0, 1).to_wire(), 2, 5)
    assert not ok and "serves engine" in error
    ok, _, _ = ask(host, port, Pull("t1", params["remote_engine_id"], 0, 1).to_wire(), 2, 5)
    assert ok, "the server still serves: the release went through"
    step_until(p, lambda: not p.scheduler.requests)


def _frame(msg) -> bytes:
    body = msgpack.packb(msg)
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize("msg, field", [
    ({"v": 2}, "'v'"),
    ({"op": "delete"}, "'op'"),
    ({"tp_rank": 3}, "'tp_rank'"),
    ({"transfer_id": ""}, "'transfer_id'"),
    ({"blocks": [[1]]}, "'blocks'"),
    ({"blocks": [[-1, 2]]}, "'blocks'"),
    ({"piece_sizes": [0, 4]}, "'piece_sizes'"),
    ({"extra": 1}, "unknown field"),
])
def test_pull_validation_names_the_field(msg, field):
    good = Pull("t", "e", 0, 2, segment="h:1", first_block=0, piece_sizes=(8, 8),
                blocks=((64, 128),)).to_wire()
    assert parse_pull(good).blocks == ((64, 128),)
    with pytest.raises(ProtocolError, match=field):
        parse_pull({**good, **msg})


def test_settings_errors_name_the_key():
    with pytest.raises(ValueError, match="side_channel_port"):
        from_extra_config(PDSettings, {"side_channel_port": 70000}, "PD")
    with pytest.raises(ValueError, match="pull_wait_s"):
        from_extra_config(PDSettings, {"pull_wait_s": 0}, "PD")
    with pytest.raises(ValueError, match="kv_connector_extra_config: unknown key 'prot'"):
        from_extra_config(PDSettings, {"prot": "tcp"}, "PD")
