"""Disaggregated prefill with ``MooncakePluginsPDConnector``: a proxy that sends each
request to a prefill engine, then to a decode engine with the prefill's KV handle.

As an HTTP proxy in front of two ``vllm serve`` instances (OpenAI completions and chat
completions)::

    python examples/vllm_pd_proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

Offline, :func:`disaggregated_generate` routes one prompt through two generate
functions, e.g. :func:`llm_generate` around ``vllm.LLM`` objects (vLLM carries a
request's ``kv_transfer_params`` in ``SamplingParams.extra_args``).

Only the connector's own keys go from the prefill's answer to the decode, so the
decode reports its own cache hits (the prompt it received), not the prefill's.
"""

from __future__ import annotations

import argparse
import logging
import uuid
from typing import Any, Callable

log = logging.getLogger("vllm_pd_proxy")

PD_KEYS = ("do_remote_prefill", "do_remote_decode", "transfer_id", "remote_engine_id",
           "remote_host", "remote_port", "remote_ports", "remote_tp_size",
           "remote_block_size", "prompt_digest")
"""The kv_transfer_params keys the P/D connector hands from prefill to decode."""

Generate = Callable[[list[int], dict[str, Any], "dict[str, Any] | None"], dict[str, Any]]
"""``(prompt token ids, sampling kwargs, kv_transfer_params) -> {"tokens", "logprobs",
"num_cached_tokens", "kv_transfer_params"}``."""


def prefill_params(transfer_id: str | None = None) -> dict[str, Any]:
    """kv_transfer_params of the prefill request (a fresh transfer id unless given)."""
    return {"do_remote_decode": True, "transfer_id": transfer_id or uuid.uuid4().hex}


def decode_params(prefill_answer: dict[str, Any] | None) -> dict[str, Any] | None:
    """kv_transfer_params of the decode request, from the prefill's answer (None: the
    prefill kept nothing, the decode computes the prompt itself)."""
    if not prefill_answer or not prefill_answer.get("do_remote_prefill"):
        return None
    return {k: prefill_answer[k] for k in PD_KEYS if k in prefill_answer}


def prefill_request(prefill: Generate, prompt: list[int], sampling: dict[str, Any],
                    transfer_id: str | None = None) -> dict[str, Any] | None:
    """Run the prompt's prefill (one token); the decode's kv_transfer_params."""
    answer = prefill(prompt, {**sampling, "max_tokens": 1}, prefill_params(transfer_id))
    return decode_params(answer.get("kv_transfer_params"))


def disaggregated_generate(prefill: Generate, decode: Generate, prompt: list[int],
                           sampling: dict[str, Any],
                           transfer_id: str | None = None) -> dict[str, Any]:
    """Prefill on one engine, generate on the other from the transferred KV."""
    return decode(prompt, sampling, prefill_request(prefill, prompt, sampling, transfer_id))


def llm_generate(llm: Any) -> Generate:
    """A :data:`Generate` over an offline ``vllm.LLM`` (one prompt of token ids)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def generate(prompt: list[int], sampling: dict[str, Any],
                 kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        params = SamplingParams(**sampling, extra_args=extra)
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        c = out.outputs[0]
        logprobs = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] \
            if c.logprobs else []
        return {"tokens": list(c.token_ids), "logprobs": logprobs,
                "num_cached_tokens": out.num_cached_tokens,
                "kv_transfer_params": out.kv_transfer_params}

    return generate


# -- HTTP proxy ----------------------------------------------------------------------------
def make_app(prefill_url: str, decode_url: str) -> Any:
    """An aiohttp application routing ``/v1/completions`` and ``/v1/chat/completions``."""
    import aiohttp
    from aiohttp import web

    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def on_startup(app: web.Application) -> None:
        app[session_key] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def on_cleanup(app: web.Application) -> None:
        await app[session_key].close()

    async def route(request: web.Request) -> web.StreamResponse:
        session = request.app[session_key]
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "the body must be JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the body must be a JSON object"}, status=400)
        first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        first.update(max_tokens=1, kv_transfer_params=prefill_params())
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        async with session.post(prefill_url + request.path, json=first) as resp:
            if resp.status != 200:
                return web.Response(status=resp.status, body=await resp.read(),
                                    content_type=resp.content_type)
            answer = await resp.json()
        params = decode_params(answer.get("kv_transfer_params"))
        if params is None:
            log.warning("the prefill kept no KV for this request; the decode computes it")
        second = dict(body, kv_transfer_params=params)
        async with session.post(decode_url + request.path, json=second) as resp:
            out = web.StreamResponse(status=resp.status,
                                     headers={"Content-Type": resp.content_type})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application()
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/completions", route)
    app.router.add_post("/v1/chat/completions", route)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="base URL of the kv_producer engine")
    ap.add_argument("--decode", required=True, help="base URL of the kv_consumer engine")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    from aiohttp import web

    logging.basicConfig(level=logging.INFO)
    web.run_app(make_app(args.prefill.rstrip("/"), args.decode.rstrip("/")),
                host=args.host, port=args.port)


if __name__ == "__main__":
    main()
