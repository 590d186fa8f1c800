"""The P/D connector's scheduler side.

Prefill (``kv_producer``): a request sent with ``{"do_remote_decode": true,
"transfer_id": ...}`` keeps its blocks when it finishes; ``request_finished`` returns
the parameters the decode side needs (where this engine's workers listen, which
transfer, a digest of the prompt) and tells the workers which blocks belong to the
transfer. The workers free them once written, released or timed out.

Decode (``kv_consumer``): a request carrying those parameters reports its whole
prompt as loadable asynchronously; vLLM allocates the blocks and parks it in
``WAITING_FOR_REMOTE_KVS`` while the workers ask the prefill workers to write them.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)
from vllm.v1.request import RequestStatus

from .pd_channel import MAX_NAME

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_SENDABLE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


@dataclass
class PDHandshake(KVConnectorHandshakeMetadata):
    """Where one prefill worker's side channel listens (worker -> scheduler, at start)."""

    host: str
    port: int


@dataclass
class RecvJob:
    """Decode side: ask the prefill's workers for the blocks of one request.

    ``block_ids`` empty: only tell the prefill its blocks are not needed."""

    req_id: str
    transfer_id: str
    engine_id: str
    host: str
    ports: list[int]
    first_block: int
    block_ids: list[int]


@dataclass
class SendJob:
    """Prefill side: the blocks a finished request holds for its transfer."""

    req_id: str
    transfer_id: str
    block_ids: list[int]


@dataclass
class PDMetadata(KVConnectorMetadata):
    """One step's work for the workers."""

    recvs: list[RecvJob] = field(default_factory=list)
    sends: list[SendJob] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    """Prefill side: transfer ids whose request ended without KV to send."""


def prompt_digest(token_ids: list[int]) -> str:
    """A digest of the prompt: the decode side checks it has the prompt the KV is of."""
    h = hashlib.blake2b(digest_size=16)
    for t in token_ids:
        h.update(t.to_bytes(8, "little", signed=True))
    return h.hexdigest()


def _remote(params: dict[str, Any]) -> tuple[str, str, str, list[int], int, int] | str:
    """The prefill's parameters, checked: ``(transfer_id, engine_id, host, ports,
    tp_size, block_size)``, or what is wrong with them."""
    names = ("transfer_id", "remote_engine_id", "remote_host")
    for name in names:
        value = params.get(name)
        if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
            return f"{name} must be a non-empty string"
    ports = params.get("remote_ports")
    if not isinstance(ports, list) or not ports or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports):
        return "remote_ports must be a list of ports"
    for name in ("remote_tp_size", "remote_block_size"):
        if not isinstance(params.get(name), int):
            return f"{name} must be an integer"
    if params["remote_tp_size"] != len(ports):
        return "remote_tp_size does not match remote_ports"
    if not isinstance(params.get("prompt_digest"), str):
        return "prompt_digest is missing"
    return (params["transfer_id"], params["remote_engine_id"], params["remote_host"], ports,
            params["remote_tp_size"], params["remote_block_size"])


class PDScheduler:
    """Scheduler-side state of the P/D connector (one per engine)."""

    def __init__(self, vllm_config: "VllmConfig", block_size: int) -> None:
        kv = vllm_config.kv_transfer_config
        self._engine_id: str = kv.engine_id
        self._producer = kv.is_kv_producer
        self._consumer = kv.is_kv_consumer
        self._bs = block_size
        self._tp = vllm_config.parallel_config.tensor_parallel_size
        self._listeners: dict[int, PDHandshake] = {}
        self._matched: dict[str, int] = {}          # req id -> local tokens at the match
        self._meta = PDMetadata()
        self._sending: dict[str, str] = {}          # transfer id -> req id (held blocks)
        if self._consumer and kv.kv_load_failure_policy != "recompute":
            log.warning("kv_load_failure_policy is %r: a request whose KV cannot be "
                        "received fails; set \"kv_load_failure_policy\":\"recompute\" to "
                        "compute its prompt here instead", kv.kv_load_failure_policy)

    def set_xfer_handshake_metadata(
            self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Where each TP rank's side channel listens (vLLM collects it from the workers)."""
        for rank, meta in metadata.items():
            if isinstance(meta, PDHandshake):
                self._listeners[rank] = meta

    # -- decode side ------------------------------------------------------------------
    def _remote_params(self, request: "Request") -> tuple | None:
        params = request.kv_transfer_params
        if not self._consumer or not params or not params.get("do_remote_prefill"):
            return None
        remote = _remote(params)
        why = remote if isinstance(remote, str) else ""
        if not why and remote[4] != self._tp:
            why = (f"the prefill runs TP={remote[4]} and this engine TP={self._tp}: the P/D "
                   "connector needs equal TP sizes (rank r receives from rank r)")
        elif not why and remote[5] != self._bs:
            why = (f"the prefill's block size is {remote[5]}, this engine's {self._bs}: "
                   "they must be equal")
        elif not why and params["prompt_digest"] != prompt_digest(request.prompt_token_ids or []):
            why = "the prompt differs from the one the prefill computed"
        if why:
            log.error("request %s: kv_transfer_params from the prefill unusable (%s); "
                      "computing its prompt here", request.request_id, why)
            params["do_remote_prefill"] = False
            if not isinstance(remote, str):
                self._release(request.request_id, remote)
            return None
        return remote

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        remote = self._remote_params(request)
        if remote is None:
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        if count <= 0:
            return 0, False
        self._matched[request.request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not self._consumer or not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False       # one transfer per request
        remote = _remote(params)
        local = self._matched.pop(request.request_id, None)
        if isinstance(remote, str):
            return
        if num_external_tokens <= 0 or local is None:
            self._release(request.request_id, remote)   # all of it was cached here
            return
        first = local // self._bs
        last = -(-request.num_prompt_tokens // self._bs)
        block_ids = blocks.get_block_ids()[0][first:last]
        transfer_id, engine_id, host, ports, _, _ = remote
        self._meta.recvs.append(RecvJob(request.request_id, transfer_id, engine_id, host,
                                        ports, first, list(block_ids)))

    def _release(self, req_id: str, remote: tuple) -> None:
        transfer_id, engine_id, host, ports, _, _ = remote
        self._meta.recvs.append(RecvJob(req_id, transfer_id, engine_id, host, ports, 0, []))

    # -- prefill side -----------------------------------------------------------------
    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        self._matched.pop(request.request_id, None)
        if not params:
            return False, None
        if self._consumer and params.get("do_remote_prefill"):
            # finished (aborted) before it was scheduled: the prefill holds blocks for it
            params["do_remote_prefill"] = False
            remote = _remote(params)
            if not isinstance(remote, str):
                self._release(request.request_id, remote)
            return False, None
        if not (self._producer and params.get("do_remote_decode")):
            return False, None
        transfer_id = params.get("transfer_id") or request.request_id
        if not isinstance(transfer_id, str) or len(transfer_id) > MAX_NAME:
            log.error("request %s: transfer_id must be a string of at most %d characters; "
                      "its KV is not kept for a decode", request.request_id, MAX_NAME)
            return False, None
        done = request.num_computed_tokens >= request.num_prompt_tokens
        if request.status not in _SENDABLE or not done or not block_ids:
            self._meta.aborted.append(transfer_id)
            return False, None
        if transfer_id in self._sending:
            log.error("request %s: transfer_id %r is already in use by request %s; its KV "
                      "is not kept for a decode", request.request_id, transfer_id,
                      self._sending[transfer_id])
            return False, None
        if len(self._listeners) != self._tp:
            log.error("request %s: the workers' side channels are unknown (got %d of %d); "
                      "its KV is not kept for a decode", request.request_id,
                      len(self._listeners), self._tp)
            self._meta.aborted.append(transfer_id)
            return False, None
        nblocks = -(-request.num_prompt_tokens // self._bs)
        self._sending[transfer_id] = request.request_id
        self._meta.sends.append(SendJob(request.request_id, transfer_id,
                                        list(block_ids[:nblocks])))
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "transfer_id": transfer_id, "remote_engine_id": self._engine_id,
            "remote_host": self._listeners[0].host,
            "remote_port": self._listeners[0].port,
            "remote_ports": [self._listeners[r].port for r in range(self._tp)],
            "remote_tp_size": self._tp, "remote_block_size": self._bs,
            "prompt_digest": prompt_digest(request.prompt_token_ids or []),
        }

    def update_finished_sending(self, req_ids: set[str]) -> None:
        """Forget transfers whose blocks the workers let go."""
        if req_ids:
            self._sending = {t: r for t, r in self._sending.items() if r not in req_ids}

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> PDMetadata:
        meta, self._meta = self._meta, PDMetadata()
        return meta
