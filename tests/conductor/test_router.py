"""The router's logic over stand-in OpenAI servers (``openai_double.py``): where requests
go under each policy, early rejection, failover, P/D handles, streaming, bad input and
the instance administration. Real vLLM behind it: tests/integrations/vllm."""

from __future__ import annotations

import asyncio
import inspect
import json
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from typing import Any

import pytest

pytest.importorskip("aiohttp")
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from mooncake_plugins.conductor.costmodel import CostModel  # noqa: E402
from mooncake_plugins.conductor.policies import Slo, make_policy  # noqa: E402
from mooncake_plugins.conductor.router.instances import Pool  # noqa: E402
from mooncake_plugins.conductor.router.prompts import Hasher  # noqa: E402
from mooncake_plugins.conductor.router.pd_handoff import PD_KEYS  # noqa: E402
from mooncake_plugins.conductor.router.server import Router, RouterConfig  # noqa: E402
from openai_double import OpenAIDouble  # noqa: E402

# the router learns speeds from stand-in engines that sleep their modelled times
pytestmark = pytest.mark.exclusive

PREFIX = "You are a helpful assistant. " * 40   # about 300 tokens, 19 blocks of 16


def router(policy: str, instances: list[tuple[str, str]], slo: Slo = Slo(30, 1),
           cost: CostModel | None = None, **kw: Any) -> Router:
    cost = cost or CostModel()
    pool = Pool()
    for url, role in instances:
        pool.add(url, role)
    return Router(RouterConfig(make_policy(policy, cost, slo, migrate=False), slo, cost,
                               block_tokens=16,
                               **{"health_interval_s": 0.2, **kw}), Hasher(16), pool)


async def serve(stack: AsyncExitStack, double: OpenAIDouble) -> str:
    server = await stack.enter_async_context(TestServer(double.app()))
    return str(server.make_url("")).rstrip("/")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def complete(prompt: str, **kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": 8, **kw}


async def until(check: Any, timeout_s: float = 2.0) -> None:
    """Wait until ``check()`` holds (awaited where it is a coroutine), ``timeout_s`` at
    most."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = check()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s")
        await asyncio.sleep(0.01)


async def more_readings(double: OpenAIDouble, count: int = 3) -> None:
    """Wait until the router has read and acted on ``count`` more of ``double``'s
    /metrics pages: it asks for the next page only once it has dealt with the last, so
    ``count + 1`` more requests for the page mean ``count`` readings done."""
    target = double.metrics_reads + count + 1
    await until(lambda: double.metrics_reads >= target, timeout_s=10.0)


@pytest.mark.parametrize("policy", ["cache_aware", "conductor"])
def test_requests_sharing_a_prefix_go_where_it_is(policy):
    async def main() -> None:
        a, b = OpenAIDouble("a"), OpenAIDouble("b")
        async with AsyncExitStack() as stack:
            urls = [await serve(stack, a), await serve(stack, b)]
            r = router(policy, [(u, "both") for u in urls])
            client = await stack.enter_async_context(TestClient(TestServer(r.app())))
            first = await client.post("/v1/completions", json=complete(PREFIX + "question 0"))
            owner = (await first.json())["id"]
            for i in range(1, 6):
                resp = await client.post("/v1/completions", json=complete(PREFIX + f"q {i}"))
                assert resp.status == 200
                assert (await resp.json())["id"] == owner
            assert len((a if owner == "a" else b).seen) == 6

    run(main())


def test_round_robin_alternates():
    async def main() -> None:
        a, b = OpenAIDouble("a"), OpenAIDouble("b")
        async with AsyncExitStack() as stack:
            urls = [await serve(stack, a), await serve(stack, b)]
            client = await stack.enter_async_context(TestClient(TestServer(
                router("round_robin", [(u, "both") for u in urls],
                       decision_headers=True).app())))
            ids = []
            for i in range(6):
                resp = await client.post("/v1/completions", json=complete(PREFIX + str(i)))
                ids.append((await resp.json())["id"])
                chosen = (resp.headers["X-Conductor-Prefill"], resp.headers["X-Conductor-Decode"])
                assert chosen == (urls[i % 2],) * 2   # one engine prefills and decodes
            assert ids == ["a", "b"] * 3

    run(main())


def test_overload_is_rejected_early_with_retry_after():
    async def main() -> None:
        slow = OpenAIDouble("a", delay_s=1.0)
        async with AsyncExitStack() as stack:
            url = await serve(stack, slow)
            # each ~300-token prompt is predicted to take 0.3 s of prefill: with a 0.7 s TTFT
            # objective the third one queued is predicted late and refused at once
            cost = CostModel(prefill_fixed_s=0.0, prefill_s_per_token=1e-3,
                             prefill_s_per_token_sq=0.0)
            r = router("conductor", [(url, "both")], slo=Slo(0.7, 1.0), cost=cost)
            client = await stack.enter_async_context(TestClient(TestServer(r.app())))
            sends = [client.post("/v1/completions", json=complete(f"{i} " + PREFIX))
                     for i in range(4)]
            answers = await asyncio.gather(*sends)
            codes = sorted(a.status for a in answers)
            assert codes == [200, 200, 429, 429], codes
            refused = next(a for a in answers if a.status == 429)
            assert int(refused.headers["Retry-After"]) >= 1
            assert "predicted TTFT" in (await refused.json())["error"]["message"]
            assert len(slow.seen) == 2
            page = await (await client.get("/metrics")).text()
            assert "conductor_rejected_total 2.0" in page

    run(main())


def test_an_unreachable_instance_is_taken_out_and_the_request_served_elsewhere():
    async def main() -> None:
        live = OpenAIDouble("live")
        async with AsyncExitStack() as stack:
            url = await serve(stack, live)
            dead = "http://127.0.0.1:9"   # discard port: nothing listens
            r = router("round_robin", [(dead, "both"), (url, "both")])
            client = await stack.enter_async_context(TestClient(TestServer(r.app())))
            for i in range(4):
                resp = await client.post("/v1/completions", json=complete(str(i)))
                assert resp.status == 200 and (await resp.json())["id"] == "live"
            state = {i["url"]: i for i in await (await client.get("/instances")).json()}
            assert state[dead]["healthy"] is False and state[url]["healthy"] is True

    run(main())


def test_an_instance_slow_to_answer_its_health_check_stays_until_three_time_out():
    """A busy engine's /health may answer late: one or two checks timing out keep it in,
    three in a row take it out, and one answered brings it back."""
    async def main() -> None:
        busy = OpenAIDouble("busy")
        async with AsyncExitStack() as stack:
            url = await serve(stack, busy)
            r = router("round_robin", [(url, "both")], health_timeout_s=0.1)
            client = await stack.enter_async_context(TestClient(TestServer(r.app())))

            async def healthy() -> bool:
                return (await (await client.get("/instances")).json())[0]["healthy"]

            inst = r.pool.get(url)
            busy.health_delay_s = 0.3      # each check times out after 0.1 s
            await until(lambda: inst.slow_checks == 2)
            assert await healthy()         # two in a row: still in
            busy.health_delay_s = 0.0      # answered: the count starts over
            await until(lambda: inst.slow_checks == 0)
            busy.health_delay_s = 0.3
            await until(lambda: not inst.healthy)
            assert inst.slow_checks == 3
            assert (await client.post("/v1/completions", json=complete("x"))).status == 503
            busy.health_delay_s = 0.0
            await until(lambda: inst.healthy)
            assert (await client.post("/v1/completions", json=complete("x"))).status == 200
        for bad in ({"health_timeout_s": 0.0}, {"health_interval_s": -1.0},
                    {"slow_checks_to_take_out": 0}):
            with pytest.raises(ValueError, match="health checks"):
                router("round_robin", [(url, "both")], **bad)

    run(main())


def test_an_instance_dying_mid_stream_ends_the_stream_with_an_error():
    async def main() -> None:
        dying = OpenAIDouble("d", die_mid_stream=True)
        async with AsyncExitStack() as stack:
            url = await serve(stack, dying)
            r = router("round_robin", [(url, "both")])
            client = await stack.enter_async_context(TestClient(TestServer(r.app())))
            resp = await client.post("/v1/completions", json=complete("x", stream=True))
            text = await resp.text()
            assert text.startswith('data: {"id": "d", "n": 0}')
            last = json.loads(text.strip().split("\n\n")[-1][len("data: "):])
            assert "failed mid-answer" in last["error"]
            assert (await (await client.get("/instances")).json())[0]["healthy"] is False

    run(main())


def test_a_stream_is_relayed_intact():
    async def main() -> None:
        up = OpenAIDouble("s", chunks=5)
        async with AsyncExitStack() as stack:
            url = await serve(stack, up)
            client = await stack.enter_async_context(TestClient(TestServer(
                router("load_balance", [(url, "both")]).app())))
            resp = await client.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            # the engines' addresses are not shown unless asked (--decision-headers)
            assert not any(h.startswith("X-Conductor") for h in resp.headers)
            events = (await resp.text()).strip().split("\n\n")
            assert events[-1] == "data: [DONE]" and len(events) == 6

    run(main())


def test_pd_requests_carry_the_prefill_handle_to_the_decode():
    async def main() -> None:
        p, d = OpenAIDouble("p", prefill=True), OpenAIDouble("d")
        async with AsyncExitStack() as stack:
            pu, du = await serve(stack, p), await serve(stack, d)
            client = await stack.enter_async_context(TestClient(TestServer(
                router("conductor", [(pu, "prefill"), (du, "decode")],
                       decision_headers=True).app())))
            resp = await client.post("/v1/completions", json=complete("hello", stream=True))
            assert resp.status == 200 and "data: [DONE]" in await resp.text()
            (first,) = p.seen
            assert first["max_tokens"] == 1 and "stream" not in first
            assert first["kv_transfer_params"]["do_remote_decode"] is True
            (second,) = d.seen
            assert second["kv_transfer_params"] == {k: v for k, v in p.handle.items()
                                                    if k in PD_KEYS}
            assert second["max_tokens"] == 8 and second["stream"] is True
            # the answer names the instances chosen and the TTFT it was admitted with
            assert (resp.headers["X-Conductor-Prefill"], resp.headers["X-Conductor-Decode"]
                    ) == (pu, du)
            assert float(resp.headers["X-Conductor-Predicted-TTFT"]) > 0
            # the streamed answer timed its TTFT (to the decode's first token) for the
            # prefill instance; the decode instance learned no TTFT
            prefill, decode = (i["ttft_samples"] for i in await (await client.get(
                "/instances")).json())
            assert (prefill, decode) == (1, 0)

    run(main())


def test_two_prefill_instances_feed_one_decode_each_with_its_own_handle():
    """2P+1D: a shared prefix keeps going to the prefill instance that computed it, the
    decode gets each request's handle from the prefill that served it, and when that
    prefill instance dies the next request is prefilled on the other one."""
    async def main() -> None:
        doubles = {"p0": OpenAIDouble("p0", prefill=True),
                   "p1": OpenAIDouble("p1", prefill=True)}
        d = OpenAIDouble("d")
        async with AsyncExitStack() as stack:
            servers = {}
            for name, double in doubles.items():
                servers[name] = TestServer(double.app())
                await servers[name].start_server()
                stack.push_async_callback(servers[name].close)
            urls = {name: str(s.make_url("")).rstrip("/") for name, s in servers.items()}
            du = await serve(stack, d)
            client = await stack.enter_async_context(TestClient(TestServer(router(
                "conductor", [(urls["p0"], "prefill"), (urls["p1"], "prefill"),
                              (du, "decode")]).app())))
            for i in range(4):
                resp = await client.post("/v1/completions",
                                         json=complete(PREFIX + f"q {i}", stream=i % 2 == 0))
                assert resp.status == 200 and "d" in await resp.text()
            owner = next(n for n, double in doubles.items() if double.seen)
            other = "p1" if owner == "p0" else "p0"
            assert len(doubles[owner].seen) == 4 and not doubles[other].seen
            assert [b["kv_transfer_params"]["remote_engine_id"] for b in d.seen] == [owner] * 4
            await servers[owner].close()   # the prefill instance that holds the prefix dies
            resp = await client.post("/v1/completions", json=complete(PREFIX + "q 4"))
            assert resp.status == 200
            assert len(doubles[other].seen) == 1
            assert d.seen[-1]["kv_transfer_params"]["remote_engine_id"] == other
            state = {i["url"]: i for i in await (await client.get("/instances")).json()}
            assert state[urls[owner]]["healthy"] is False
            assert state[urls[other]]["healthy"] is True and state[du]["healthy"] is True
            # nothing is left in flight on any instance once every answer is done
            assert all(i["in_flight"] == 0 and i["decoding"] == 0 for i in state.values())

    run(main())


@pytest.mark.parametrize("body,why", [
    (b"{not json", "JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({"model": "m"}).encode(), "'prompt'"),
    (json.dumps({"prompt": [1, "a"]}).encode(), "'prompt'"),
    (json.dumps({"prompt": "x", "stream": "yes"}).encode(), "'stream'"),
    (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), "'max_tokens'"),
])
def test_malformed_requests_get_400(body, why):
    async def main() -> None:
        up = OpenAIDouble("a")
        async with AsyncExitStack() as stack:
            url = await serve(stack, up)
            client = await stack.enter_async_context(TestClient(TestServer(
                router("conductor", [(url, "both")]).app())))
            resp = await client.post("/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
            assert resp.status == 400 and why in (await resp.json())["error"]["message"]
            resp = await client.post("/v1/chat/completions", json={"messages": []})
            assert resp.status == 400
            assert up.seen == []

    run(main())


def test_instances_are_added_drained_and_removed_at_run_time():
    async def main() -> None:
        a, b = OpenAIDouble("a"), OpenAIDouble("b")
        async with AsyncExitStack() as stack:
            ua, ub = await serve(stack, a), await serve(stack, b)
            client = await stack.enter_async_context(TestClient(TestServer(
                router("round_robin", [(ua, "both")]).app())))
            assert (await client.post("/instances", json={"url": ub})).status == 200
            assert (await client.post("/instances", json={"url": ub, "role": "x"})).status == 400
            assert (await client.post("/instances", json={"url": "ftp://h"})).status == 400
            assert (await client.post("/instances/drain", json={"url": "http://no"})).status == 404
            assert (await client.post("/instances/drain", json={"url": ua})).status == 200
            for i in range(3):
                resp = await client.post("/v1/completions", json=complete(str(i)))
                assert (await resp.json())["id"] == "b"
            assert (await client.delete("/instances", json={"url": ub})).status == 200
            resp = await client.post("/v1/completions", json=complete("z"))
            assert resp.status == 503   # a drained one left only
            assert (await client.get("/health")).status == 503

    run(main())


def test_the_command_line_refuses_bad_instances_in_one_line():
    out = subprocess.run([sys.executable, "-m", "mooncake_plugins.cli.conductor_serve",
                          "serve", "--instance", "ftp://h:1"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        "mooncake-conductor: instance URL 'ftp://h:1' must start with http:// or https://"]
    # LMCache's builtin hash inside vLLM cannot be followed without the engines' seed
    out = subprocess.run([sys.executable, "-m", "mooncake_plugins.cli.conductor_serve",
                          "serve", "--instance", "http://127.0.0.1:1", "--store",
                          "127.0.0.1:2", "--store-lmcache-chunk-size", "256"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("mooncake-conductor: LMCache's builtin hash") and \
        "PYTHONHASHSEED" in line


def test_a_full_engine_queues_new_prefills_until_a_slot_frees():
    # an ordinary engine with 2 slots (--max-num-seqs 2): two requests decode, ending in
    # 0.3 and 0.8 s; a new one waits 0.3 s for a slot, though no prefill is queued; one
    # more waiting for its first token takes that slot at 0.3 s, prefills 0.05 s and
    # decodes 9 steps of 0.01 s: the new one waits until 0.44 s
    from mooncake_plugins.conductor.router.instances import Pool, _Flight
    from mooncake_plugins.conductor.router.view import LiveView

    pool = Pool()
    inst = pool.add("http://127.0.0.1:1")
    now = pool.now()
    inst.decoding.update({1: 100, 2: 100})
    inst.decode_ends.update({1: now + 0.8, 2: now + 0.3})
    view = LiveView(pool, 16, 2, step_s=0.01)
    assert view.colocated
    assert view.prefill_queue_s(0) == pytest.approx(0.3, abs=0.01)
    inst.flights[3] = _Flight(now, 0.05, 100, output_tokens=10)
    assert LiveView(pool, 16, 2, step_s=0.01).prefill_queue_s(0) == pytest.approx(0.44, abs=0.01)
    assert LiveView(pool, 16, 8, step_s=0.01).prefill_queue_s(0) == pytest.approx(0.05, abs=0.01)
    # P/D roles: a prefill instance's slots are not the decode's; no slot wait
    pool.add("http://127.0.0.1:2", "decode")
    inst.role = "prefill"
    assert LiveView(pool, 16, 2, step_s=0.01).prefill_queue_s(0) == pytest.approx(0.05, abs=0.01)


def test_a_slot_wait_counts_no_prefill_time_that_has_already_run():
    """Two slots: one decoding until 0.8 s from now, one taken by a request that came
    0.5 s ago to prefill 0.6 s and decode 10 tokens of 0.01 s: it ends 0.19 s from now
    (prefilling from now it would end at 0.69 s); twice as slow (ratio 2), at 0.79 s;
    one overdue for its first token (it came 1 s ago) prefills no earlier than now. An
    external request waiting at a reading 0.5 s old (beside the one decoding) ages the
    same way."""
    from mooncake_plugins.conductor.router.engine_load import EngineLoad
    from mooncake_plugins.conductor.router.instances import _Flight

    pool = Pool()
    inst = pool.add("http://127.0.0.1:1")
    now = pool.now()
    inst.decoding[1] = 100
    inst.decode_ends[1] = now + 0.8
    inst.flights[2] = _Flight(now - 0.5, 0.6, 100, output_tokens=10)
    assert inst.slot_wait_s(now, 2, 0.01) == pytest.approx(0.19)
    assert inst.slot_wait_s(now, 2, 0.01, ratio=2.0) == pytest.approx(0.79)
    inst.flights[2].started_s = now - 1.0
    assert inst.slot_wait_s(now, 2, 0.01) == pytest.approx(0.09)
    del inst.flights[2]
    inst.observe_engine(EngineLoad(running=1, waiting=1, mean_prompt_tokens=600.0,
                                   mean_output_tokens=10.0), lambda n: n * 1e-3, now - 0.5)
    assert inst.slot_wait_s(now, 2, 0.01) == pytest.approx(0.19)
    # a decode predicted to have ended 0.2 s ago that has not holds its slot until now:
    # a request that came 0.3 s ago prefills (0.1 s) from now, not from 0.2 s ago
    inst.external_waiting = 0
    inst.decode_ends[1] = now - 0.2
    inst.decoding[3] = 100
    inst.decode_ends[3] = now + 0.4
    inst.flights[4] = _Flight(now - 0.3, 0.1, 100, output_tokens=10)
    assert inst.slot_wait_s(now, 2, 0.01) == pytest.approx(0.19)


def test_prompts_prefilled_in_one_step_give_their_first_tokens_together():
    """vLLM prefills what waits in steps of --max-num-batched-tokens: with 8192, three
    1792-token prompts that came one by one while a fourth prefilled go in one step, so
    the first two get their first token with the third (0.1 s of model prefill each);
    with 2048 a step holds the end of one prompt and the start of the next. The one
    prefilling now and the newest keep their estimates; each later token is counted
    once; a prompt that came after all before it started begins a queue of its own."""
    from mooncake_plugins.conductor.router.instances import _Flight

    def admit(inst, step: int, now: float, ratio: float = 1.0) -> dict[str, _Flight]:
        flights = {}
        for rid, (name, ago, ttft) in enumerate((("a", 0.05, 0.1), ("b", 0.003, 0.15),
                                                 ("c", 0.002, 0.25), ("x", 0.001, 0.35))):
            flights[name] = inst.flights[rid] = _Flight(
                now - ago, 0.1, 1792, model_ttft_s=ttft, expected_ttft_s=ratio * ttft,
                tokens=1792)
            inst.batch_prefills(step, now, ratio)
        return flights

    pool = Pool()
    inst = pool.add("http://127.0.0.1:1")
    now = pool.now()
    f = admit(inst, 8192, now, ratio=2.0)
    inst.batch_prefills(8192, now, ratio=2.0)   # nothing new: nothing moves
    assert [f[n].model_ttft_s for n in "abcx"] == pytest.approx([0.1, 0.35, 0.35, 0.35])
    assert [f[n].expected_ttft_s for n in "abcx"] == pytest.approx([0.2, 0.7, 0.7, 0.7])
    inst.flights[9] = y = _Flight(now, 0.1, 1792, model_ttft_s=0.45, tokens=1792)
    inst.batch_prefills(8192, now)
    assert [f[n].model_ttft_s for n in "abcx"] + [y.model_ttft_s] == pytest.approx(
        [0.1, 0.45, 0.45, 0.45, 0.45])
    inst.flights.clear()
    f = admit(inst, 2048, now)
    assert [f[n].model_ttft_s for n in "abcx"] == pytest.approx(
        [0.1, 0.15 + 0.1 * 256 / 1792, 0.25 + 0.1 * 512 / 1792, 0.35])
    # once b, c and x started (0.3 s of model prefill on), the next one queues alone
    later = now + 0.31
    inst.flights[9] = z = _Flight(later, 0.1, 1792, model_ttft_s=0.1, tokens=1792)
    inst.batch_prefills(2048, later)
    assert (z.at, f["x"].model_ttft_s) == (0, pytest.approx(0.35))


def test_a_slot_wait_is_scaled_by_the_ttft_ratio_once():
    """The policy scales the queue by the instance's TTFT ratio; the slot wait, predicted
    in seconds, is given to it in the model's time: on an instance measured twice as slow
    as its model, a slot free in 0.3 s is a wait of 0.3 s in the estimate, not 0.6 s."""
    from mooncake_plugins.conductor.router.view import LiveView

    pool = Pool()
    inst = pool.add("http://127.0.0.1:1")
    for _ in range(400):
        inst.ttft.add(1.0, 2.0)
    now = pool.now()
    inst.decoding.update({1: 100, 2: 100})
    inst.decode_ends.update({1: now + 0.8, 2: now + 0.3})
    view = LiveView(pool, 16, 2, step_s=0.01)
    assert view.expected_ttft_s(0, 1.0) == pytest.approx(2.0, rel=0.01)
    assert view.expected_ttft_s(0, view.prefill_queue_s(0)) == pytest.approx(0.3, abs=0.01)


def test_ttft_estimates_learn_an_instance_slower_than_the_model():
    """The engine prefills 3x slower than the cost model says. Non-streamed answers (whose
    first byte is their last) teach nothing; streamed ones do, and then a request the
    model alone would admit within the SLO is refused, where the learned ratio is on."""
    cost = CostModel(prefill_fixed_s=0.0, prefill_s_per_token=1e-4, prefill_s_per_token_sq=0.0)
    prompt = list(range(500))   # the model: 0.05 s; the engine: 0.15 s

    async def main(correct: bool) -> tuple[list[int], dict, str]:
        slow = OpenAIDouble("a", per_token_s=3e-4)
        async with AsyncExitStack() as stack:
            url = await serve(stack, slow)
            r = router("conductor", [(url, "both")], slo=Slo(0.1, 1.0), cost=cost,
                       correct_ttft=correct)
            client = await stack.enter_async_context(TestClient(TestServer(r.app())))
            codes = []
            for i in range(24):
                resp = await client.post("/v1/completions", json=complete(
                    [i + 1000] + prompt, stream=i >= 4))
                codes.append(resp.status)
                await resp.read()
            (inst,) = await (await client.get("/instances")).json()
            assert len(r._errors) == inst["ttft_samples"]   # measured / estimated, each
            return codes, inst, await (await client.get("/metrics")).text()

    codes, inst, page = run(main(True))
    assert inst["ttft_samples"] >= 4 and inst["ttft_samples"] < 20, inst
    assert 2.0 < inst["ttft_ratio"] < 8.0, inst   # refusals begin past 0.1 / 0.05
    assert codes[:8] == [200] * 8 and codes[-1] == 429, codes
    assert "conductor_ttft_ratio{" in page
    codes, inst, _ = run(main(False))
    assert codes == [200] * 24   # the model alone: 0.05 s, within the SLO
    assert inst["ttft_samples"] == 20   # measured all the same


def test_a_request_late_for_its_first_token_raises_the_expected_ratio_at_once():
    """No answer has come back (a burst), but a request that waits longer than the ratio
    predicts bounds it from below; untimed requests (not streamed) and ones the model
    gave under 50 ms are not taken as evidence."""
    from mooncake_plugins.conductor.router.instances import Pool, _Flight
    from mooncake_plugins.conductor.router.view import LiveView

    pool = Pool()
    inst = pool.add("http://127.0.0.1:1")
    now = pool.now()
    assert inst.ttft_ratio(now) == 1.0
    inst.flights[1] = _Flight(now - 0.3, 0.1, 100, model_ttft_s=0.1, timed=False)
    inst.flights[2] = _Flight(now - 0.3, 0.01, 100, model_ttft_s=0.01, timed=True)
    assert inst.ttft_ratio(now) == 1.0
    inst.flights[3] = _Flight(now - 0.3, 0.1, 100, model_ttft_s=0.1, timed=True)
    assert inst.ttft_ratio(now) == pytest.approx(3.0)
    assert LiveView(pool, 16, 8).expected_ttft_s(0, 0.2) == pytest.approx(0.6, rel=0.05)
    assert LiveView(pool, 16, 8, correct=False).expected_ttft_s(0, 0.2) == 0.2
    inst.flights[3].first_token = True   # answered: the learned ratio alone again
    assert inst.ttft_ratio(now) == 1.0
    inst.flights[4] = _Flight(now - 60, 0.1, 100, model_ttft_s=0.1, timed=True)
    assert inst.ttft_ratio(now) == 8.0   # within bounds


def test_a_slow_instance_drains_its_queue_at_the_measured_speed():
    from mooncake_plugins.conductor.router.instances import Pool, _Flight
    from mooncake_plugins.conductor.router.view import LiveView

    pool = Pool()
    inst = pool.add("http://127.0.0.1:1")
    now = pool.now()
    # two prefills of 0.2 s (model) waiting since 0.2 s ago, the first already answered
    # streams at twice the model's time: 0.4 s of model work left at full speed is
    # 0.2 s; at half speed only 0.1 s of it has run
    inst.flights[1] = _Flight(now - 0.2, 0.2, 100, model_ttft_s=0.2, timed=True)
    inst.flights[2] = _Flight(now - 0.2, 0.2, 100, model_ttft_s=0.4, timed=True)
    assert LiveView(pool, 16, 8, correct=False).prefill_queue_s(0) == pytest.approx(0.2, abs=0.01)
    for _ in range(200):
        inst.ttft.add(0.5, 1.0)
    assert LiveView(pool, 16, 8).prefill_queue_s(0) == pytest.approx(0.3, abs=0.01)


def test_the_decode_pace_is_learned_from_streamed_answers():
    """The engine steps 5x slower than the model's decode step: the streamed answers'
    pace teaches the decode ratio (non-streamed answers do not), and a full engine's
    slot wait is priced at that pace."""
    from mooncake_plugins.conductor.router.view import LiveView

    cost = CostModel(decode_fixed_s=0.002, decode_s_per_request=0.0,
                     decode_s_per_context_token=0.0)

    async def main() -> Router:
        engine = OpenAIDouble("a", step_s=0.01)
        async with AsyncExitStack() as stack:
            url = await serve(stack, engine)
            r = router("round_robin", [(url, "both")], cost=cost)
            client = await stack.enter_async_context(TestClient(TestServer(r.app())))
            for i in range(8):
                resp = await client.post("/v1/completions", json=complete(
                    f"{i} " + PREFIX, max_tokens=32, stream=i >= 2))
                assert resp.status == 200
                await resp.read()
            return r

    r = run(main())
    (inst,) = list(r.pool)
    assert inst.tbt.samples == 6
    assert 2.5 < inst.tbt.ratio < 8.0, inst.tbt.ratio
    # one slot, held by a request with 11 tokens left: 10 steps of the learned pace
    now = r.pool.now()
    inst.decode_ends[1] = now + 1.0
    from mooncake_plugins.conductor.router.instances import _Flight
    inst.flights[2] = _Flight(now, 0.0, 100, output_tokens=11)
    raw = LiveView(r.pool, 16, 1, step_s=0.002, correct=False).prefill_queue_s(0)
    view = LiveView(r.pool, 16, 1, step_s=0.002)
    learned = view.expected_ttft_s(0, view.prefill_queue_s(0))   # in seconds again
    assert raw == pytest.approx(1.02, abs=0.01)
    assert learned == pytest.approx(1.0 + 0.02 * inst.tbt.ratio, abs=0.01)


def test_the_decode_pace_counts_tokens_not_events_where_the_usage_came():
    """An engine that sends its 32 tokens four to an event after the first (as vLLM's
    API server does when it lags): where the client asked for the usage, the router
    counts the 31 tokens after the first, at the engine's 10 ms a token; where it did
    not, it can only count the 8 events, as if each were one token 40 ms apart."""
    async def paces(usage: bool) -> list[tuple[int, float]]:
        engine = OpenAIDouble("a", step_s=0.01, tokens_per_event=4)
        async with AsyncExitStack() as stack:
            url = await serve(stack, engine)
            r = router("round_robin", [(url, "both")])
            seen: list[tuple[int, float]] = []
            decoded = r.decoded
            r.decoded = lambda inst, tokens, seconds: (seen.append((tokens, seconds)),
                                                       decoded(inst, tokens, seconds))
            client = await stack.enter_async_context(TestClient(TestServer(r.app())))
            for i in range(3):
                resp = await client.post("/v1/completions", json=complete(
                    f"{i} " + PREFIX, max_tokens=32, stream=True,
                    **({"stream_options": {"include_usage": True}} if usage else {})))
                text = await resp.text()
                assert resp.status == 200 and ('"completion_tokens": 32' in text) == usage
            return seen

    with_usage, without = run(paces(True)), run(paces(False))
    assert [tokens for tokens, _ in with_usage] == [31] * 3
    assert all(0.009 < seconds / tokens < 0.03 for tokens, seconds in with_usage), with_usage
    assert [tokens for tokens, _ in without] == [8] * 3
    assert all(seconds / tokens > 0.036 for tokens, seconds in without), without


def test_pd_requests_take_a_decode_slot_only_from_their_first_token():
    """One decode slot: three requests queue on one prefill instance (0.2 s each) and
    each decodes for a few ms once its prefill is done, so one slot serves them in
    turn. Before their first token they do not hold it (they did once: all but the
    first were refused as finding no slot)."""
    cost = CostModel(prefill_fixed_s=0.2, prefill_s_per_token=0.0, prefill_s_per_token_sq=0.0,
                     decode_fixed_s=0.001)

    async def main() -> list[int]:
        p, d = OpenAIDouble("p", prefill=True, delay_s=0.2), OpenAIDouble("d")
        async with AsyncExitStack() as stack:
            pu, du = await serve(stack, p), await serve(stack, d)
            client = await stack.enter_async_context(TestClient(TestServer(router(
                "conductor", [(pu, "prefill"), (du, "decode")], cost=cost,
                decode_max_batch=1).app())))
            answers = await asyncio.gather(*(client.post("/v1/completions", json=complete(
                f"{i} " + PREFIX, max_tokens=4, stream=True)) for i in range(3)))
            return [a.status for a in answers]

    assert run(main()) == [200, 200, 200]


def test_the_slo_quantile_refuses_where_recent_errors_would_make_a_request_late():
    """--slo-quantile Q bounds a request's TTFT by its estimate times the Q quantile of the
    recent errors (measured / estimated). The errors here are 16 different ratios, 1.00 to
    1.60 in steps of 0.04, in no order; so each quantile, and each neighbouring
    percentile, gives another bound: the 0.9 quantile is 1.54 (0.89: 1.534, 0.91: 1.546,
    the median 1.30, the largest 1.60). A request estimated at 0.8 s (within a 1 s SLO) is
    refused at 0.8 x 1.54 = 1.232 s; one at 0.6 s (0.924 s) is not; one at 0.75 s is
    refused by the 0.9 quantile (1.155 s) but not by the median (0.975 s). No bound before
    16 samples, nor for a policy that does not refuse."""
    from mooncake_plugins.conductor.policies import Decision
    from mooncake_plugins.conductor.router.prompts import RoutedRequest

    def estimated(ttft_s: float) -> Decision:
        return Decision(0, 0, None, 0, ttft_s, 0.01)

    ratios = [1.0 + 0.04 * ((7 * i) % 16) for i in range(16)]  # each of 1.00..1.60 once
    assert sorted(ratios) == pytest.approx([1.0 + 0.04 * k for k in range(16)])
    cost = CostModel(prefill_fixed_s=0.8, prefill_s_per_token=0.0, prefill_s_per_token_sq=0.0)
    r = router("conductor", [("http://127.0.0.1:1", "both")], slo=Slo(1.0, 1.0), cost=cost,
               slo_quantile=0.9)
    req = RoutedRequest(100, [1, 2, 3], True, 8, None)
    assert not r.decide(req)[0].rejected
    r._errors.extend(ratios[:15])
    assert not r.decide(req)[0].rejected          # 15 samples: no bound yet
    r._errors.append(ratios[15])
    decision = r.decide(req)[0]
    assert decision.rejected and "0.9 quantile 1.232 s" in decision.reject_reason
    assert r.ttft_bound(estimated(0.8)) == pytest.approx(0.8 * 1.54)
    assert r.ttft_bound(estimated(0.75)) == pytest.approx(0.75 * 1.54)
    assert r.ttft_bound(estimated(0.6)) is None
    median = router("conductor", [("http://127.0.0.1:1", "both")], slo=Slo(1.0, 1.0),
                    cost=cost, slo_quantile=0.5)
    median._errors.extend(ratios)
    decision = median.decide(req)[0]
    assert decision.rejected and "0.5 quantile 1.040 s" in decision.reject_reason
    assert median.ttft_bound(estimated(0.75)) is None
    rr = router("round_robin", [("http://127.0.0.1:1", "both")], slo=Slo(1.0, 1.0),
                cost=cost, slo_quantile=0.9)
    rr._errors.extend([1.5] * 16)
    assert not rr.decide(req)[0].rejected
    with pytest.raises(ValueError):
        router("conductor", [], slo_quantile=1.5)


def test_the_decode_forecast_counts_who_decodes_at_that_time():
    """A decoding request counts until its predicted last token; a P/D request on its
    way counts from its predicted first token to its last; prefills here always."""
    from mooncake_plugins.conductor.router.instances import Pool, _Flight
    from mooncake_plugins.conductor.router.view import LiveView

    pool = Pool()
    inst = pool.add("http://127.0.0.1:1")
    now = pool.now()
    inst.decoding[1] = 100
    inst.decode_ends[1] = now + 0.1
    inst.joining[2] = (now + 0.2, now + 0.4, 200)
    inst.flights[3] = _Flight(now, 0.05, 300)
    view = LiveView(pool, 16, 8)
    assert [(f.requests, f.context_tokens) for f in (
        view.decode_forecast(0, now + t) for t in (0.05, 0.15, 0.3, 0.5))] == [
        (2, 400.0), (1, 300.0), (2, 500.0), (1, 300.0)]


def test_a_pd_handoff_after_prefill_sets_when_the_decode_gets_the_request():
    """With the KV pulled after the prefill (0.3 s + 1 ms a token), the prefill's blocks
    are ready at its end, the decode holds them and is joined a handoff later, and a
    request whose prefill answered decodes until a handoff plus its steps from then."""
    cost = CostModel(prefill_fixed_s=0.2, prefill_s_per_token=0.0, prefill_s_per_token_sq=0.0,
                     decode_fixed_s=0.01, decode_s_per_request=0.0,
                     decode_s_per_context_token=0.0, handoff_latency_s=0.3,
                     kv_bytes_per_token=1000, handoff_bytes_per_s=1e6,
                     kv_streamed_during_prefill=False)
    r = router("load_balance", [("http://p", "prefill"), ("http://d", "decode")], cost=cost,
               correct_ttft=False)
    req = r.hasher.request("/v1/completions", {"model": "m", "prompt": list(range(64)),
                                               "max_tokens": 5})
    decision, view = r.decide(req)
    handoff = 0.3 + 64e-3
    assert decision.predicted_ttft_s == pytest.approx(0.2 + handoff)
    prefill, decode = r.admit(1, req, decision, view)
    now = r.pool.now()
    first, last, _ = decode.joining[1]
    assert first == pytest.approx(now + 0.2 + handoff, abs=0.01)
    assert last == pytest.approx(first + 4 * 0.01)
    assert prefill.prefix(req.hash_ids) == (4, pytest.approx(first - handoff))
    assert decode.prefix(req.hash_ids) == (4, pytest.approx(first))
    r.first_token(1, prefill, decode)
    assert 1 not in decode.joining
    assert decode.decode_ends[1] == pytest.approx(r.pool.now() + handoff + 4 * 0.01, abs=0.01)


def test_a_stream_that_came_in_one_burst_teaches_no_decode_pace():
    """Tokens relayed all at once (buffered on their way) say nothing of the engine's
    step: such a stream is not a decode sample; a paced one is."""
    cost = CostModel(decode_fixed_s=0.002, decode_s_per_request=0.0,
                     decode_s_per_context_token=0.0)
    r = router("round_robin", [("http://a", "both")], cost=cost)
    (inst,) = list(r.pool)
    r.decoded(inst, 15, 0.0)
    r.decoded(inst, 15, 1e-5)
    assert inst.tbt.samples == 0 and inst.tbt.ratio == 1.0
    r.decoded(inst, 15, 15 * 0.01)
    assert inst.tbt.samples == 1 and inst.tbt.ratio > 1.0


def test_the_live_conductor_pulls_only_from_the_store():
    """Engines pass KV to each other only through the store: a prefix held by a busy
    peer is never priced as a pull from that peer (the engine would recompute it), and
    a conductor that would do so is refused."""
    from mooncake_plugins.conductor.policies import Decision

    cost = CostModel(prefill_fixed_s=0.0, prefill_s_per_token=1e-3, prefill_s_per_token_sq=0.0,
                     transfer_latency_s=0.0)
    r = router("conductor", [("http://a", "both"), ("http://b", "both")], cost=cost,
               correct_ttft=False)
    prompt = {"model": "m", "prompt": list(range(1024)), "max_tokens": 2}
    req = r.hasher.request("/v1/completions", prompt)
    a = r.pool.get("http://a")
    a.learn(req.hash_ids, r.pool.now(), r.pool.cache_blocks)   # a holds the prefix...
    busy = r.hasher.request("/v1/completions", dict(prompt, prompt=[5] * 2048))
    _, view = r.decide(busy)
    r.admit(1, busy, Decision(0, 0, None, 0, 2.048, 0.0), view)   # ...and is busy 2 s
    decision, _ = r.decide(req)
    # b recomputes (1 s): pulling a's blocks (0.02 s) is no option without the store
    assert decision.pull_from is None and decision.prefill == 1, decision
    assert decision.predicted_ttft_s == pytest.approx(1.024, abs=0.01)
    with pytest.raises(ValueError, match="migrate=False"):
        Router(RouterConfig(make_policy("conductor", cost, Slo(30, 1)), Slo(30, 1), cost),
               Hasher(16), Pool())


def test_load_that_bypasses_the_router_is_read_from_the_engines_metrics():
    """An engine busy with requests that did not come through the router (vLLM's
    running and waiting gauges) is the more loaded one: load_balance sends elsewhere,
    /instances shows the external counts, and once the engine is idle again it is chosen
    again (the first instance wins ties)."""
    async def main() -> None:
        a, b = OpenAIDouble("a"), OpenAIDouble("b")
        a.running, a.waiting, a.mean_prompt = 4, 3, 2000.0
        async with AsyncExitStack() as stack:
            urls = [await serve(stack, a), await serve(stack, b)]
            r = router("load_balance", [(u, "both") for u in urls], health_interval_s=0.05)
            client = await stack.enter_async_context(TestClient(TestServer(r.app())))

            async def state() -> dict:
                return {i["url"]: i for i in await (await client.get("/instances")).json()}

            inst = r.pool.get(urls[0])
            await until(lambda: inst.external_waiting)
            s = (await state())[urls[0]]
            assert (s["external_running"], s["external_waiting"]) == (4, 3), s
            resp = await client.post("/v1/completions", json=complete("hello"))
            assert (await resp.json())["id"] == "b"
            # priced at the engine's mean prompt: three 2,000-token prefills queued, less
            # what ran since the reading (a health interval at most)
            queued = 3 * CostModel().prefill_s(2000)
            assert queued - 0.1 < inst.queue_s(r.pool.now()) <= queued
            a.running = a.waiting = 0
            await until(lambda: not inst.external_running)
            resp = await client.post("/v1/completions", json=complete("hello again"))
            assert (await resp.json())["id"] == "a"

    run(main())


def test_an_engine_too_busy_to_answer_its_metrics_in_time_keeps_its_load():
    # three 8,000-token prompts waiting (about 3 s of prefill) have not run down in 0.5 s
    async def main() -> None:
        a, b = OpenAIDouble("a"), OpenAIDouble("b")
        a.running, a.waiting, a.mean_prompt = 4, 3, 8000.0
        async with AsyncExitStack() as stack:
            urls = [await serve(stack, a), await serve(stack, b)]
            r = router("load_balance", [(u, "both") for u in urls], health_interval_s=0.02,
                       health_timeout_s=0.1)
            client = await stack.enter_async_context(TestClient(TestServer(r.app())))
            inst = r.pool.get(urls[0])
            await until(lambda: inst.external_waiting)
            a.running = a.waiting = 0
            a.metrics_delay_s = 0.3   # what it shows now never arrives in time
            await more_readings(a)   # each timed out
            assert inst.healthy and (inst.external_running, inst.external_waiting) == (4, 3)
            resp = await client.post("/v1/completions", json=complete("hello"))
            assert (await resp.json())["id"] == "b"

    run(main())


def test_an_engine_counts_the_routers_own_requests_as_its_own():
    """The engine's counts include what the router sent: only the excess is external,
    waiting first; an engine without vLLM's gauges has none."""
    from mooncake_plugins.conductor.router.engine_load import EngineLoad
    from mooncake_plugins.conductor.router.instances import (DEFAULT_OUTPUT_TOKENS,
                                                             UNKNOWN_PROMPT_TOKENS, _Flight)
    from mooncake_plugins.conductor.router.view import LiveView

    pool = Pool()
    inst = pool.add("http://127.0.0.1:1")
    now = pool.now()
    inst.flights[1] = _Flight(now, 0.1, 100)
    inst.flights[2] = _Flight(now, 0.1, 100, first_token=True)
    inst.decoding[2] = 100
    inst.observe_engine(EngineLoad(running=2, waiting=1), lambda n: n * 1e-3, now)
    assert (inst.external_running, inst.external_waiting) == (0, 1)
    assert inst.external_context == UNKNOWN_PROMPT_TOKENS   # nothing finished yet
    assert inst.external_output == DEFAULT_OUTPUT_TOKENS
    assert inst.queue_s(now) == pytest.approx(0.1 + UNKNOWN_PROMPT_TOKENS * 1e-3)
    inst.observe_engine(EngineLoad(running=4, waiting=0, mean_prompt_tokens=300.0,
                                   mean_output_tokens=20.0), lambda n: n * 1e-3, now)
    assert (inst.external_running, inst.external_waiting) == (2, 0)
    # two slots: both are held by external requests, each half way through 20 steps
    view = LiveView(pool, 16, 2, step_s=0.01)
    forecast = view.decode_forecast(0, now)
    assert (forecast.requests, forecast.context_tokens) == (4, 2 * 100 + 2 * 300)
    forecast = view.decode_forecast(0, now + 0.11)   # the external ones ended by then
    assert (forecast.requests, forecast.context_tokens) == (2, 2 * 100)
    inst.flights.clear()
    inst.decoding.clear()
    assert LiveView(pool, 16, 2, step_s=0.01).prefill_queue_s(0) == pytest.approx(0.1, abs=0.01)
    inst.observe_engine(None, lambda n: n * 1e-3, now)
    assert (inst.external_running, inst.external_waiting) == (0, 0)
    assert LiveView(pool, 16, 2, step_s=0.01).prefill_queue_s(0) == 0.0


def test_a_metrics_page_that_does_not_parse_is_logged_once_and_counts_nothing(caplog):
    async def main() -> None:
        a, b = OpenAIDouble("a"), OpenAIDouble("b")
        a.metrics_page = "vllm:num_requests_running{engine=\"0\"} many\n"
        async with AsyncExitStack() as stack:
            urls = [await serve(stack, a), await serve(stack, b)]
            r = router("load_balance", [(u, "both") for u in urls], health_interval_s=0.02)
            client = await stack.enter_async_context(TestClient(TestServer(r.app())))
            await more_readings(a)   # several checks
            resp = await client.post("/v1/completions", json=complete("hello"))
            assert (await resp.json())["id"] == "a"
            state = {i["url"]: i for i in await (await client.get("/instances")).json()}
            assert state[urls[0]]["healthy"] and state[urls[0]]["external_running"] == 0

    with caplog.at_level("WARNING"):
        run(main())
    warned = [m for m in caplog.messages if "does not parse" in m]
    assert len(warned) == 1, caplog.messages


def test_an_engine_of_another_block_size_is_reported_once(caplog):
    """An engine whose metrics give another KV block size than --block-tokens finds none
    of its prefixes in the router's hashes: an error says so once, naming the flag's
    value to use, and /instances shows the engine's size."""
    async def main() -> None:
        a = OpenAIDouble("a")
        a.block_size = 128
        async with AsyncExitStack() as stack:
            url = await serve(stack, a)
            client = await stack.enter_async_context(TestClient(TestServer(
                router("conductor", [(url, "both")], health_interval_s=0.05).app())))

            async def size() -> int | None:
                return (await (await client.get("/instances")).json())[0]["block_size"]

            async def size_is(expected: int) -> bool:
                return await size() == expected

            await until(lambda: size_is(128), timeout_s=10.0)
            await more_readings(a)   # several more readings of that size: still one error
            errors = [r for r in caplog.records if "--block-tokens 128" in r.getMessage()]
            assert len(errors) == 1 and errors[0].levelname == "ERROR"
            assert await size() == 128
            a.block_size = 16   # restarted to match: no more errors
            await until(lambda: size_is(16), timeout_s=10.0)
            await more_readings(a)
            assert len([r for r in caplog.records if "--block-tokens" in r.getMessage()]) == 1

    run(main())


def test_the_engines_last_reading_ages_until_the_next():
    """External load is what the engine showed when its /metrics was read: its waiting
    prefills run down from then (the router's own queue behind them), its running
    requests end half their mean output after it; a reading a second old holds no
    slot."""
    from mooncake_plugins.conductor.router.engine_load import EngineLoad
    from mooncake_plugins.conductor.router.instances import UNKNOWN_PROMPT_TOKENS, _Flight
    from mooncake_plugins.conductor.router.view import LiveView

    pool = Pool()
    inst = pool.add("http://127.0.0.1:1")
    now = pool.now()
    external = UNKNOWN_PROMPT_TOKENS * 1e-3
    inst.observe_engine(EngineLoad(running=0, waiting=1), lambda n: n * 1e-3, now)
    inst.flights[1] = _Flight(now, 0.1, 100)
    assert inst.queue_s(now) == pytest.approx(external + 0.1)
    assert inst.queue_s(now + 0.5) == pytest.approx(external - 0.5 + 0.1)
    assert inst.queue_s(now + external + 0.05) == pytest.approx(0.05)
    assert inst.queue_s(now + external + 1) == 0.0
    assert inst.queue_s(now + 0.25, ratio=2.0) == pytest.approx(external - 0.125 + 0.1)
    inst.flights.clear()
    # two slots, both held by external requests half way through 20 steps of 0.01 s
    full = EngineLoad(running=2, waiting=0, mean_output_tokens=20.0)
    inst.observe_engine(full, lambda n: n * 1e-3, pool.now())
    assert LiveView(pool, 16, 2, step_s=0.01).prefill_queue_s(0) == pytest.approx(0.1, abs=0.02)
    inst.observe_engine(full, lambda n: n * 1e-3, pool.now() - 1.0)
    view = LiveView(pool, 16, 2, step_s=0.01)
    assert view.prefill_queue_s(0) == 0.0
    assert view.decode_forecast(0, pool.now()).requests == 0
    # two waiting at a reading: each prefills 0.1 s after the one before, then decodes
    # 10 steps of 0.01 s: they leave the forecast 0.2 and 0.3 s after the reading
    seen = pool.now()
    inst.observe_engine(EngineLoad(running=0, waiting=2, mean_prompt_tokens=100.0,
                                   mean_output_tokens=10.0), lambda n: n * 1e-3, seen)
    view = LiveView(pool, 16, 8, step_s=0.01)
    assert [view.decode_forecast(0, seen + dt).requests for dt in (0.0, 0.25, 0.35)] == \
        [2, 1, 0]
