"""Fit the cost model to running engines: ``mooncake-conductor calibrate``.

Prefill: prompts of fresh random token ids (never cached) of several lengths, each with
``max_tokens: 1``, ``repeats`` times per length; the median time per length is fitted
by least squares to ``fixed + a n + b n^2`` with no coefficient below 0
(:func:`fit_nonnegative`).

Decode: one streamed request of ``decode_tokens`` tokens (``ignore_eos``), its time from
first to last token over the tokens between as the step of a batch of one; then
``decode_batch`` such requests at once, the median of their paces as the step of that
batch. The line through both gives ``decode_fixed_s`` and ``decode_s_per_request``
(what a client sees: the engine's step, or its API server's pace of streaming when that
is slower). A stream whose tokens all arrive at once says nothing of the pace and is
left out (a round in which every stream did is run again, up to three times).

Several instances are measured side by side, each round one prompt (its own) on every
instance at once, and their times pooled: engines that share a host's cores or memory
bandwidth are then timed as they run when the cluster is busy (alone, each is faster).

KV transfer, given a prefill and a decode instance (a P/D pair): after one handoff that
makes first contact (reported, not fitted), fresh prompts of the same lengths go through
vLLM's P/D handoff (:mod:`.pd_handoff`) and the decode leg (pull the KV, recompute the
last token, answer) is timed; a line through the median per length gives
``handoff_latency_s`` (its intercept, fitted >= 0 as the prefill's) and ``handoff_bytes_per_s``
(``kv_bytes_per_token`` over its slope), and ``kv_streamed_during_prefill`` is False:
the decode pulls after the prefill answered. The decode's
``vllm:external_prefix_cache_hits_total`` must grow (else it recomputed the prompts, and
the calibration fails saying so).

Loads from the shared store, given its view (``--store``) and two instances running our
store connector (``kv_both``): a fresh prompt on the first instance, which saves its
blocks; once the store holds them (up to ``SAVE_WAIT_S``), the same prompt on the second,
timed, which loads them. Its hit tokens are what its ``vllm:external_prefix_cache_hits_total``
grew by (none: it recomputed, and the calibration fails saying so), the load is its time
less that of a fresh prompt of the tokens it computed, sent to it right after (a paired
measurement: the fitted prefill, taken side by side, would not be), and a line through
the median per length gives ``transfer_latency_s`` and ``transfer_bytes_per_s``.

What the engines cannot tell from outside (how a step grows with its context, KV bytes
per token) keeps the given values. The result is the ``CostModel`` fields as JSON, what
``mooncake-conductor serve --cost-model`` reads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import time
from typing import Callable, Sequence

import aiohttp

from ..costmodel import CostModel
from .measured_ratio import BURST_S
from .pd_handoff import decode_params, prefill_body
from .store_view import StoreView

DEFAULT_LENGTHS = (16, 128, 256, 512, 1024, 1536)


def _least_squares(xs: Sequence[float], ys: Sequence[float], powers: Sequence[int]
                   ) -> list[float]:
    """Least-squares coefficients of ``y = sum(c_k x^p_k)`` over ``powers`` (normal
    equations, Gauss-Jordan with partial pivoting)."""
    k = len(powers)
    m = [[sum(x ** (p + q) for x in xs) for q in powers]
         + [sum(y * x ** p for x, y in zip(xs, ys))] for p in powers]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            raise ValueError("singular")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(k):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col])]
    return [m[i][k] / m[i][i] for i in range(k)]


def _polynomial(coef: Sequence[float], x: float) -> float:
    return sum(c * x ** p for p, c in enumerate(coef))


def fit_nonnegative(xs: Sequence[float], ys: Sequence[float], degree: int
                    ) -> tuple[float, ...]:
    """Least-squares ``(c0, ..., c_degree)`` of ``y = c0 + c1 x + ... `` with every
    coefficient >= 0: the best fit of the subsets of those terms (the others 0) whose
    coefficients all come out >= 0. Clamping an unconstrained fit's negative coefficient
    at 0 is not that, as the others stay fitted around it: one slow 128-token round
    once made such a fit put a 1,792-token prefill at 354 ms, measured at 169 ms."""
    if len(set(xs)) <= degree:
        raise ValueError(f"the lengths do not determine a polynomial of degree {degree} "
                         f"(need {degree + 1} distinct)")

    def residual(coef: Sequence[float]) -> float:
        return sum((y - _polynomial(coef, x)) ** 2 for x, y in zip(xs, ys))

    best = (0.0,) * (degree + 1)
    best_residual = residual(best)
    for mask in range(1, 1 << (degree + 1)):
        powers = [p for p in range(degree + 1) if mask >> p & 1]
        try:
            fitted = _least_squares(xs, ys, powers)
        except ValueError:
            continue
        if min(fitted) < 0:
            continue
        coef = [0.0] * (degree + 1)
        for p, c in zip(powers, fitted):
            coef[p] = c
        if (r := residual(coef)) < best_residual:
            best, best_residual = tuple(coef), r
    return best


FIT_TOLERANCE = 0.25
"""A fitted prefill time further than this (as a share) from a measured median is
reported: a round the host stalled in, or an engine that is not ``fixed + a n + b n^2``."""


def fit_misses(measured: Sequence[tuple[int, float]], coef: Sequence[float]) -> list[str]:
    """One line for each measured ``(tokens, seconds)`` the fitted prefill ``coef`` is
    more than :data:`FIT_TOLERANCE` away from."""
    lines = []
    for n, seconds in measured:
        fitted = _polynomial(coef, n)
        if seconds > 0 and abs(fitted / seconds - 1) > FIT_TOLERANCE:
            lines.append(f"warning: the fitted prefill of {n} tokens is {fitted * 1e3:.1f} ms, "
                         f"{fitted / seconds:.2f}x the {seconds * 1e3:.1f} ms measured: a "
                         f"noisy round? calibrate again, or with more --repeats")
    return lines


async def _timed(session: aiohttp.ClientSession, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {text[:300]}")
    return time.perf_counter() - t0


async def _decode_step(session: aiohttp.ClientSession, url: str, model: str,
                       tokens: int, rng: random.Random) -> float:
    body = {"model": model, "prompt": [rng.randrange(1, 1000) for _ in range(16)],
            "max_tokens": tokens, "ignore_eos": True, "stream": True, "temperature": 0.0}
    stamps = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError(f"{url} streamed no chunk for {tokens} tokens")
    # per token, not per chunk: a server that falls behind sends several tokens in one
    # (all in one: a pace of 0, which the callers take for the burst it is)
    return (stamps[-1] - stamps[0]) / (tokens - 1)


async def _handoff(session: aiohttp.ClientSession, prefill: str, decode: str, model: str,
                   n: int, rng: random.Random) -> float:
    """One P/D request of a fresh ``n``-token prompt: the decode leg's seconds."""
    body = {"model": model, "prompt": [rng.randrange(1, 1000) for _ in range(n)],
            "max_tokens": 1, "temperature": 0.0}
    async with session.post(prefill + "/v1/completions", json=prefill_body(body)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{prefill} answered {resp.status}: {(await resp.text())[:300]}")
        params = decode_params(await resp.json())
    if params is None:
        raise RuntimeError(f"{prefill} handed no KV to a decode (is it a kv_producer of a "
                           f"P/D connector?)")
    return await _timed(session, decode, dict(body, kv_transfer_params=params))


async def _external_hits(session: aiohttp.ClientSession, url: str) -> float | None:
    """The engine's ``vllm:external_prefix_cache_hits_total`` (None: not exported)."""
    async with session.get(url + "/metrics") as resp:
        if resp.status != 200:
            return None
        text = await resp.text()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:external_prefix_cache_hits_total")]
    return sum(values) if values else None


async def _decode_batch_step(session: aiohttp.ClientSession, url: str, model: str,
                             tokens: int, batch: int, rng: random.Random) -> list[float]:
    """The paces of ``batch`` streams started at once, less those that came in a burst."""
    return [pace for pace in await asyncio.gather(*(
        _decode_step(session, url, model, tokens, rng) for _ in range(batch)))
        if pace >= BURST_S]


async def _round(session: aiohttp.ClientSession, urls: Sequence[str], model: str, n: int,
                 rng: random.Random) -> list[float]:
    """One prefill of a fresh ``n``-token prompt on every instance at once."""
    return list(await asyncio.gather(*(_timed(session, url, {
        "model": model, "prompt": [rng.randrange(1, 1000) for _ in range(n)],
        "max_tokens": 1, "temperature": 0.0}) for url in urls)))


async def calibrate(urls: str | Sequence[str], model: str,
                    lengths: Sequence[int] = DEFAULT_LENGTHS, repeats: int = 3,
                    decode_tokens: int = 32, decode_batch: int = 4,
                    base: CostModel | None = None,
                    progress: Callable[[str], None] = lambda _: None,
                    seed: int | None = None,
                    pd_pair: tuple[str, str] | None = None,
                    store: StoreView | None = None
                    ) -> tuple[CostModel, list[tuple[int, float]]]:
    """The model fitted to ``urls`` (measured side by side) and the measured
    ``(prompt tokens, median prefill seconds)``; with ``pd_pair`` (a prefill and a decode
    URL) the KV handoff too; with ``store`` the loads from it (the first two ``urls``
    save and load). Prompts are drawn fresh each call (``seed`` None): a second
    calibration of the same engine must not hit its prefix cache."""
    urls = [url.rstrip("/") for url in ([urls] if isinstance(urls, str) else urls)]
    if store is not None and len(urls) < 2:
        raise ValueError("--store: a load is timed between two instances (one saves, the "
                         "other loads): give two that are not @decode")
    rng = random.Random(random.SystemRandom().randrange(1 << 62) if seed is None else seed)
    measured: list[tuple[int, float]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(_timed(session, url, {"model": model, "prompt": [1, 2, 3],
                                                     "max_tokens": 1}) for url in urls))
        for n in lengths:
            times = [t for _ in range(repeats) for t in await _round(session, urls, model, n, rng)]
            measured.append((n, statistics.median(times)))
            progress(f"prefill {n:6d} tokens: {measured[-1][1] * 1e3:8.1f} ms")
        side = f" ({len(urls)} instances side by side)" if len(urls) > 1 else ""
        step = await _pace(session, urls, model, decode_tokens, 1, rng)
        progress(f"decode step (batch 1): {step * 1e3:.2f} ms{side}")
        base = base or CostModel()
        per_request = base.decode_s_per_request
        if decode_batch > 1:
            full = await _pace(session, urls, model, decode_tokens, decode_batch, rng)
            per_request = max(0.0, (full - step) / (decode_batch - 1))
            progress(f"decode step (batch {decode_batch}): {full * 1e3:.2f} ms{side}, "
                     f"{per_request * 1e3:.2f} ms a request")
        if pd_pair is not None:
            base = await _calibrate_handoff(session, *(u.rstrip("/") for u in pd_pair),
                                            model, lengths, repeats, rng, base, progress)
        c0, c1, c2 = fit_nonnegative([n for n, _ in measured], [s for _, s in measured], 2)
        for line in fit_misses(measured, (c0, c1, c2)):
            progress(line)
        base = dataclasses.replace(base, prefill_fixed_s=c0, prefill_s_per_token=c1,
                                   prefill_s_per_token_sq=c2,
                                   decode_fixed_s=max(step - per_request, 0.0),
                                   decode_s_per_request=per_request)
        if store is not None:
            base = await _calibrate_loads(session, urls[0], urls[1], model, lengths,
                                          repeats, rng, base, store, progress)
    return base, measured


async def _pace(session: aiohttp.ClientSession, urls: Sequence[str], model: str,
                tokens: int, batch: int, rng: random.Random, rounds: int = 3) -> float:
    """The median pace of ``batch`` streams at once on every instance, over up to
    ``rounds`` rounds until one gives paces (streams that came in a burst do not)."""
    for _ in range(rounds):
        paces = [p for ps in await asyncio.gather(*(
            _decode_batch_step(session, url, model, tokens, batch, rng) for url in urls))
            for p in ps]
        if paces:
            return statistics.median(paces)
    raise RuntimeError(f"every stream of {tokens} tokens came in one burst ({rounds} "
                       f"rounds of {batch} a time): no decode pace to measure")


MIN_S_PER_TOKEN = 1e-9
"""Slopes below this (a transfer lost in the noise of the fixed cost) are taken as this."""


async def _calibrate_handoff(session: aiohttp.ClientSession, prefill: str, decode: str,
                             model: str, lengths: Sequence[int], repeats: int,
                             rng: random.Random, base: CostModel,
                             progress: Callable[[str], None]) -> CostModel:
    """``base`` with the transfer fields fitted to the decode legs of P/D requests."""
    first = await _handoff(session, prefill, decode, model, min(lengths), rng)
    progress(f"P/D handoff, first contact: {first * 1e3:.1f} ms (not fitted)")
    hits_before = await _external_hits(session, decode)
    medians = []
    for n in lengths:
        medians.append(statistics.median([await _handoff(session, prefill, decode, model, n,
                                                         rng) for _ in range(repeats)]))
        progress(f"P/D handoff {n:6d} tokens: {medians[-1] * 1e3:8.1f} ms (decode leg)")
    hits_after = await _external_hits(session, decode)
    if hits_before is not None and hits_after is not None and hits_after <= hits_before:
        raise RuntimeError(f"{decode} loaded no KV from {prefill} (its external prefix "
                           f"cache hits did not grow): it recomputed the prompts")
    c0, c1 = fit_nonnegative(list(lengths), medians, 1)
    c1 = max(c1, MIN_S_PER_TOKEN)
    rate = base.kv_bytes_per_token / c1
    progress(f"P/D handoff: {c0 * 1e3:.1f} ms + {c1 * 1e6:.2f} us/token "
             f"({rate / 1e9:.3f} GB/s at {base.kv_bytes_per_token} B/token)")
    return dataclasses.replace(base, handoff_latency_s=c0,
                               handoff_bytes_per_s=rate, kv_streamed_during_prefill=False)


SAVE_WAIT_S = 30.0
"""How long the saving instance's blocks may take to reach the store."""


async def _load(session: aiohttp.ClientSession, saver: str, loader: str, model: str, n: int,
                rng: random.Random, store: StoreView) -> tuple[int, float]:
    """A fresh ``n``-token prompt saved by ``saver``, then loaded by ``loader``: the
    tokens it loaded and the seconds of the load (its time less that of a fresh prompt
    of the tokens it computed, on the same engine right after)."""
    body = {"model": model, "prompt": [rng.randrange(1, 1000) for _ in range(n)],
            "max_tokens": 1, "temperature": 0.0}
    await _timed(session, saver, body)
    want = (n - 1) // store.hashes.block_size
    deadline = time.monotonic() + SAVE_WAIT_S
    while await asyncio.to_thread(store.prefix_blocks, body["prompt"]) < want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the store at {store.address} did not get the {want} "
                               f"block(s) of a {n}-token prompt from {saver} in "
                               f"{SAVE_WAIT_S:.0f} s (does it run our store connector, "
                               f"kv_both, with --block-tokens {store.hashes.block_size}?)")
        await asyncio.sleep(0.05)
    before = await _external_hits(session, loader)
    seconds = await _timed(session, loader, body)
    after = await _external_hits(session, loader)
    if before is None or after is None:
        raise RuntimeError(f"{loader} exports no vllm:external_prefix_cache_hits_total: "
                           f"its loads cannot be counted")
    hit = int(after - before)
    if hit <= 0:
        raise RuntimeError(f"{loader} loaded none of the {want} block(s) the store holds "
                           f"of a {n}-token prompt: it recomputed them (does it run our "
                           f"store connector on the same master?)")
    # the same engine computing only the rest, a fresh prompt of that length, at once
    rest = await _timed(session, loader, dict(body, prompt=[
        rng.randrange(1, 1000) for _ in range(max(1, n - hit))]))
    return hit, seconds - rest


async def _calibrate_loads(session: aiohttp.ClientSession, saver: str, loader: str,
                           model: str, lengths: Sequence[int], repeats: int,
                           rng: random.Random, base: CostModel, store: StoreView,
                           progress: Callable[[str], None]) -> CostModel:
    """``base`` with the load fields fitted to ``loader``'s loads of prompts ``saver``
    saved to the store."""
    usable = [n for n in lengths if (n - 1) // store.hashes.block_size >= 1]
    if len(set(usable)) < 2:
        raise ValueError(f"a store load needs 2 distinct lengths of more than one block "
                         f"({store.hashes.block_size} tokens): give longer --lengths")
    first = await _load(session, saver, loader, model, min(usable), rng, store)
    progress(f"store load, first contact: {first[1] * 1e3:.1f} ms (not fitted)")
    points = []
    for n in usable:
        loads = [await _load(session, saver, loader, model, n, rng, store)
                 for _ in range(repeats)]
        points.append((statistics.median(h for h, _ in loads),
                       statistics.median(s for _, s in loads)))
        progress(f"store load {n:6d} tokens: {points[-1][0]:6.0f} loaded, "
                 f"{points[-1][1] * 1e3:8.1f} ms")
    c0, c1 = fit_nonnegative([h for h, _ in points], [s for _, s in points], 1)
    c1 = max(c1, MIN_S_PER_TOKEN)
    rate = base.kv_bytes_per_token / c1
    progress(f"store load: {c0 * 1e3:.1f} ms + {c1 * 1e6:.2f} us/token "
             f"({rate / 1e9:.3f} GB/s at {base.kv_bytes_per_token} B/token)")
    return dataclasses.replace(base, transfer_latency_s=c0,
                               transfer_bytes_per_s=rate)


def run(urls: str | Sequence[str], model: str, **kw) -> tuple[CostModel, list[tuple[int, float]]]:
    return asyncio.run(calibrate(urls, model, **kw))
