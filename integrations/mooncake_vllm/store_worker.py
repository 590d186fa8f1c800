"""The store connector's worker side: moves KV blocks between vLLM's paged KV cache and
the store, zero-copy.

The KV cache tensors are registered with the store client once; a block over all layers
is a list of ``(address, nbytes)`` pieces (:class:`KVLayout`), which the store gathers on
put and scatters on get, so no staging buffer is involved. Loads run before the forward
pass that needs them; saves are handed to a background thread after the forward pass, so
they overlap the next steps. A request whose blocks are still being saved is reported as
finished sending only when its saves are done, which keeps vLLM from reusing the blocks;
blocks of a preempted request are waited for before the next forward pass may overwrite
them.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

from mooncake_plugins.errors import MooncakeError, ObjectAlreadyExists
from mooncake_plugins.store.client import ReplicateConfig, StoreClient

from .config import StoreSettings
from .keys import BlockKeys
from .kv_layout import KVLayout
from .stats import TransferStats
from .store_link import StoreLink
from .store_scheduler import BlockJob, StoreMetadata

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class StoreWorker:
    """Worker-side state of the store connector (one per worker process)."""

    def __init__(self, settings: StoreSettings, keys: BlockKeys, num_blocks: int,
                 tp_rank: int) -> None:
        self._settings = settings
        self._keys = keys
        self._num_blocks = num_blocks
        self._rank = tp_rank
        self._layout: KVLayout | None = None
        self._link = StoreLink(settings, settings.global_segment_size,
                               f"store connector (worker {tp_rank})", self._on_connect)
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="mc-vllm-save")
        self._saves: dict[str, list[Future]] = {}     # req id -> its save batches
        self._finishing: set[str] = set()             # finished requests with saves out
        self._load_errors: set[int] = set()
        self._stats = TransferStats()
        self._stats_lock = threading.Lock()   # the saver thread counts too

    # -- setup ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self._layout = KVLayout(kv_caches, self._num_blocks)
        log.info("store connector (worker %d): KV cache %s", self._rank, self._layout.describe())
        client = self._link.get()   # connects now (and registers) when the store is up
        if client is None:
            log.warning("store connector (worker %d): store not reachable yet; blocks are "
                        "computed until it is", self._rank)

    def _on_connect(self, client: StoreClient) -> None:
        if self._layout is None:
            raise RuntimeError("the KV cache must be registered before the store is used")
        for address, nbytes in self._layout.regions:
            client.register_buffer(address, nbytes)

    def _client(self) -> StoreClient | None:
        return self._link.get() if self._layout is not None else None

    # -- loads --------------------------------------------------------------------------
    def handle_preemptions(self, meta: StoreMetadata) -> None:
        """Blocks of preempted requests may be reused by this step: finish their saves."""
        pending = [f for r in meta.preempted for f in self._saves.get(r, ())]
        if pending:
            wait(pending)

    def start_load_kv(self, meta: StoreMetadata) -> None:
        if not meta.loads:
            return
        client = self._client()
        layout = self._layout
        keys: list[str] = []
        parts: list[list[tuple[int, int]]] = []
        ids: list[int] = []
        for job in meta.loads:
            keys += self._keys.keys(job.block_hashes, self._rank)
            ids += job.block_ids
        if client is None or layout is None:
            self._fail_loads(ids, "the store is not reachable")
            return
        parts = [layout.block_pieces(b) for b in ids]
        t0 = time.perf_counter()
        try:
            results = client.batch_get_into_parts(keys, parts)
        except MooncakeError as exc:
            self._fail_loads(ids, str(exc))
            return
        failed = [b for b, r in zip(ids, results)
                  if isinstance(r, Exception) or r != layout.block_nbytes]
        loaded = len(ids) - len(failed)
        self._count(blocks_loaded=loaded, bytes_loaded=loaded * layout.block_nbytes,
                    load_seconds=time.perf_counter() - t0)
        if failed:
            first = next(r for r in results if isinstance(r, Exception) or r != layout.block_nbytes)
            self._fail_loads(failed, str(first))

    def _fail_loads(self, block_ids: list[int], why: str) -> None:
        log.warning("store connector (worker %d): %d block(s) not loaded (%s); vLLM "
                    "recomputes them", self._rank, len(block_ids), why)
        self._count(load_errors=len(block_ids))
        self._load_errors.update(block_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    # -- saves --------------------------------------------------------------------------
    def wait_for_save(self, meta: StoreMetadata) -> None:
        """Hand this step's saves to the background saver (the KV is complete now)."""
        if not meta.saves:
            return
        future = self._saver.submit(self._save, list(meta.saves))
        for job in meta.saves:
            self._saves.setdefault(job.req_id, []).append(future)

    def _save(self, jobs: list[BlockJob]) -> None:
        client = self._client()
        layout = self._layout
        n = sum(len(j.block_ids) for j in jobs)
        if client is None or layout is None:
            self._count(save_errors=n)
            return
        keys = [k for j in jobs for k in self._keys.keys(j.block_hashes, self._rank)]
        parts = [layout.block_pieces(b) for j in jobs for b in j.block_ids]
        config = ReplicateConfig(replica_num=self._settings.replica_num)
        t0 = time.perf_counter()
        try:
            errors = client.batch_put_from_parts(keys, parts, config)
        except MooncakeError as exc:
            log.warning("store connector (worker %d): saving %d block(s) failed: %s",
                        self._rank, n, exc)
            self._count(save_errors=n)
            return
        bad = [e for e in errors if e is not None and not isinstance(e, ObjectAlreadyExists)]
        new = sum(e is None for e in errors)
        self._count(blocks_saved=new, bytes_saved=new * layout.block_nbytes,
                    save_seconds=time.perf_counter() - t0, save_errors=len(bad))
        if bad:
            log.warning("store connector (worker %d): %d of %d block(s) not saved: %s",
                        self._rank, len(bad), n, bad[0])

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        """Finished requests whose saves are all done (their blocks may be freed now)."""
        self._finishing |= {r for r in finished_req_ids if r in self._saves}
        done = {r for r in self._finishing if all(f.done() for f in self._saves[r])}
        for r in done:
            self._finishing.discard(r)
            del self._saves[r]
        # requests still running keep their futures; drop the ones already completed
        for r, futures in self._saves.items():
            if r not in self._finishing:
                futures[:] = [f for f in futures if not f.done()]
        return (done or None), None

    def _count(self, **counts: float) -> None:
        with self._stats_lock:
            self._stats.add(**counts)

    def get_kv_connector_stats(self) -> TransferStats | None:
        with self._stats_lock:
            return self._stats.take()

    def shutdown(self) -> None:
        self._saver.shutdown(wait=True)
        self._link.close()
