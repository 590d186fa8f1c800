"""Our connector inside LMCache's own storage stack: selected by LMCache's config alone,
real memory objects from LMCache's CPU pool, bytes compared, a second worker process,
and store faults that give misses."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch
from helpers import wait_until
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

import lmc
from mooncake_lmcache.connector import MooncakePluginsConnector

HERE = Path(__file__).resolve().parent
SEED = 7


@pytest.fixture
def backends(store) -> Iterator[lmc.Backends]:
    b = lmc.Backends(lmc.config(["mooncake_plugins"], lmc.ours(store.address)))
    try:
        yield b
    finally:
        b.close()


def connector(b: lmc.Backends) -> MooncakePluginsConnector:
    assert b.remote is not None and b.remote.connection is not None, "no remote connection"
    conn = b.remote.connection.getWrappedConnector()
    assert isinstance(conn, MooncakePluginsConnector)
    return conn


def store_chunks(b: lmc.Backends, n: int, partial_tokens: int = 5) -> list[int]:
    """Chunks 0..n-1 (the last one short, as a prompt's tail), stored; their token counts."""
    tokens = [lmc.CHUNK] * (n - 1) + [partial_tokens]
    objs = [b.chunk(SEED, i, t) for i, t in enumerate(tokens)]
    try:
        b.put([lmc.key(i) for i in range(n)], objs)
    finally:
        for o in objs:
            o.ref_count_down()
    return tokens


def test_selected_by_lmcache_config_zero_copy_on_its_pool(backends):
    assert list(backends.all) == ["LocalCPUBackend", "RemoteBackend-mooncake_plugins"]
    conn = connector(backends)
    obj = backends.chunk(SEED, 0)
    try:
        assert conn.io.zero_copy(obj)  # LMCache's pool is registered: no staging copy
    finally:
        obj.ref_count_down()
    assert conn.store_key(lmc.key(3)) == "lmcache/tiny-llama@1@0@5eed0003@float"


def test_put_contains_batched_get_bytes_equal(backends):
    tokens = store_chunks(backends, 6)
    remote = backends.remote
    assert all(remote.contains(lmc.key(i)) for i in range(6))
    assert not remote.contains(lmc.key(99))
    keys = [lmc.key(i) for i in (0, 1, 2, 99, 3)]
    assert remote.batched_contains(keys) == 3  # a prefix count stops at the first miss
    got = remote.batched_get_blocking([lmc.key(i) for i in range(6)] + [lmc.key(99)])
    try:
        assert got[-1] is None
        for i, obj in enumerate(got[:-1]):
            assert obj is not None, f"chunk {i} missing"
            assert lmc.digest(obj) == lmc.expected_digest(SEED, i, tokens[i])
        assert got[5].meta.shape[2] == tokens[5]  # the short tail keeps its token count
    finally:
        for obj in got:
            if obj is not None:
                obj.ref_count_down()


def test_second_process_reads_what_the_first_stored(store, backends):
    tokens = store_chunks(backends, 8)
    out = subprocess.run([sys.executable, str(HERE / "reader.py"), store.address, "8", "50"],
                         capture_output=True, text=True, timeout=120, cwd=HERE)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["contains"] == 8
    assert result["digests"] == [lmc.expected_digest(SEED, i, t) for i, t in enumerate(tokens)] \
        + [None]


def test_objects_outside_the_pool_are_copied(backends):
    conn = connector(backends)
    shape = backends.metadata.get_shapes()[0]
    nbytes = shape.numel() * 4

    def outside(data: torch.Tensor | None) -> TensorMemoryObj:
        raw = torch.zeros(nbytes, dtype=torch.uint8)
        if data is not None:
            raw.copy_(data.reshape(-1).view(torch.uint8))
        return TensorMemoryObj(raw, MemoryObjMetadata(shape, torch.float32, 0, nbytes, 1),
                               None)

    src = outside(lmc.chunk_bytes(SEED, 40))
    assert not conn.io.zero_copy(src)
    assert conn.io.put(["outside/0"], [src]) == [None]
    dst = outside(None)
    assert conn.io.get(["outside/0"], [dst]) == [nbytes]
    assert lmc.digest(dst) == lmc.expected_digest(SEED, 40)


def test_master_down_gives_misses_not_hangs(store, backends):
    store_chunks(backends, 2)
    store.stop_master()
    remote = backends.remote
    t0 = time.monotonic()
    assert not remote.contains(lmc.key(0))
    assert remote.batched_contains([lmc.key(0), lmc.key(1)]) == 0
    got = remote.batched_get_blocking([lmc.key(0), lmc.key(1)])
    assert got == [None, None]
    assert time.monotonic() - t0 < 30


def test_a_call_past_its_timeout_keeps_its_memory_until_it_ends(store):
    b = lmc.Backends(lmc.config(["mooncake_plugins"],
                                lmc.ours(store.address) | {
                                    "mooncake_plugins.transfer_timeout_s": 0.5}))
    release = threading.Event()
    try:
        conn = connector(b)
        seen: list = []

        def stuck_get(keys, objs):  # a get that ends only when the test lets it
            seen.extend(objs)
            release.wait(120)
            seen.append([o.get_ref_count() for o in objs])
            return [o.get_size() for o in objs]

        conn.io.get = stuck_get
        assert b.remote.batched_get_blocking([lmc.key(0)]) == [None]
        # the caller got its miss on time: the call cannot end before the release below
        assert wait_until(lambda: len(seen) == 1, 30)  # (its thread may start late)
        (obj,) = seen
        assert obj.get_ref_count() == 1  # ... the late call still holds the object it fills
        release.set()
        assert wait_until(lambda: len(seen) == 2, 30)
        assert seen[1] == [1]  # held until its very end
        assert wait_until(lambda: obj.get_ref_count() == 0, 30)  # and given back then
    finally:
        release.set()
        b.close()
