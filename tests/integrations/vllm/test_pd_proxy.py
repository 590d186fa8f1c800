"""The example P/D proxy's HTTP routing (the Conductor's router, round robin over one
prefill and one decode instance), against two stand-in OpenAI servers."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

web = pytest.importorskip("aiohttp.web")
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from vllm_pd_proxy import PD_KEYS, make_app  # noqa: E402

ANSWER = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "x",
          "remote_engine_id": "e", "remote_host": "127.0.0.1", "remote_port": 5,
          "remote_ports": [5], "remote_tp_size": 1, "remote_block_size": 128,
          "prompt_digest": "d", "remote_prefill_cached_tokens": 0}


def stand_in(seen: list[dict[str, Any]], answer: dict[str, Any] | None) -> Any:
    async def completions(request: Any) -> Any:
        body = await request.json()
        seen.append(body)
        return web.json_response({"choices": [{"text": "ok"}], "kv_transfer_params": answer})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


@pytest.mark.parametrize("answer", [ANSWER, None])
def test_proxy_sends_prefill_then_decode_with_the_handle(answer):
    prefill_seen: list[dict] = []
    decode_seen: list[dict] = []

    async def run() -> dict:
        async with TestServer(stand_in(prefill_seen, answer)) as p, \
                TestServer(stand_in(decode_seen, None)) as d:
            proxy = make_app(str(p.make_url("")).rstrip("/"), str(d.make_url("")).rstrip("/"))
            async with TestClient(TestServer(proxy)) as client:
                resp = await client.post("/v1/completions", json={
                    "model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "stream": False})
                assert resp.status == 200
                return await resp.json()

    out = asyncio.run(run())
    assert out["choices"][0]["text"] == "ok"
    (first,) = prefill_seen
    assert first["max_tokens"] == 1 and first["kv_transfer_params"]["do_remote_decode"]
    assert len(first["kv_transfer_params"]["transfer_id"]) == 32
    (second,) = decode_seen
    assert second["max_tokens"] == 8 and second["prompt"] == [1, 2, 3]
    if answer is None:
        assert second["kv_transfer_params"] is None, "no handle: the decode computes"
    else:
        assert second["kv_transfer_params"] == {k: ANSWER[k] for k in PD_KEYS if k in ANSWER}
        assert "remote_prefill_cached_tokens" not in second["kv_transfer_params"]
