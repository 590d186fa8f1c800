"""Our HiCache backend built by SGLang's own factory over a real host KV pool on CPU:
pages set, found, read back into other pages (bytes compared) for every layout, by this
process and by a second one; store faults give misses, never wrong pages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

import mooncake_sglang
import pools
from mooncake_sglang.backend import MooncakePluginsHiCache

HERE = Path(__file__).resolve().parent
LAYOUTS = ["page_first", "page_first_direct", "layer_first"]  # layer_first: generic path
NPAGES = 6


def build(address: str, layout: str, **settings: Any) -> tuple[Any, Any]:
    """(backend, pool) as SGLang's controller attaches them, for ``dynamic``."""
    extra = mooncake_sglang.dynamic_extra_config(
        master_server_address=address, global_segment_size=0, rpc_timeout_s=2.0,
        interface_v1=int(layout != "layer_first"), **settings)
    pool = pools.host_pool(layout)
    backend = StorageBackendFactory.create_backend("dynamic", pools.storage_config(extra, layout),
                                                   pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend, pool


@pytest.fixture(params=LAYOUTS)
def attached(request, store) -> Iterator[tuple[Any, Any, str]]:
    backend, pool = build(store.address, request.param)
    try:
        yield backend, pool, request.param
    finally:
        backend.close()


def stored_pages(backend: Any, pool: Any, seed: int = 3) -> tuple[list[str], Any]:
    keys = [f"page-{seed}-{i}" for i in range(NPAGES)]
    src = pool.alloc(NPAGES * pools.PAGE)
    pools.fill_pages(pool, src, seed)
    assert pools.write_pages(backend, pool, keys, src) == [True] * NPAGES
    return keys, src


def test_set_exists_and_read_back_into_other_pages(attached):
    backend, pool, layout = attached
    assert isinstance(backend, MooncakePluginsHiCache)
    keys, src = stored_pages(backend, pool)
    assert backend.batch_exists(keys + ["nope"]) == NPAGES
    assert backend.batch_exists(["nope"] + keys) == 0
    assert backend.exists(keys[0]) and not backend.exists("nope")
    dst = pool.alloc(NPAGES * pools.PAGE)
    assert pools.read_pages(backend, pool, keys, dst) == [True] * NPAGES
    assert pools.page_digests(pool, dst) == pools.page_digests(pool, src)
    assert pools.write_pages(backend, pool, keys, src) == [True] * NPAGES  # stored already


def test_keys_carry_model_rank_and_layout(store):
    a, pool_a = build(store.address, "page_first")
    b, pool_b = build(store.address, "page_first_direct")
    try:
        keys, _ = stored_pages(a, pool_a)
        assert b.batch_exists(keys) == 0  # another layout never reads these pages
        name = a._keys(["h"], flat=False)[0]
        assert name.startswith("sglang/llama-") and "/tp0of1/page_first/h" in name
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_second_process_finds_and_reads_the_first_ones_pages(store, layout):
    backend, pool = build(store.address, layout)
    try:
        keys, src = stored_pages(backend, pool, seed=5)
        want = pools.page_digests(pool, src)
    finally:
        backend.close()
    out = subprocess.run([sys.executable, str(HERE / "reader.py"), store.address, layout,
                          *keys], capture_output=True, text=True, timeout=180, cwd=HERE)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["hits"] == NPAGES and result["ok"] == [True] * NPAGES
    assert result["digests"] == want


def test_evicted_page_is_a_miss_and_the_rest_stay_right(attached):
    backend, pool, layout = attached
    keys, src = stored_pages(backend, pool)
    flat = layout == "layer_first"
    backend.client.remove(backend._keys([keys[2]], flat=flat)[0], force=True)
    assert backend.batch_exists(keys) == 2
    dst = pool.alloc(NPAGES * pools.PAGE)
    ok = pools.read_pages(backend, pool, keys, dst)
    assert ok == [True, True, False, True, True, True]
    want, got = pools.page_digests(pool, src), pools.page_digests(pool, dst)
    assert [g == w for g, w in zip(got, want)] == ok


def test_master_down_gives_misses(store, attached):
    backend, pool, _ = attached
    keys, _ = stored_pages(backend, pool)
    store.stop_master()
    assert backend.batch_exists(keys) == 0
    dst = pool.alloc(NPAGES * pools.PAGE)
    assert pools.read_pages(backend, pool, keys, dst) == [False] * NPAGES


def test_settings_errors_name_the_key(store):
    with pytest.raises(ValueError, match=r"hicache-storage-backend-extra-config: unknown key "
                                         r"'master_address'"):
        build(store.address, "page_first", master_address="x:1")
    with pytest.raises(ValueError, match=r"protocol 'efa'"):
        build(store.address, "page_first", protocol="efa")
