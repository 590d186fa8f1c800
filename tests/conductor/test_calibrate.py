"""``mooncake-conductor calibrate``: the least-squares fit, and a calibration against a
stand-in engine whose prefill and decode times are set (``openai_double.py``)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest

from mooncake_plugins.conductor.costmodel import CostModel
from mooncake_plugins.conductor.router.calibrate import fit_quadratic


def test_fit_recovers_a_quadratic():
    xs = [16, 128, 512, 1024, 2048]
    c0, c1, c2 = fit_quadratic(xs, [0.02 + 1.4e-4 * x + 1.3e-9 * x * x for x in xs])
    assert c0 == pytest.approx(0.02) and c1 == pytest.approx(1.4e-4)
    assert c2 == pytest.approx(1.3e-9, rel=1e-3)
    with pytest.raises(ValueError):
        fit_quadratic([5, 5, 5], [1, 1, 1])


def test_calibrating_a_modelled_engine_finds_its_speeds(tmp_path):
    pytest.importorskip("aiohttp")
    from aiohttp import web
    from openai_double import OpenAIDouble

    engine = OpenAIDouble("e", delay_s=0.02, per_token_s=40e-6, step_s=0.01)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(engine.app())
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        out = tmp_path / "cost.json"
        proc = subprocess.run([sys.executable, "-m", "mooncake_plugins.cli.conductor_serve",
                               "calibrate", "--instance", f"http://127.0.0.1:{port}",
                               "--model", "m", "--lengths", "16,512,1024,2048", "--repeats",
                               "2", "--decode-tokens", "12", "--kv-bytes-per-token", "4096",
                               "--out", str(out)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "prefill   2048 tokens" in proc.stdout and "wrote" in proc.stdout
        cost = CostModel(**json.loads(out.read_text()))
        # sleeps overshoot by a little: the fit is near the engine's set speeds
        assert cost.prefill_fixed_s == pytest.approx(0.02, abs=0.01)
        assert cost.prefill_s_per_token == pytest.approx(40e-6, rel=0.25)
        assert cost.decode_fixed_s == pytest.approx(0.01, rel=0.5)
        assert cost.kv_bytes_per_token == 4096
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
        bad = subprocess.run([sys.executable, "-m", "mooncake_plugins.cli.conductor_serve",
                              "calibrate", "--instance", "http://127.0.0.1:9", "--model", "m",
                              "--out", str(tmp_path / "x.json")], capture_output=True,
                             text=True, timeout=60)
        assert bad.returncode != 0 and "calibrate:" in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1


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
    # each engine got its own prompts: warm-up, 4 lengths x 3, one decode request
    for engine in (fast, slow):
        assert len(engine.seen) == 14
    prompts = [{tuple(b["prompt"]) for b in e.seen[1:]} for e in (fast, slow)]
    assert not prompts[0] & prompts[1]
    asyncio.run(scenario())   # a second calibration draws fresh prompts: none cached
    assert not {tuple(b["prompt"]) for b in fast.seen[15:]} & prompts[0]
    # the median of the pooled times lies between the two engines' speeds
    assert 25e-6 < cost.prefill_s_per_token < 55e-6
