"""The store connector's scheduler side: which blocks to load, which to save.

It answers vLLM's "how many more prompt tokens can be loaded" from the store (one
batched existence call over every rank's key of every full prompt block), remembers the
blocks vLLM allocated for them, and each step tells the workers which blocks to load
before the forward pass and which newly filled blocks to save after it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from mooncake_plugins.errors import MooncakeError
from mooncake_plugins.store import block_keys

from .config import StoreSettings
from .keys import BlockKeys
from .stats import TransferStats
from .store_link import StoreLink

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class BlockJob:
    """Blocks of one request to move: ``block_hashes[i]`` lives in ``block_ids[i]``.
    A save with ``replace`` overwrites objects already in the store (blocks recomputed
    after their stored copies failed to load)."""

    req_id: str
    block_hashes: list[str]
    block_ids: list[int]
    replace: bool = False


@dataclass
class StoreMetadata(KVConnectorMetadata):
    """One step's work for the workers."""

    loads: list[BlockJob] = field(default_factory=list)
    saves: list[BlockJob] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


@dataclass
class _RequestState:
    request: "Request"
    stored: int = 0                       # leading full blocks in the store or being saved
    hit: tuple[int, int] = (0, 0)         # (first block to load, blocks hit) of the lookup
    load: BlockJob | None = None          # to send with the next metadata
    saving: bool = False                  # a save went out: finishing waits for the worker
    replace_until: int = 0                # saves of blocks before this overwrite the store's


class StoreScheduler:
    """Scheduler-side state of the store connector (one per engine)."""

    def __init__(self, vllm_config: "VllmConfig", settings: StoreSettings, keys: BlockKeys) -> None:
        kv = vllm_config.kv_transfer_config
        self._load = kv.is_kv_consumer
        self._save = kv.is_kv_producer
        self._settings = settings
        self._keys = keys
        self._bs = keys.block_size
        self._link = StoreLink(settings, 0, "store connector (scheduler)")
        self._reqs: dict[str, _RequestState] = {}
        self._manager: KVCacheManager | None = None
        self._stats = TransferStats()
        if kv.kv_load_failure_policy != "recompute" and self._load:
            log.warning("kv_load_failure_policy is %r: a block that cannot be loaded from the "
                        "store fails its request; set \"kv_load_failure_policy\":\"recompute\" "
                        "to recompute it instead", kv.kv_load_failure_policy)

    def bind_kv_cache_manager(self, manager: "KVCacheManager") -> None:
        self._manager = manager

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _RequestState(request)
        st.hit = (0, 0)
        if not self._load:
            return 0, False
        hashes = self._keys.block_hashes(request)
        # the last prompt token is always computed here: vLLM samples from it
        usable = min(len(hashes), (request.num_prompt_tokens - 1) // self._bs)
        first = num_computed_tokens // self._bs
        if usable <= first:
            return 0, False
        hit = self._lookup(hashes[:usable])
        st.stored = max(st.stored, hit)
        if hit <= first:
            return 0, False
        st.hit = (first, hit)
        return hit * self._bs - num_computed_tokens, False

    def _lookup(self, hashes: list[str]) -> int:
        """How many leading blocks every rank has in the store."""
        client = self._link.get()
        if client is None:
            return 0
        try:
            present = client.batch_exists(self._keys.all_ranks(hashes))
        except MooncakeError as exc:
            self._stats.add(lookup_errors=1)
            log.warning("store lookup failed (%s): computing the prompt instead", exc)
            return 0
        hit = block_keys.leading_blocks(present, self._keys.tp_size)
        self._stats.add(lookups=1, lookup_hit_tokens=hit * self._bs)
        return hit

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0:
            return
        first, hit = st.hit
        end = min(hit, first + -(-num_external_tokens // self._bs))
        block_ids = blocks.get_block_ids()[0]
        hashes = self._keys.block_hashes(request)
        st.load = BlockJob(request.request_id, hashes[first:end], list(block_ids[first:end]))

    def build_connector_meta(self, out: "SchedulerOutput") -> StoreMetadata:
        meta = StoreMetadata(preempted=sorted(out.preempted_req_ids or ()))
        for st in self._reqs.values():
            if st.load is not None:
                meta.loads.append(st.load)
                st.load = None
        if self._save:
            for new in out.scheduled_new_reqs:
                self._plan_save(meta, new.req_id, new.num_computed_tokens, out)
            cached = out.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                self._plan_save(meta, req_id, cached.num_computed_tokens[i], out)
        return meta

    def _plan_save(self, meta: StoreMetadata, req_id: str, num_computed: int,
                   out: "SchedulerOutput") -> None:
        st = self._reqs.get(req_id)
        if st is None or self._manager is None:
            return
        req = st.request
        done = num_computed + out.num_scheduled_tokens.get(req_id, 0)
        limit = req.num_tokens if self._settings.save_decode_cache else req.num_prompt_tokens
        hashes = self._keys.block_hashes(req)
        full = min(min(done, limit) // self._bs, len(hashes))
        if full <= st.stored:
            return
        block_ids = self._manager.get_block_ids(req_id)[0]
        meta.saves.append(BlockJob(req_id, hashes[st.stored:full], list(block_ids[st.stored:full]),
                                   replace=st.stored < st.replace_until))
        st.stored = full
        st.saving = True

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        """Blocks that failed to load are recomputed by vLLM (its requests' computed tokens
        go back to the first such block): save them again once they are, replacing the
        stored copies, which are listed but unreadable (a dead holder, a broken replica)
        or gone."""
        bad = output.invalid_block_ids
        if not bad or not self._save or self._manager is None:
            return
        for req_id, st in self._reqs.items():
            try:
                block_ids = self._manager.get_block_ids(req_id)[0]
            except (KeyError, IndexError):
                continue
            first = next((i for i, b in enumerate(block_ids[:st.stored]) if b in bad), None)
            if first is not None:
                st.replace_until = max(st.replace_until, st.stored)
                st.stored = first

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks until the workers have saved them (True when saves went out)."""
        st = self._reqs.pop(request.request_id, None)
        return (st is not None and st.saving), None

    def get_kv_connector_stats(self) -> TransferStats | None:
        return self._stats.take()

    def shutdown(self) -> None:
        self._link.close()
