"""Disaggregated prefill with ``MooncakePluginsPDConnector``: a proxy that sends each
request to a prefill engine, then to a decode engine with the prefill's KV handle.

As an HTTP proxy in front of two ``vllm serve`` instances (OpenAI completions and chat
completions, streamed or not)::

    python examples/vllm_pd_proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

It is the Conductor's router with one instance of each role, round robin:
``mooncake-conductor serve --instance URL@prefill --instance URL@decode`` is the same
with more instances, KV-cache-aware policies and early rejection.

Offline, :func:`disaggregated_generate` routes one prompt through two generate
functions, e.g. :func:`llm_generate` around ``vllm.LLM`` objects (vLLM carries a
request's ``kv_transfer_params`` in ``SamplingParams.extra_args``).

Only the connectors' own keys go from the prefill's answer to the decode, so the
decode reports its own cache hits (the prompt it received), not the prefill's.
"""

from __future__ import annotations

import argparse
import logging
import uuid
from typing import Any, Callable

from mooncake_plugins.conductor.router import pd_handoff
from mooncake_plugins.conductor.router.pd_handoff import PD_KEYS

__all__ = ["PD_KEYS", "decode_params", "disaggregated_generate", "llm_generate", "make_app",
           "prefill_params", "prefill_request"]

Generate = Callable[[list[int], dict[str, Any], "dict[str, Any] | None"], dict[str, Any]]
"""``(prompt token ids, sampling kwargs, kv_transfer_params) -> {"tokens", "logprobs",
"num_cached_tokens", "kv_transfer_params"}``."""


def prefill_params(transfer_id: str | None = None) -> dict[str, Any]:
    """kv_transfer_params of the prefill request (a fresh transfer id unless given)."""
    return {"do_remote_decode": True, "transfer_id": transfer_id or uuid.uuid4().hex}


def decode_params(handed: dict[str, Any] | None) -> dict[str, Any] | None:
    """kv_transfer_params of the decode request, from those the prefill returned (None:
    the prefill kept nothing, the decode computes the prompt itself)."""
    return pd_handoff.decode_params({"kv_transfer_params": handed})


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
                "finish_reason": c.finish_reason,
                "kv_transfer_params": out.kv_transfer_params}

    return generate


# -- HTTP proxy ----------------------------------------------------------------------------
def make_app(prefill_url: str, decode_url: str) -> Any:
    """The router over ``prefill_url`` (prefill) and ``decode_url`` (decode): an aiohttp
    application serving ``/v1/completions`` and ``/v1/chat/completions``."""
    from mooncake_plugins.conductor.costmodel import CostModel
    from mooncake_plugins.conductor.policies import Slo, make_policy
    from mooncake_plugins.conductor.router.instances import Pool
    from mooncake_plugins.conductor.router.prompts import Hasher
    from mooncake_plugins.conductor.router.server import Router, RouterConfig

    pool = Pool()
    pool.add(prefill_url, "prefill")
    pool.add(decode_url, "decode")
    cost, slo = CostModel(), Slo()
    return Router(RouterConfig(make_policy("round_robin", cost, slo), slo, cost),
                  Hasher(16), pool).app()


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
