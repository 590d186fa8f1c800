"""vLLM's P/D handoff, as its proxies drive it: the prefill instance gets the request
for one token with ``kv_transfer_params: {"do_remote_decode": true, ...}``, answers with
a handle, and the decode instance gets the request with that handle and pulls the KV.
Our P/D connector and vLLM's in-tree Mooncake and NIXL connectors all speak it."""

from __future__ import annotations

import uuid
from typing import Any

PD_KEYS = ("do_remote_prefill", "do_remote_decode", "transfer_id", "remote_engine_id",
           "remote_host", "remote_port", "remote_ports", "remote_tp_size",
           "remote_block_size", "prompt_digest", "remote_block_ids", "remote_request_id")
"""kv_transfer_params keys a prefill's answer hands to the decode."""


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg of ``body``: not streamed, one token, asking to keep the KV for a
    remote decode under a fresh transfer id."""
    first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    first["max_tokens"] = 1
    if "max_completion_tokens" in first:
        first["max_completion_tokens"] = 1
    first["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": uuid.uuid4().hex}
    return first


def decode_params(answer: Any) -> dict[str, Any] | None:
    """The decode leg's ``kv_transfer_params`` from the prefill's answer; None when the
    prefill kept nothing (the decode then computes the prompt itself)."""
    handed = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(handed, dict) or not handed.get("do_remote_prefill"):
        return None
    return {k: handed[k] for k in PD_KEYS if k in handed}
