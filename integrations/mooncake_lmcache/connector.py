"""``MooncakePluginsConnector``: an LMCache ``RemoteConnector`` over our store.

LMCache runs connector coroutines on its own event loop; every store call here is
blocking, so it runs on this connector's worker threads and the coroutine waits at most
``transfer_timeout_s`` for it. A call that outlives its wait keeps its own reference to
the memory objects it reads or writes, so LMCache cannot reuse their memory underneath
it; the caller gets a miss (get) or a failed put. Store faults are misses, never
wrong chunks: a chunk is returned only when the store read all of its bytes.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Sequence

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector import SafeLocalCPUBackend
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

from mooncake_plugins.errors import MooncakeError
from mooncake_plugins.store.client import StoreClient

from .chunks import ChunkIO
from .config import ConnectorSettings, from_extra_config

log = logging.getLogger(__name__)


def _pool_buffers(local_cpu_backend: LocalCPUBackend) -> list[tuple[int, int, str]]:
    """``(address, nbytes, location)`` of the memory LMCache allocates its memory objects
    from (the pinned pool, or a pool in GPU memory; views of one buffer count once)."""
    allocator = getattr(local_cpu_backend, "memory_allocator", None)
    found: list[tuple[int, int, str]] = []
    for owner in (getattr(allocator, "pin_allocator", None), allocator):
        buf = getattr(owner, "buffer", None)
        device = getattr(buf, "device", None)
        if device is None or device.type not in ("cpu", "cuda"):
            continue
        location = "*" if device.type == "cpu" else f"cuda:{device.index or 0}"
        address, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
        if all(address + nbytes <= a or a + n <= address for a, n, _ in found):
            found.append((address, nbytes, location))
    return found


class MooncakePluginsConnector(RemoteConnector):
    """LMCache remote connector storing each chunk as one store object.

    Built by LMCache's ``DynamicConnectorAdapter`` (``remote_storage_plugins``) or
    ``ExternalConnectorAdapter`` (``remote_url: external://...``) as ``cls(loop=,
    local_cpu_backend=, config=)``. Chunks are stored as raw bytes (no LMCache metadata
    header), so the connector needs LMCache's ``naive`` serde and whole-chunk (not
    layerwise) storage.

    In LMCache's scheduler role (``enable_scheduler_bypass_lookup``) there is no CPU pool:
    LMCache passes its stand-in ``SafeLocalCPUBackend``, which carries neither config nor
    metadata, and only asks whether chunks exist. The connector is then lookup-only
    (:attr:`lookup_only`): a store client with no segment and no registered memory that
    answers ``exists``/``contains``; gets and puts raise.

    Raises:
        ValueError: a bad ``mooncake_plugins.*`` setting, or an LMCache config this
            connector cannot serve (the field is named).
        MooncakeError / OSError: the store master cannot be reached (LMCache then runs
            without this remote backend and logs why).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: LocalCPUBackend,
                 config: Optional[LMCacheEngineConfig] = None) -> None:
        self.lookup_only = isinstance(local_cpu_backend, SafeLocalCPUBackend)
        if self.lookup_only:
            if config is None:
                raise ValueError("LMCache's scheduler role gave the connector no config")
            # RemoteConnector.__init__ needs LMCache's metadata, which the stand-in lacks;
            # what it derives from it (chunk shapes and sizes) only serves gets and puts.
            lm = config
        else:
            super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
            lm = config if config is not None else local_cpu_backend.config
        if lm.remote_serde not in (None, "naive"):
            raise ValueError(f"remote_serde {lm.remote_serde!r}: mooncake_plugins stores "
                             "chunks as raw bytes and needs remote_serde 'naive'")
        if lm.use_layerwise:
            raise ValueError("use_layerwise: mooncake_plugins stores whole chunks; set "
                             "use_layerwise to false")
        self.settings: ConnectorSettings = from_extra_config(lm.extra_config)
        s = self.settings
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self._prefix = f"{s.key_prefix}lmcache/"
        segment = 0 if self.lookup_only else s.global_segment_size
        client = StoreClient(s.master_server_address, local_hostname=s.local_hostname,
                             metadata_server=s.metadata_server,
                             global_segment_size=segment, protocol=s.protocol,
                             rpc_timeout_s=s.rpc_timeout_s,
                             transfer_timeout_s=s.transfer_timeout_s,
                             failover_timeout_s=s.rpc_timeout_s)
        self.io = ChunkIO(client, s.replica_num)
        try:
            for address, nbytes, location in _pool_buffers(local_cpu_backend):  # none: stand-in
                self.io.register(address, nbytes, location)
        except BaseException:
            self.io.unregister_all()
            client.close()
            raise
        self._pool = ThreadPoolExecutor(s.io_threads, thread_name_prefix="mc-lmcache")
        if self.lookup_only:
            log.info("LMCache connector on the store at %s: lookups only (LMCache's "
                     "scheduler role, no CPU pool)", s.master_server_address)
        else:
            log.info("LMCache connector on the store at %s (segment %d bytes, zero-copy "
                     "over %d buffers)", s.master_server_address, segment,
                     self.io.region_count)

    def _require_pool(self, what: str) -> None:
        if self.lookup_only:
            raise RuntimeError(f"{what}: this connector was built in LMCache's scheduler "
                               "role (no CPU pool) and only looks chunks up")

    # -- keys and calls -------------------------------------------------------------
    def store_key(self, key: CacheEngineKey) -> str:
        """``{key_prefix}lmcache/{model}@{world size}@{worker}@{chunk hash}@{dtype}...``."""
        return self._prefix + key.to_string()

    async def _run(self, fn: Callable[..., Any], *args: Any,
                   hold: Sequence[MemoryObj] = ()) -> Any:
        """``fn(*args)`` on a worker thread, waited for at most ``transfer_timeout_s``.

        ``hold`` objects get an extra reference until ``fn`` returns, even when the wait
        ends first. Raises asyncio.TimeoutError on timeout."""
        for obj in hold:
            obj.ref_count_up()
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

        def release(f: asyncio.Future) -> None:
            for obj in hold:
                obj.ref_count_down()
            if not f.cancelled() and f.exception() is not None:
                log.debug("store call %s failed: %s", getattr(fn, "__name__", fn),
                          f.exception())

        fut.add_done_callback(release)
        return await asyncio.wait_for(asyncio.shield(fut), self.settings.transfer_timeout_s)

    # -- existence ------------------------------------------------------------------
    async def exists(self, key: CacheEngineKey) -> bool:
        return await self.batched_async_contains("", [key]) == 1

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.batched_contains([key]) == 1

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        """How many of ``keys``, from the first, the store holds (0 if it is out)."""
        try:
            found = self.io.client.batch_exists([self.store_key(k) for k in keys])
        except MooncakeError as exc:
            log.warning("store lookup failed (treated as a miss): %s", exc)
            return 0
        return _prefix_len(found)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey],
                                     pin: bool = False) -> int:
        try:
            found = await self._run(self.io.client.batch_exists,
                                    [self.store_key(k) for k in keys])
        except (MooncakeError, asyncio.TimeoutError) as exc:
            log.warning("store lookup %s failed (treated as a miss): %r", lookup_id, exc)
            return 0
        return _prefix_len(found)

    # -- gets -----------------------------------------------------------------------
    def support_batched_get(self) -> bool:
        return True

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return (await self.batched_get([key]))[0]

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        """Each chunk in a memory object from LMCache's local CPU pool, or None."""
        self._require_pool("get")
        objs: list[Optional[MemoryObj]] = []
        for _ in keys:
            obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes,
                                                  self.meta_fmt)
            objs.append(obj if obj is not None and obj.raw_tensor is not None else None)
        todo = [i for i, o in enumerate(objs) if o is not None]
        if len(todo) < len(keys):
            log.warning("LMCache's CPU pool is full: %d of %d chunks not fetched",
                        len(keys) - len(todo), len(keys))
        held = [objs[i] for i in todo]
        try:
            got = await self._run(self.io.get, [self.store_key(keys[i]) for i in todo],
                                  held, hold=held) if todo else []
        except (MooncakeError, asyncio.TimeoutError) as exc:
            log.warning("store get of %d chunks failed (misses): %r", len(todo), exc)
            got = [exc] * len(todo)
        results: list[Optional[MemoryObj]] = [None] * len(keys)
        for i, n in zip(todo, got):
            obj = objs[i]
            if isinstance(n, Exception):
                log.debug("chunk %s not fetched: %s", keys[i], n)
                obj.ref_count_down()
                continue
            try:
                results[i] = self.reshape_partial_chunk(obj, n)
            except ValueError as exc:
                log.warning("chunk %s has %d bytes, not a whole number of tokens (miss): "
                            "%s", keys[i], n, exc)
                obj.ref_count_down()
        return results

    async def batched_get_non_blocking(self, lookup_id: str,
                                       keys: List[CacheEngineKey]) -> List[MemoryObj]:
        """The fetched chunks up to the first miss (later ones are released)."""
        out: list[MemoryObj] = []
        missed = False
        for obj in await self.batched_get(keys):
            if obj is None:
                missed = True
            elif missed:
                obj.ref_count_down()
            else:
                out.append(obj)
        return out

    # -- puts -----------------------------------------------------------------------
    def support_batched_put(self) -> bool:
        return True

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    async def batched_put(self, keys: List[CacheEngineKey],
                          memory_objs: List[MemoryObj]) -> None:
        """Store the chunks. Raises the first failure (LMCache logs and counts it);
        chunks that were stored stay stored."""
        self._require_pool("put")
        names = [self.store_key(k) for k in keys]
        try:
            errors = await self._run(self.io.put, names, list(memory_objs),
                                     hold=memory_objs)
        except asyncio.TimeoutError:
            raise TimeoutError(f"storing {len(keys)} chunks took longer than "
                               f"{self.settings.transfer_timeout_s} s") from None
        failed = [(n, e) for n, e in zip(names, errors) if e is not None]
        if failed:
            raise failed[0][1]

    # -- the rest -------------------------------------------------------------------
    def remove_sync(self, key: CacheEngineKey) -> bool:
        try:
            self.io.client.remove(self.store_key(key))
            return True
        except MooncakeError as exc:
            log.debug("remove %s: %s", key, exc)
            return False

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the master answers, else the store's negative error code."""
        try:
            await self._run(self.io.client.stats)
            return 0
        except MooncakeError as exc:
            return exc.code
        except asyncio.TimeoutError:
            return -1

    async def list(self) -> List[str]:
        raise NotImplementedError("the Mooncake store has no key listing")

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._close)

    def _close(self) -> None:
        self._pool.shutdown(wait=True)
        try:
            self.io.unregister_all()
        finally:
            self.io.client.close()


def _prefix_len(found: Sequence[bool]) -> int:
    for i, hit in enumerate(found):
        if not hit:
            return i
    return len(found)
