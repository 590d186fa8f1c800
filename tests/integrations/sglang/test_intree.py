"""SGLang's in-tree ``mooncake`` HiCache backend, unchanged, on our drop-in ``mooncake``
package; and our entry point making SGLang's ``mooncake`` name build our backend."""

from __future__ import annotations

from typing import Any

import pytest
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

import mooncake_sglang
import pools
from mooncake_sglang.backend import MooncakePluginsHiCache

NPAGES = 5


def intree_extra(address: str) -> dict[str, Any]:
    return {"master_server_address": address, "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp", "global_segment_size": 16 << 20, "local_hostname": "127.0.0.1",
            "device_name": ""}


def round_trip(backend: Any, pool: Any, seed: int) -> None:
    """Pages set through the zero-copy interface, found, read into other pages."""
    keys = [f"intree-{seed}-{i}" for i in range(NPAGES)]
    src = pool.alloc(NPAGES * pools.PAGE)
    pools.fill_pages(pool, src, seed)
    assert backend.batch_set_v1(keys, src) == [True] * NPAGES
    assert backend.batch_exists(keys + ["nope"]) == NPAGES
    dst = pool.alloc(NPAGES * pools.PAGE)
    assert backend.batch_get_v1(keys, dst) == [True] * NPAGES
    assert pools.page_digests(pool, dst) == pools.page_digests(pool, src)


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_intree_mooncake_backend_on_the_dropin(store, layout):
    pool = pools.host_pool(layout)
    cfg = pools.storage_config(intree_extra(store.address), layout)
    backend = StorageBackendFactory.create_backend("mooncake", cfg, pool)
    try:
        assert type(backend).__module__.startswith("sglang.")
        backend.register_mem_pool_host(pool)
        backend.on_host_pools_registered()
        round_trip(backend, pool, seed=9)
    finally:
        backend.close()


@pytest.fixture
def restore_registry():
    saved = dict(StorageBackendFactory._registry)
    yield
    StorageBackendFactory._registry.clear()
    StorageBackendFactory._registry.update(saved)


def test_entry_point_registers_only_when_asked(store, monkeypatch, restore_registry):
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "mooncake_plugins"]
    monkeypatch.delenv(mooncake_sglang.ENABLE_ENV, raising=False)
    ep.load()()
    assert StorageBackendFactory._registry["mooncake"]["module_path"].startswith("sglang.")
    monkeypatch.setenv(mooncake_sglang.ENABLE_ENV, "1")
    ep.load()()
    pool = pools.host_pool("page_first")
    extra = {"master_server_address": store.address, "global_segment_size": 0}
    backend = StorageBackendFactory.create_backend(
        "mooncake", pools.storage_config(extra, "page_first"), pool)
    try:
        assert isinstance(backend, MooncakePluginsHiCache)
        backend.register_mem_pool_host(pool)
        backend.on_host_pools_registered()
        round_trip(backend, pool, seed=10)
    finally:
        backend.close()
