"""The store connector's worker side: moves KV blocks between vLLM's paged KV cache and
the store, zero-copy.

The KV cache tensors are registered with the store client once; a block over all layers
is a list of ``(address, nbytes)`` pieces (:class:`KVLayout`), which the store gathers on
put and scatters on get, so no staging buffer is involved.

Loads: before the forward pass, one master round trip finds every block's object, then a
background thread reads them straight into the KV tensors. Layer-wise (when vLLM left a
core free of its compute threads for KV transfers), it reads the objects' layers in order,
each layer of every block a ranged read into that layer's KV tensor, and each attention
layer waits only for its own reads, so layer ``l + 1`` arrives while layer ``l`` computes.
Otherwise all layers are read in one batch, which the first attention layer waits for:
reads on a core that a compute thread is bound to stall every parallel region of the
forward pass (measured on two cores: the first layer's compute took 26 ms instead of 3.4
while the other layers were read). A block any of whose layers could not be read is
reported to vLLM as failed at the end of the step, and vLLM recomputes it (its other
layers are overwritten then).

Saves are handed to a background thread after the forward pass, so they overlap the next
steps. A request whose blocks are still being saved is reported as finished sending only
when its saves are done, which keeps vLLM from reusing the blocks; blocks of a preempted
request are waited for before the next forward pass may overwrite them.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

from mooncake_plugins.errors import MooncakeError, ObjectAlreadyExists
from mooncake_plugins.store.client import Located, ReplicateConfig, StoreClient

from .config import StoreSettings
from .cuda_fence import Fence, fence
from .keys import BlockKeys
from .kv_layout import KVLayout
from .stats import TransferStats
from .store_link import StoreLink
from .store_scheduler import BlockJob, StoreMetadata

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_Read = tuple[list, float]   # per block its bytes read or error; when the read ended


def _cpu_list(text: str) -> set[int] | None:
    """CPU ids of an OpenMP list such as ``0 1 2``, ``0-3,8`` or ``{0,1},{2}``; None
    when the text has another form (places with lengths or strides)."""
    out: set[int] = set()
    for item in re.split(r"[\s,{}]+", text.strip()):
        if not item:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if m is None:
            return None
        first = int(m.group(1))
        out.update(range(first, int(m.group(2) or first) + 1))
    return out or None


def omp_cores(env: Mapping[str, str] = os.environ) -> set[int] | None:
    """The cores vLLM bound this worker's OpenMP compute threads to (it sets one of these
    variables per worker, by the OpenMP runtime in use); None when none is set."""
    kmp = re.search(r"proclist=\[([^\]]*)\]", env.get("KMP_AFFINITY", ""))
    for text in (kmp.group(1) if kmp else "", env.get("GOMP_CPU_AFFINITY", ""),
                 env.get("OMP_PLACES", "")):
        cores = _cpu_list(text) if text else None
        if cores:
            return cores
    return None


def kv_cores() -> tuple[list[int], bool]:
    """Cores for the KV transfer threads, and whether no compute thread is bound to them.

    vLLM's CPU backend keeps the last core of each NUMA node for KV transfers, but only
    on machines with cores to spare: on a small one its compute threads use every core.
    A core is free when neither this worker's compute threads nor, with an explicit
    ``VLLM_CPU_OMP_THREADS_BIND`` (``0-3|4-7``: one list per rank), another rank's are
    bound to it. Without a free core all cores are returned (a read may use any while the
    forward pass is not running), with False. Empty for other platforms (the threads stay
    where they are)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return [], True
    nodes = [sorted(n) for n in current_platform.discover_numa_topology() if n]
    if not nodes:
        return [], True
    every = sorted(c for n in nodes for c in n)
    compute = omp_cores() or set()
    if not compute:   # unbound: as many compute threads as cores means all are used
        import torch

        if torch.get_num_threads() >= len(every):
            compute = set(every)
    for ranks in os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "").split("|"):
        compute |= _cpu_list(ranks) or set()
    free = [n[-1] for n in nodes if n[-1] not in compute]
    return (free, True) if free else (every, False)


def _bind_to(cores: list[int]) -> Callable[[], None]:
    """Thread initializer: run this thread on ``cores`` (none: where it was started). Without
    this, a transfer thread inherits the core vLLM pinned its starter to, a compute core."""
    def bind() -> None:
        if not cores:
            return
        try:
            os.sched_setaffinity(0, cores)
        except OSError as exc:
            log.info("store connector: KV transfer threads stay on the cores they were "
                     "given (%s)", exc)
    return bind


@dataclass
class _StepLoads:
    """One step's loads in flight over the blocks that were found: a read per layer, or
    one read of every layer that all layer names share."""

    started: float
    blocks: list[int]                                # block ids whose objects were found
    layers: dict[str, "Future[_Read]"]               # layer name -> its read, until waited for
    failed: dict[int, str] = field(default_factory=dict)   # block id -> why (any layer)
    ended: float = 0.0


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
        self._saver: ThreadPoolExecutor | None = None   # made when the KV cache is known
        self._loader: ThreadPoolExecutor | None = None
        self._layerwise = False   # decided when the KV cache is registered
        self._loads: _StepLoads | None = None         # this step's layer reads
        self._saves: dict[str, list[Future]] = {}     # req id -> its save batches
        self._finishing: set[str] = set()             # finished requests with saves out
        self._load_errors: set[int] = set()
        self._stats = TransferStats()
        self._stats_lock = threading.Lock()   # the saver thread counts too

    # -- setup ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self._layout = KVLayout(kv_caches, self._num_blocks)
        cores, free = kv_cores()
        mode = self._settings.load_mode
        self._layerwise = mode == "layerwise" or (mode == "auto" and free)
        log.info("store connector (worker %d): KV cache %s; loads %s; transfer threads on "
                 "cores %s%s", self._rank, self._layout.describe(),
                 "layer by layer" if self._layerwise else "whole before the first layer",
                 cores or "as started", "" if free else " (shared with compute threads)")
        bind = _bind_to(cores)
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="mc-vllm-save", initializer=bind)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="mc-vllm-load", initializer=bind)
        for pool in (self._saver, self._loader):   # start them now, not on the first request
            pool.submit(lambda: None).result()
        client = self._link.get()   # connects now (and registers) when the store is up
        if client is None:
            log.warning("store connector (worker %d): store not reachable yet; blocks are "
                        "computed until it is", self._rank)

    def _on_connect(self, client: StoreClient) -> None:
        if self._layout is None:
            raise RuntimeError("the KV cache must be registered before the store is used")
        for address, nbytes, location in self._layout.regions:
            client.register_buffer(address, nbytes, location)

    def _client(self) -> StoreClient | None:
        return self._link.get() if self._layout is not None else None

    # -- loads --------------------------------------------------------------------------
    def handle_preemptions(self, meta: StoreMetadata) -> None:
        """Blocks of preempted requests may be reused by this step: finish their saves."""
        pending = [f for r in meta.preempted for f in self._saves.get(r, ())]
        if pending:
            wait(pending)

    def start_load_kv(self, meta: StoreMetadata) -> None:
        """Find the step's blocks in the store, then start reading them layer by layer."""
        self._finish_loads()
        if not meta.loads:
            return
        client = self._client()
        layout = self._layout
        keys: list[str] = []
        ids: list[int] = []
        for job in meta.loads:
            keys += self._keys.keys(job.block_hashes, self._rank)
            ids += job.block_ids
        if client is None or layout is None:
            self._fail_loads(ids, "the store is not reachable")
            return
        t0 = time.perf_counter()
        try:
            located = client.locate(keys)
        except MooncakeError as exc:
            self._fail_loads(ids, str(exc))
            return
        failed: dict[int, str] = {}
        found: list[tuple[int, int]] = []      # (object index, block id)
        for j, (block, obj) in enumerate(zip(ids, located.found)):
            if isinstance(obj, Exception):
                failed.setdefault(block, str(obj))
            elif obj[0] != layout.block_nbytes:
                failed.setdefault(block, f"{keys[j]!r} holds {obj[0]} bytes, a block "
                                         f"{layout.block_nbytes}")
            else:
                found.append((j, block))
        # on a GPU: the blocks may still be read by kernels queued before this step
        after = fence(layout.cuda_devices) if found else None
        if self._layerwise:
            layers = {}
            for layer, name in enumerate(layout.layer_names):
                reads = [(j, layer * layout.layer_nbytes, layout.layer_pieces(block, layer))
                         for j, block in found]
                layers[name] = self._loader.submit(self._read, client, located, reads, after)
        else:
            whole = self._loader.submit(self._read, client, located,
                                        [(j, 0, layout.block_pieces(block)) for j, block in found],
                                        after)
            layers = dict.fromkeys(layout.layer_names, whole)
        self._loads = _StepLoads(t0, [b for _, b in found], layers, failed)

    @staticmethod
    def _read(client: StoreClient, located: Located,
              reads: list[tuple[int, int, list[tuple[int, int]]]], after: Fence | None) -> _Read:
        try:
            if after is not None:
                after.wait()
            results: list = client.batch_get_ranges_into(located, reads)
        except MooncakeError as exc:
            results = [exc] * len(reads)
        return results, time.perf_counter()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this step's reads of ``layer_name`` are done (failures are reported
        at the end of the step)."""
        loads = self._loads
        if loads is not None and layer_name in loads.layers:
            self._collect(loads, layer_name)

    @staticmethod
    def _collect(loads: _StepLoads, layer_name: str) -> None:
        results, ended = loads.layers.pop(layer_name).result()   # a whole read: done once
        loads.ended = max(loads.ended, ended)
        for block, r in zip(loads.blocks, results):
            if isinstance(r, Exception):
                loads.failed.setdefault(block, f"layer {layer_name}: {r}")

    def _finish_loads(self) -> None:
        """Wait for the step's reads not waited for yet; count them, report failures."""
        loads, self._loads = self._loads, None
        if loads is None:
            return
        for name in list(loads.layers):
            self._collect(loads, name)
        layout = self._layout
        loaded = sum(b not in loads.failed for b in loads.blocks)
        if loads.blocks:
            self._count(blocks_loaded=loaded, bytes_loaded=loaded * layout.block_nbytes,
                        load_seconds=max(0.0, loads.ended - loads.started))
        if loads.failed:
            self._fail_loads(list(loads.failed), next(iter(loads.failed.values())))

    def _fail_loads(self, block_ids: list[int], why: str) -> None:
        log.warning("store connector (worker %d): %d block(s) not loaded (%s); vLLM "
                    "recomputes them", self._rank, len(block_ids), why)
        self._count(load_errors=len(block_ids))
        self._load_errors.update(block_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of this step that were not loaded whole (vLLM recomputes them)."""
        self._finish_loads()
        out, self._load_errors = self._load_errors, set()
        return out

    # -- saves --------------------------------------------------------------------------
    def wait_for_save(self, meta: StoreMetadata) -> None:
        """Hand this step's saves to the background saver (the KV is complete now)."""
        if not meta.saves:
            return
        # on a GPU: the forward pass that wrote this KV may still be running
        after = fence(self._layout.cuda_devices) if self._layout is not None else None
        future = self._saver.submit(self._save, list(meta.saves), after)
        for job in meta.saves:
            self._saves.setdefault(job.req_id, []).append(future)

    def _save(self, jobs: list[BlockJob], after: Fence | None) -> None:
        client = self._client()
        layout = self._layout
        n = sum(len(j.block_ids) for j in jobs)
        if client is None or layout is None:
            self._count(save_errors=n)
            return
        config = ReplicateConfig(replica_num=self._settings.replica_num)
        t0 = time.perf_counter()
        errors: list = []
        try:
            if after is not None:
                after.wait()
            for replace in (False, True):   # replacing saves overwrite what is stored
                part = [j for j in jobs if j.replace == replace]
                if part:
                    keys = [k for j in part for k in self._keys.keys(j.block_hashes, self._rank)]
                    pieces = [layout.block_pieces(b) for j in part for b in j.block_ids]
                    errors += client.batch_put_from_parts(keys, pieces, config, upsert=replace)
        except MooncakeError as exc:
            log.warning("store connector (worker %d): saving %d block(s) failed: %s",
                        self._rank, n, exc)
            done = sum(e is None for e in errors)   # a first call may have gone through
            self._count(blocks_saved=done, bytes_saved=done * layout.block_nbytes,
                        save_errors=n - done)
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
        for pool in (self._loader, self._saver):
            if pool is not None:
                pool.shutdown(wait=True)
        self._link.close()
