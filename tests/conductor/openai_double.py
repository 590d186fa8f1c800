"""A TEST DOUBLE of a vLLM OpenAI server, for the router's logic tests: it records the
bodies it receives and answers completions (JSON or a stream of server-sent events) after
``delay_s`` (plus ``per_token_s`` per prompt token, and ``step_s`` between streamed
tokens, plus ``step_per_stream_s`` per stream it sends at that time, for calibration;
``tokens_per_event`` tokens an event after the first, as a lagging vLLM API server sends
them, and the usage last where the request asks ``stream_options.include_usage``); it can
die in the middle of a streamed answer (``die_mid_stream``) and, as a P/D prefill side,
answers with a kv_transfer_params handle (``handle``: :data:`HANDLE` naming this double
as the remote engine). As a decode side given a handle it "loads" the prompt in
``transfer_per_token_s`` a token instead of computing it, and counts the loaded tokens in
``/metrics`` as vLLM does (unless ``loads`` is False: it recomputes). Beside a store:
``saves`` is called with each prompt it answered, and ``store_hits`` tells how many of a
prompt's tokens the store holds, which it "loads" in ``store_load_s`` plus
``transfer_per_token_s`` a token (counted as above). Its ``/metrics`` also reports
``running`` and ``waiting`` requests and the mean prompt ``mean_prompt`` of finished ones
as vLLM's gauges and histogram (set them to model load that bypasses the router) and,
where ``block_size`` is set, vLLM's ``vllm:cache_config_info``, or ``metrics_page``
instead where set, after ``metrics_delay_s``; ``metrics_reads`` counts the requests for
``/metrics`` it received (a test waits on it for the router's next readings). Real vLLM
engines behind the router are tested in tests/integrations/vllm/test_conductor_router.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from aiohttp import web

HANDLE = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "t1",
          "remote_engine_id": "e1", "remote_host": "127.0.0.1", "remote_port": 7,
          "remote_block_size": 16, "not_for_decode": 1}


class OpenAIDouble:
    def __init__(self, name: str, delay_s: float = 0.0, chunks: int = 3,
                 die_mid_stream: bool = False, prefill: bool = False,
                 per_token_s: float = 0.0, step_s: float = 0.0,
                 transfer_per_token_s: float = 0.0, loads: bool = True,
                 step_per_stream_s: float = 0.0,
                 saves: Callable[[list[int]], None] | None = None,
                 store_hits: Callable[[list[int]], int] | None = None,
                 store_load_s: float = 0.0, tokens_per_event: int = 1) -> None:
        self.name, self.delay_s, self.chunks = name, delay_s, chunks
        self.die_mid_stream, self.prefill = die_mid_stream, prefill
        self.per_token_s, self.step_s = per_token_s, step_s   # a modelled engine's speed
        self.transfer_per_token_s, self.loads = transfer_per_token_s, loads
        self.step_per_stream_s, self.streaming = step_per_stream_s, 0   # a batch's cost
        self.saves, self.store_hits, self.store_load_s = saves, store_hits, store_load_s
        self.tokens_per_event = tokens_per_event   # >1: a lagging API server's events
        self.loaded_tokens = 0
        self.health_delay_s = 0.0
        self.running = self.waiting = 0
        self.mean_prompt: float | None = None
        self.block_size: int | None = None
        self.metrics_page: str | None = None
        self.metrics_delay_s = 0.0
        self.metrics_reads = 0
        self.seen: list[dict[str, Any]] = []
        self.handle = {**HANDLE, "remote_engine_id": name}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        prompt = body.get("prompt")
        tokens = len(prompt) if isinstance(prompt, list) else 0
        handle = body.get("kv_transfer_params") or {}
        if handle.get("do_remote_prefill") and self.loads:
            self.loaded_tokens += tokens
            await asyncio.sleep(self.delay_s + self.transfer_per_token_s * tokens)
        elif self.store_hits is not None and tokens and (hit := self.store_hits(prompt)):
            self.loaded_tokens += hit
            await asyncio.sleep(self.delay_s + self.store_load_s + self.transfer_per_token_s
                                * hit + self.per_token_s * (tokens - hit))
        else:
            await asyncio.sleep(self.delay_s + self.per_token_s * tokens)
        if self.saves is not None and tokens:
            self.saves(prompt)
        if not body.get("stream"):
            answer: dict[str, Any] = {"id": self.name, "choices": [{"text": self.name}]}
            if self.prefill:
                answer["kv_transfer_params"] = self.handle
            return web.json_response(answer)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        self.streaming += 1
        try:
            output = body.get("max_tokens", self.chunks) if self.step_s else self.chunks
            for i in range(output):
                if i:
                    await asyncio.sleep(self.step_s + self.step_per_stream_s * self.streaming)
                if i and i % self.tokens_per_event and i < output - 1:
                    continue   # this token goes in one event with the next
                await out.write(f"data: {json.dumps({'id': self.name, 'n': i})}\n\n".encode())
                if self.die_mid_stream:
                    request.transport.close()   # the engine process died
                    return out
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": tokens, "completion_tokens": output}
                last = {"id": self.name, "choices": [], "usage": usage}
                await out.write(f"data: {json.dumps(last)}\n\n".encode())
        finally:
            self.streaming -= 1
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def health(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.health_delay_s)   # a busy API server answers late
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "double"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        self.metrics_reads += 1
        await asyncio.sleep(self.metrics_delay_s)   # a busy engine answers late
        if self.metrics_page is not None:
            return web.Response(text=self.metrics_page)
        page = [f'vllm:external_prefix_cache_hits_total{{engine="0"}} {self.loaded_tokens:.1f}',
                f'vllm:num_requests_running{{engine="0"}} {self.running:.1f}',
                f'vllm:num_requests_waiting{{engine="0"}} {self.waiting:.1f}']
        if self.block_size is not None:
            page += ["# TYPE vllm:cache_config_info gauge",
                     f'vllm:cache_config_info{{block_size="{self.block_size}",'
                     f'cache_dtype="auto",engine="0"}} 1.0']
        if self.mean_prompt is not None:
            page += ["# TYPE vllm:request_prompt_tokens histogram",
                     f'vllm:request_prompt_tokens_sum{{engine="0"}} {2 * self.mean_prompt}',
                     'vllm:request_prompt_tokens_count{engine="0"} 2.0']
        return web.Response(text="\n".join(page) + "\n")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        return app
