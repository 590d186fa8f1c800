"""The router's HTTP front (aiohttp): OpenAI completions and chat completions, streaming
or not, routed by a policy; instance administration; Prometheus metrics.

Per request: validate it (400 with a message), hash its prompt (:mod:`.prompts`), take a
:class:`~.view.LiveView`, let the policy choose. A rejected request gets 429 with
``Retry-After``. Otherwise it goes to the chosen instance (``both`` instances), or, where
instances have P/D roles, first to the chosen prefill instance for one token with
``kv_transfer_params: {"do_remote_decode": true, ...}`` and then to the chosen decode
instance with the handle the prefill returned (what our P/D connector and vLLM's in-tree
Mooncake/NIXL connectors expect). An instance that cannot be reached before it answered
is taken out (until its ``/health`` answers) and the request is chosen again, up to
``retries`` times; one that fails mid-answer ends the answer with an error (a streamed
answer gets a final ``data: {"error": ...}`` event).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``
(the first usable instance's), ``GET /instances``, ``POST /instances`` (``{"url", "role"}``:
add or undrain), ``POST /instances/drain`` and ``DELETE /instances`` (``{"url"}``),
``GET /health``, ``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import math
import re
import statistics
import time
from collections import deque
from dataclasses import dataclass
import aiohttp
from aiohttp import web
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               Histogram, generate_latest)

from ..costmodel import CostModel
from ..policies import POOL, ConductorPolicy, Decision, Policy, Slo
from .instances import DEFAULT_OUTPUT_TOKENS, Instance, Pool, _Flight
from .engine_load import parse_engine_load
from .kv_events import KvEventIndex, subscribe
from .measured_ratio import BURST_S
from .pd_handoff import decode_params, prefill_body
from .prompts import BadRequest, Hasher, RoutedRequest
from .store_view import StoreView
from .view import LiveView

log = logging.getLogger(__name__)


@dataclass
class RouterConfig:
    """How the router decides and behaves."""

    policy: Policy
    slo: Slo
    cost: CostModel
    block_tokens: int = 16
    decode_max_batch: int = 256
    retries: int = 2
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    slow_checks_to_take_out: int = 3
    """Health checks in a row that time out before an instance is taken out (a busy
    engine's API server can be slow to answer; one that refuses, or answers other than
    200, is taken out at once)."""
    request_timeout_s: float = 600.0
    kv_events_timeout_s: float = 30.0
    """An instance routed to but silent on its KV events this long is forgotten (its
    stream stopped: what the view holds of it can no longer be trusted)."""
    store: StoreView | None = None
    """The shared store's holdings (``pool_prefix``), when the router knows its master."""
    correct_ttft: bool = True
    """Scale each instance's TTFT and decode estimates by the ratios measured there
    (from streamed requests, whose first answer byte is their first token)."""
    slo_quantile: float | None = None
    """``conductor`` with early rejection: also refuse a request whose estimate, times
    this quantile of the recent measured / estimated TTFT ratios, breaks the TTFT SLO
    (0.9: the requests served meet it about 9 times in 10 while estimates err as they
    did lately). None: refuse on the estimate alone."""
    decision_headers: bool = False
    """Name in each answer's headers the instances chosen and the TTFT it was admitted
    with (``X-Conductor-*``): for a client that times the router's estimates; off by
    default, as they show clients the engines' internal addresses."""
    prefill_step_tokens: int | None = None
    """The engines' ``--max-num-batched-tokens``: they prefill what waits in steps of up
    to this many tokens, so a request's first token comes with the later prompts that
    fill its last step (:meth:`~.instances.Instance.batch_prefills`). None: one prompt
    after the other."""


ERROR_WINDOW = 64
"""Recent streamed requests whose measured / estimated TTFT ratio the SLO quantile is
taken over."""
ERROR_MIN_SAMPLES = 16
"""Fewer ratios than this: no quantile bound yet."""


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.routed = Counter("conductor_routed_total", "Requests sent to an instance",
                              ["instance", "side"], registry=self.registry)
        self.rejected = Counter("conductor_rejected_total", "Requests refused early (429)",
                                registry=self.registry)
        self.failed = Counter("conductor_failed_total", "Requests that ended in an error "
                              "after routing", ["instance"], registry=self.registry)
        self.hit_tokens = Counter("conductor_hit_tokens_total", "Prompt tokens the chosen "
                                  "instance was predicted to hold or load from the store",
                                  registry=self.registry)
        self.pool_tokens = Counter("conductor_pool_hit_tokens_total", "Prompt tokens routed "
                                   "to be loaded from the shared store",
                                   registry=self.registry)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("conductor_ttft_seconds", "Measured time to the first byte of "
                              "the answer", ["instance"], buckets=buckets,
                              registry=self.registry)
        self.predicted = Histogram("conductor_predicted_ttft_seconds", "The policy's TTFT "
                                   "estimate", ["instance"], buckets=buckets,
                                   registry=self.registry)
        self.ratio = Gauge("conductor_ttft_ratio", "Measured / cost-model TTFT, learned "
                           "from streamed requests", ["instance"],
                           registry=self.registry)


class Router:
    """The routing state: instances, policy, metrics; :meth:`app` serves it."""

    def __init__(self, config: RouterConfig, hasher: Hasher, pool: Pool | None = None) -> None:
        self.config = config
        self.hasher = hasher
        self.pool = pool or Pool()
        self.metrics = _Metrics()
        self._ids = itertools.count(1)
        self._session: aiohttp.ClientSession | None = None
        self._events: dict[str, tuple[KvEventIndex, asyncio.Task]] = {}
        self._last_routed: dict[str, float] = {}
        self._errors: deque[float] = deque(maxlen=ERROR_WINDOW)   # measured / estimated
        self._bad_metrics: set[str] = set()   # instances whose /metrics did not parse
        self._other_blocks: set[str] = set()  # instances of another block size, logged
        if config.slo_quantile is not None and not 0 < config.slo_quantile < 1:
            raise ValueError(f"the SLO quantile must be in (0, 1), got {config.slo_quantile}")
        if config.prefill_step_tokens is not None and config.prefill_step_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got "
                             f"{config.prefill_step_tokens}")
        if not (config.health_interval_s > 0 and config.health_timeout_s > 0
                and config.slow_checks_to_take_out >= 1):
            raise ValueError(f"health checks need a positive interval and timeout and at "
                             f"least one timeout to take an instance out, got "
                             f"{config.health_interval_s}, {config.health_timeout_s}, "
                             f"{config.slow_checks_to_take_out}")
        if isinstance(config.policy, ConductorPolicy) and config.policy.migrate:
            raise ValueError("the live router has no path for KV between engines but the "
                             "store (which it prices as such): make the conductor policy "
                             "with migrate=False")

    # -- decisions -----------------------------------------------------------------------
    def decide(self, req: RoutedRequest, pool_blocks: int = 0) -> tuple[Decision, LiveView]:
        batch = self.config.decode_max_batch
        view = LiveView(self.pool, self.config.block_tokens, batch,
                        self.config.cost.decode_step_s(batch, 0.0), pool_blocks,
                        self.config.correct_ttft)
        if not view.prefill or not view.decode:
            raise web.HTTPServiceUnavailable(text=json.dumps({"error": "no usable instance"}),
                                             content_type="application/json")
        decision = self.config.policy.choose(req, view)
        bound = self.ttft_bound(decision)
        if bound is not None and not decision.rejected:
            decision = dataclasses.replace(decision, reject_reason=(
                f"predicted TTFT {decision.predicted_ttft_s:.3f} s, "
                f"{self.config.slo_quantile:g} quantile {bound:.3f} s > SLO "
                f"{self.config.slo.ttft_s:.3f} s"))
        return decision, view

    def ttft_bound(self, decision: Decision) -> float | None:
        """``decision``'s TTFT times the SLO quantile of the recent errors, where that
        breaks the SLO and such a bound applies (``conductor`` rejecting early, enough
        samples); else None."""
        policy, q = self.config.policy, self.config.slo_quantile
        if q is None or not (isinstance(policy, ConductorPolicy) and policy.early_reject) \
                or len(self._errors) < ERROR_MIN_SAMPLES:
            return None
        bound = decision.predicted_ttft_s * statistics.quantiles(
            self._errors, n=100, method="inclusive")[min(98, max(0, round(q * 100) - 1))]
        return bound if bound > self.config.slo.ttft_s else None

    def admit(self, rid: int, req: RoutedRequest, decision: Decision, view: LiveView
              ) -> tuple[Instance, Instance]:
        """Apply ``decision``: the request is in flight on its prefill (and decode)
        instance."""
        prefill = view.prefill[decision.prefill]
        local = prefill.prefix(req.hash_ids)[0]   # before this request is learned
        # engines that prefill and decode (no P/D roles) decode where they prefilled
        decode = view.decode[decision.decode] if self.pool.disaggregated() else prefill
        now = self.pool.now()
        cached = min(decision.reused_blocks * self.config.block_tokens, req.input_length)
        model_s = decision.predicted_ttft_s if decision.model_ttft_s is None \
            else decision.model_ttft_s
        prefill.flights[rid] = _Flight(now, self.config.cost.prefill_s(req.input_length, cached),
                                       req.input_length, tuple(req.hash_ids),
                                       output_tokens=req.max_tokens or DEFAULT_OUTPUT_TOKENS,
                                       model_ttft_s=model_s,
                                       expected_ttft_s=decision.predicted_ttft_s,
                                       timed=req.stream, tokens=req.input_length - cached)
        if self.config.prefill_step_tokens:   # at the TTFT ratio the view priced it with
            prefill.batch_prefills(self.config.prefill_step_tokens, now,
                                   view.ttft_ratio(decision.prefill))
        first = now + decision.predicted_ttft_s   # P/D: at the decode, after the handoff
        prefill.learn(req.hash_ids, first - self.handoff_s(req.input_length, prefill, decode),
                      self.pool.cache_blocks)
        self._last_routed[prefill.url] = now
        if decode is not prefill:
            decode.learn(req.hash_ids, first, self.pool.cache_blocks)
            output = req.max_tokens or DEFAULT_OUTPUT_TOKENS
            decode.joining[rid] = (first, first + (output - 1) * self.step_s(decode),
                                   req.input_length)
        self.metrics.hit_tokens.inc(cached)
        if decision.pull_from == POOL:   # what the instance itself holds is not loaded
            self.metrics.pool_tokens.inc(cached - min(local * self.config.block_tokens,
                                                      req.input_length))
        self.metrics.predicted.labels(prefill.url).observe(decision.predicted_ttft_s)
        return prefill, decode

    def first_token(self, rid: int, inst: Instance, decode: Instance | None = None) -> None:
        """Request ``rid``'s prefill on ``inst`` is done: it decodes on ``decode`` (``inst``
        itself where it is not P/D) from now on."""
        flight = inst.flights.get(rid)
        if flight is not None and not flight.first_token:
            flight.first_token = True
            now = self.pool.now()
            decode = decode or inst
            decode.joining.pop(rid, None)
            decode.decoding[rid] = flight.context_tokens
            decode.decode_ends[rid] = now + self.handoff_s(flight.context_tokens, inst, decode) \
                + (flight.output_tokens - 1) * self.step_s(decode)
            inst.learn(flight.hash_ids, now, self.pool.cache_blocks)  # computed

    def handoff_s(self, tokens: int, prefill: Instance, decode: Instance) -> float:
        """From a prefill's end on ``prefill`` to its first token on ``decode`` (none where
        they are one engine; the policies' ``Policy._handoff_s``)."""
        return 0.0 if decode is prefill else self.config.cost.handoff_s(tokens)

    def first_byte(self, rid: int, inst: Instance) -> None:
        """The client gets request ``rid``'s first answer byte (the prefill was on
        ``inst``): for a streamed request that is its first token, which teaches
        ``inst``'s TTFT ratio (P/D: the decode's first token, transfer included)."""
        flight = inst.flights.get(rid)
        if flight is not None and flight.timed:
            measured = self.pool.now() - flight.started_s
            inst.ttft.add(flight.model_ttft_s, measured)
            self.metrics.ratio.labels(inst.url).set(inst.ttft.ratio)
            if flight.expected_ttft_s > 0:
                self._errors.append(measured / flight.expected_ttft_s)

    def model_step_s(self, inst: Instance) -> float:
        """The cost model's decode step on ``inst`` for the batch it decodes now."""
        return self.config.cost.decode_step_s(max(1, len(inst.decoding)),
                                              sum(inst.decoding.values()))

    def step_s(self, inst: Instance) -> float:
        """The decode step to expect on ``inst`` now (the model's, at the measured pace)."""
        ratio = inst.tbt.ratio if self.config.correct_ttft else 1.0
        return self.model_step_s(inst) * ratio

    def decoded(self, inst: Instance, tokens: int, seconds: float) -> None:
        """A streamed answer relayed ``tokens`` tokens after its first in ``seconds``
        (one that came in a burst teaches nothing)."""
        if tokens > 0 and seconds >= tokens * BURST_S:
            inst.tbt.add(tokens * self.model_step_s(inst), seconds)

    def finish(self, rid: int, *instances: Instance) -> None:
        for inst in instances:
            inst.flights.pop(rid, None)
            inst.decoding.pop(rid, None)
            inst.decode_ends.pop(rid, None)
            inst.joining.pop(rid, None)

    def take_out(self, inst: Instance, why: str) -> None:
        if inst.healthy:
            log.warning("instance %s taken out: %s", inst.url, why)
        inst.healthy = False
        inst.failures += 1

    # -- HTTP ----------------------------------------------------------------------------
    async def route(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "the body must be JSON")
        try:
            req = self.hasher.request(request.path, body)
        except BadRequest as exc:
            return _error(400, str(exc))
        pool_blocks = 0
        if self.config.store is not None and req.tokens is not None:
            pool_blocks = await asyncio.get_running_loop().run_in_executor(
                None, self.config.store.prefix_blocks, req.tokens)
        tried: set[str] = set()
        for _ in range(self.config.retries + 1):
            decision, view = self.decide(req, pool_blocks)
            if decision.rejected:
                self.metrics.rejected.inc()
                late = decision.predicted_ttft_s - self.config.slo.ttft_s
                return _error(429, f"rejected early: {decision.reject_reason}",
                              {"Retry-After": str(max(1, math.ceil(late)))})
            rid = next(self._ids)
            prefill, decode = self.admit(rid, req, decision, view)
            log.debug("request %d (%d tokens, %d cached%s): prefill %s, decode %s, "
                      "predicted TTFT %.3f s", rid, req.input_length,
                      decision.reused_blocks * self.config.block_tokens,
                      " in the store" if decision.pull_from == POOL else "", prefill.url,
                      decode.url, decision.predicted_ttft_s)
            chosen = {"X-Conductor-Prefill": prefill.url, "X-Conductor-Decode": decode.url,
                      "X-Conductor-Predicted-TTFT": f"{decision.predicted_ttft_s:.4f}"
                      } if self.config.decision_headers else {}
            try:
                if decode is prefill:
                    return await self._forward(request, body, rid, prefill, "both", chosen)
                params = await self._prefill(request, body, rid, prefill, decode)
                return await self._forward(request, dict(body, kv_transfer_params=params),
                                           rid, decode, "decode", chosen, started=prefill)
            except _Unreachable as exc:
                tried.add(exc.instance.url)
                self.take_out(exc.instance, str(exc))
            finally:
                self.finish(rid, prefill, decode)
        return _error(502, f"no instance could take the request (tried {sorted(tried)})")

    async def _prefill(self, request: web.Request, body: dict, rid: int,
                       inst: Instance, decode: Instance) -> dict | None:
        """The prefill leg of a P/D request: one token; the decode's kv_transfer_params."""
        first = prefill_body(body)
        self.metrics.routed.labels(inst.url, "prefill").inc()
        try:
            async with self._http().post(inst.url + request.path, json=first) as resp:
                if resp.status != 200:
                    raise web.HTTPBadGateway(text=await resp.text())
                answer = await resp.json()
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise _Unreachable(inst, f"prefill: {exc!r}") from exc
        self.first_token(rid, inst, decode)
        return decode_params(answer)

    async def _forward(self, request: web.Request, body: dict, rid: int, inst: Instance,
                       side: str, chosen: dict[str, str], started: Instance | None = None
                       ) -> web.StreamResponse:
        """Send ``body`` to ``inst`` and relay its answer as it comes, with the headers
        ``chosen`` (the instances and the TTFT the request was admitted with, where the
        router names them)."""
        self.metrics.routed.labels(inst.url, side).inc()
        t0 = time.perf_counter()
        try:
            resp = await self._http().post(inst.url + request.path, json=body)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise _Unreachable(inst, repr(exc)) from exc
        out = web.StreamResponse(status=resp.status,
                                 headers={**chosen, "Content-Type": resp.headers.get(
                                     "Content-Type", "application/json")})
        first = True
        try:
            try:
                chunk = await resp.content.readany()
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                raise _Unreachable(inst, repr(exc)) from exc   # nothing relayed yet
            await out.prepare(request)
            # server-sent events that came after the first chunk, from t_first to t_last,
            # and the last chunk that carried the answer's usage (where the client asked)
            events, t_first, usage = 0, 0.0, b""
            while chunk:
                if first:
                    first = False
                    t_first = time.perf_counter()
                    self.metrics.ttft.labels(inst.url).observe(t_first - t0)
                    self.first_token(rid, started or inst)
                    self.first_byte(rid, started or inst)
                else:
                    events += chunk.count(b"data: {")
                    t_last = time.perf_counter()
                    if b'"completion_tokens"' in chunk:
                        usage = chunk
                await out.write(chunk)
                chunk = await resp.content.readany()
            if events > 0:   # a stream of tokens: its pace teaches the decode ratio
                self.decoded(inst, _tokens_after_first(usage, events), t_last - t_first)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError,
                aiohttp.ClientPayloadError) as exc:
            self.metrics.failed.labels(inst.url).inc()
            self.take_out(inst, f"failed mid-answer: {exc!r}")
            text = f"instance {inst.url} failed mid-answer: {exc!r}"
            await out.write((f"data: {json.dumps({'error': text})}\n\n" if
                             "event-stream" in out.headers["Content-Type"]
                             else json.dumps({"error": text})).encode())
        finally:
            resp.release()
        await out.write_eof()
        return out

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                total=self.config.request_timeout_s, sock_connect=5))
        return self._session

    # -- administration ------------------------------------------------------------------
    async def instances(self, request: web.Request) -> web.Response:
        if request.method == "GET":
            return web.json_response([i.describe() for i in self.pool])
        try:
            body = await request.json()
            url = body["url"]
            if not isinstance(url, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return _error(400, 'the body must be {"url": ..., "role": ...}')
        try:
            if request.method == "POST" and request.path.endswith("/drain"):
                inst = self.pool.drain(url)
            elif request.method == "POST":
                inst = self.pool.add(url, body.get("role", "both"), body.get("kv_events"))
                self._listen(inst)
            else:
                inst = self.pool.remove(url)
                self._stop_listening(inst.url)
        except KeyError as exc:
            return _error(404, str(exc))
        except ValueError as exc:
            return _error(400, str(exc))
        return web.json_response(inst.describe())

    async def models(self, request: web.Request) -> web.Response:
        for inst in self.pool:
            if inst.usable:
                try:
                    async with self._http().get(inst.url + "/v1/models") as resp:
                        return web.Response(status=resp.status, body=await resp.read(),
                                            content_type="application/json")
                except (aiohttp.ClientConnectionError, asyncio.TimeoutError):
                    continue
        return _error(503, "no usable instance")

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(self, request: web.Request) -> web.Response:
        usable = sum(i.usable for i in self.pool)
        return web.json_response({"instances": len(self.pool), "usable": usable},
                                 status=200 if usable else 503)

    def _listen(self, inst: Instance) -> None:
        """Read ``inst``'s KV events (if it publishes them) into the view."""
        if inst.kv_events is None or inst.url in self._events:
            return
        index = KvEventIndex(inst, self.config.block_tokens, self.pool.cache_blocks)
        task = asyncio.get_running_loop().create_task(
            subscribe(inst.kv_events, index, self.pool.now))
        self._events[inst.url] = (index, task)

    def _stop_listening(self, url: str) -> None:
        entry = self._events.pop(url, None)
        if entry is not None:
            entry[1].cancel()

    def _age_out(self) -> None:
        """Forget what the view holds of an instance whose KV events stopped."""
        now = self.pool.now()
        for url, (index, _) in self._events.items():
            routed = self._last_routed.get(url)
            if routed is None or now - routed < self.config.kv_events_timeout_s:
                continue
            if index.last_batch_s < routed and index.instance.blocks:
                log.warning("instance %s: no KV events for %.0f s while serving: its "
                            "cache entries are forgotten", url, now - routed)
                index.forget()

    async def _check_health(self) -> None:
        """Ask every instance's /health and /metrics now and then, all at once: one that
        answers its health check comes back, its metrics give its external load; age
        out the view of instances whose KV events stopped."""
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            self._age_out()
            instances = list(self.pool)
            timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
            await asyncio.gather(*(self._check(inst, timeout) for inst in instances),
                                 *(self._observe_engine(inst, timeout) for inst in instances))

    async def _check(self, inst: Instance, timeout: aiohttp.ClientTimeout) -> None:
        try:
            async with self._http().get(inst.url + "/health", timeout=timeout) as r:
                why = None if r.status == 200 else f"health check answered {r.status}"
        except asyncio.TimeoutError:
            inst.slow_checks += 1
            if inst.slow_checks >= self.config.slow_checks_to_take_out:
                self.take_out(inst, f"{inst.slow_checks} health checks in a row timed out "
                                    f"({self.config.health_timeout_s:g} s)")
            return
        except aiohttp.ClientError as exc:
            why = f"health check failed: {exc!r}"
        inst.slow_checks = 0
        if why is not None:
            self.take_out(inst, why)
        elif not inst.healthy:
            log.info("instance %s is back", inst.url)
            inst.healthy = True

    async def _observe_engine(self, inst: Instance, timeout: aiohttp.ClientTimeout) -> None:
        """Read the engine's own load from its /metrics (the requests it runs and holds
        beyond the router's are external load); an engine that gives none, or a page
        that does not parse (logged once until one does), counts as having none. One
        that does not answer in time keeps what it last showed, aging from when it was
        read: a busy engine answers late, and must not look idle for it."""
        load = None
        try:
            async with self._http().get(inst.url + "/metrics", timeout=timeout) as r:
                page = await r.text() if r.status == 200 else ""
            load = parse_engine_load(page)
            self._bad_metrics.discard(inst.url)
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            log.debug("instance %s: /metrics gave no answer (%r): its last load is kept",
                      inst.url, exc)
            return   # the health check takes a lost instance out
        except ValueError as exc:   # also a page that is not UTF-8
            if inst.url not in self._bad_metrics:
                self._bad_metrics.add(inst.url)
                log.warning("instance %s: its /metrics page does not parse (%s): no "
                            "external load is counted for it", inst.url, exc)
        inst.observe_engine(load, self.config.cost.prefill_s, self.pool.now())
        if load is None or load.block_size is None:
            return
        if load.block_size == self.config.block_tokens:
            self._other_blocks.discard(inst.url)
        elif inst.url not in self._other_blocks:
            self._other_blocks.add(inst.url)
            log.error("instance %s keeps KV blocks of %d tokens, but the router hashes "
                      "prompts in blocks of %d (--block-tokens): it will find none of "
                      "the prefixes that instance holds or saved to the store; start the "
                      "router with --block-tokens %d", inst.url, load.block_size,
                      self.config.block_tokens, load.block_size)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        task_key = web.AppKey("health", asyncio.Task)

        async def start(app: web.Application) -> None:
            app[task_key] = asyncio.create_task(self._check_health())
            for inst in self.pool:
                self._listen(inst)

        async def stop(app: web.Application) -> None:
            app[task_key].cancel()
            for url in list(self._events):
                self._stop_listening(url)
            if self._session is not None:
                await self._session.close()
                self._session = None
            if self.config.store is not None:
                self.config.store.close()

        app.on_startup.append(start)
        app.on_cleanup.append(stop)
        app.router.add_post("/v1/completions", self.route)
        app.router.add_post("/v1/chat/completions", self.route)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/instances", self.instances)
        app.router.add_post("/instances", self.instances)
        app.router.add_post("/instances/drain", self.instances)
        app.router.add_delete("/instances", self.instances)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        return app


_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


def _tokens_after_first(usage: bytes, events: int) -> int:
    """Tokens streamed after the first chunk: the answer's own count less one where its
    usage came (``stream_options.include_usage``), else the ``events`` that followed (one
    a token, but vLLM puts a few tokens in one event when its API server lags)."""
    counts = _COMPLETION_TOKENS.findall(usage)
    return int(counts[-1]) - 1 if counts else events


class _Unreachable(Exception):
    """An instance failed before any of its answer was relayed: choose again."""

    def __init__(self, instance: Instance, why: str) -> None:
        super().__init__(why)
        self.instance = instance


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status,
                             headers=headers)


