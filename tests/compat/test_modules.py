"""The original wheel's pure-Python modules on our package: ``mooncake.mooncake_config``,
``mooncake.buffer_pool`` (and the core pool under it), ``mooncake.http_metadata_server``
(and the core server's in-process API), ``mooncake._fast_copy`` and ``mooncake.async_store``.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from helpers import free_port, terminate_group, wait_until

import mooncake
import mooncake.store
from mooncake import _fast_copy, buffer_pool
from mooncake.async_store import MooncakeDistributedStoreAsync
from mooncake.http_metadata_server import KVBootstrapServer, KVPoll
from mooncake.mooncake_config import (DEFAULT_GLOBAL_SEGMENT_SIZE, DEFAULT_LOCAL_BUFFER_SIZE,
                                      MooncakeConfig, _parse_segment_size)
try:  # absent from a MOONCAKE_PUREPYTHON=1 build: only the Python path is tested then
    from mooncake_plugins._native.fast_copy import concat_arrays_into as native_concat
except ImportError:
    native_concat = None
from mooncake_plugins.compat.store import MooncakeDistributedStore
from mooncake_plugins.errors import InvalidArgument, InvalidParams, NoAvailableSpace, RegionBusy
from mooncake_plugins.store import buffer_pool as core_pool
from mooncake_plugins.store.master import MasterConfig
from mooncake_plugins.store.server import MasterServer, ServerOptions
from mooncake_plugins.transfer import fast_copy
from mooncake_plugins.transfer.metadata.http import MetadataServer, Refused

REQUIRED = {"local_hostname": "node1", "metadata_server": "http://m:8080/metadata",
            "master_server_address": "m:50051"}
LOCAL = 1 << 20


# -- mooncake_config -----------------------------------------------------------------
@pytest.fixture
def config_file(tmp_path: Path):
    path = tmp_path / "config.json"

    def write(**fields: object) -> str:
        path.write_text(json.dumps(fields))
        return str(path)

    return write


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("MOONCAKE_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_config_from_file_reads_fields_and_defaults(config_file) -> None:
    cfg = MooncakeConfig.from_file(config_file(**REQUIRED))
    assert (cfg.global_segment_size, cfg.local_buffer_size) == \
        (DEFAULT_GLOBAL_SEGMENT_SIZE, DEFAULT_LOCAL_BUFFER_SIZE)
    assert (cfg.protocol, cfg.device_name, cfg.tenant_id, cfg.client_http_port) == \
        ("tcp", "", "default", 9300)
    assert cfg.enable_ssd_offload is False and cfg.ssd_offload_path == ""

    cfg = MooncakeConfig.from_file(config_file(
        **REQUIRED, global_segment_size="2 GB", local_buffer_size="512mb", protocol=" RDMA ",
        enable_ssd_offload="off", enable_client_http_server="enable", client_http_port="19444",
        tenant_id=None, ssd_offload_path=None))
    assert (cfg.global_segment_size, cfg.local_buffer_size) == (2 << 30, 512 << 20)
    assert cfg.protocol == "rdma"
    assert cfg.enable_ssd_offload is False and cfg.enable_client_http_server is True
    assert (cfg.client_http_port, cfg.tenant_id, cfg.ssd_offload_path) == (19444, "default", "")


@pytest.mark.parametrize("field", sorted(REQUIRED))
def test_config_missing_field_is_named(config_file, field: str) -> None:
    fields = {k: v for k, v in REQUIRED.items() if k != field}
    with pytest.raises(ValueError, match=f"Missing required config field: {field}"):
        MooncakeConfig.from_file(config_file(**fields))


def test_config_rejects_bad_values(config_file) -> None:
    with pytest.raises(ValueError, match="Invalid boolean"):
        MooncakeConfig.from_file(config_file(**REQUIRED, enable_ssd_offload="maybe"))
    with pytest.raises(ValueError, match="local_buffer_size"):
        MooncakeConfig(**REQUIRED, global_segment_size=0, local_buffer_size=-1,
                       protocol="tcp", device_name="")
    with pytest.raises(ValueError, match="Invalid protocol"):
        MooncakeConfig(**REQUIRED, global_segment_size=0, local_buffer_size=0,
                       protocol="  ", device_name="")
    with pytest.raises(ValueError, match="'metadata_server'"):
        MooncakeConfig(**{**REQUIRED, "metadata_server": " "}, global_segment_size=0,
                       local_buffer_size=0, protocol="tcp", device_name="")
    for bad in ("", "gb", "abc"):
        with pytest.raises(ValueError):
            _parse_segment_size(bad)
    assert _parse_segment_size("1.5kb") == 1536 and _parse_segment_size("1e3") == 1000


def test_config_unknown_protocol_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mooncake.mooncake_config"):
        cfg = MooncakeConfig(**REQUIRED, global_segment_size=0, local_buffer_size=0,
                             protocol="Carrier-Pigeon", device_name="")
    assert cfg.protocol == "carrier-pigeon"
    assert "Unrecognised protocol" in caplog.text


def test_config_load_from_env(clean_env: pytest.MonkeyPatch, config_file) -> None:
    with pytest.raises(ValueError, match="Neither the environment variable"):
        MooncakeConfig.load_from_env()
    clean_env.setenv("MOONCAKE_MASTER", "10.0.0.1:50051")
    clean_env.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "1gb")
    clean_env.setenv("MOONCAKE_OFFLOAD_ENABLED", "True")
    clean_env.setenv("MOONCAKE_TENANT_ID", "t1")
    cfg = MooncakeConfig.load_from_env()
    assert (cfg.master_server_address, cfg.metadata_server, cfg.local_hostname) == \
        ("10.0.0.1:50051", "P2PHANDSHAKE", "localhost")
    assert (cfg.global_segment_size, cfg.enable_ssd_offload, cfg.tenant_id) == (1 << 30, True, "t1")
    clean_env.setenv("MOONCAKE_CONFIG_PATH", config_file(**REQUIRED))
    assert MooncakeConfig.load_from_env().master_server_address == "m:50051"


# -- buffer pool -----------------------------------------------------------------------
@pytest.fixture
def master() -> Iterator[MasterServer]:
    server = MasterServer(MasterConfig(default_kv_lease_ttl_ms=50), ServerOptions(rpc_port=0))
    server.start()
    yield server
    server.close()


@pytest.fixture
def store(master: MasterServer) -> Iterator[MooncakeDistributedStore]:
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 8 << 20, LOCAL, "tcp", "", master.address) == 0
    yield s
    s.close()


def test_buffer_pool_exports() -> None:
    assert mooncake.BufferPool is mooncake.RegisteredBufferPool is buffer_pool.BufferPool
    assert mooncake.store.BufferPool is buffer_pool.BufferPool
    assert "BufferPool" in mooncake.store.__all__


def test_leases_are_registered_for_zero_copy(store: MooncakeDistributedStore) -> None:
    pool = buffer_pool.BufferPool(store, min_size_class=4096, alignment=4096)
    src = pool.acquire(LOCAL)            # the whole local buffer
    dst = pool.acquire(1000)             # an overflow region, registered for the lease
    assert dst.ptr % 4096 == 0
    src.buffer[:1000] = os.urandom(1000)
    assert store.put_from("k", src.ptr, 1000) == 0
    assert store.get_into("k", dst.ptr, 1000) == 1000
    assert bytes(dst.buffer) == bytes(src.buffer[:1000])
    released_at = dst.ptr
    dst.release()
    src.release()
    gc.collect()
    # the overflow region was unregistered and unmapped with its lease
    assert store.get_into("k", released_at, 1000) < 0
    pool.close()


def test_pool_reuses_released_local_blocks(store: MooncakeDistributedStore) -> None:
    pool = buffer_pool.BufferPool(store, LOCAL)
    first = pool.acquire(LOCAL // 2)
    first_ptr = first.ptr
    first.release()
    with pool.acquire(LOCAL // 2) as again:
        assert again.ptr == first_ptr
        assert again.size == LOCAL // 2 and len(again.buffer) == LOCAL // 2
    with pytest.raises(RuntimeError, match="closed"):
        _ = again.ptr
    pool.close()


def test_pool_limits(store: MooncakeDistributedStore) -> None:
    pool = buffer_pool.BufferPool(store, max_regions=1, block_on_exhaustion=False)
    lease = pool.acquire(10)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(10)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(10, block=True, timeout=0.05)
    with pytest.raises(RuntimeError, match="capacity"):
        pool.acquire(2 * LOCAL + 1)      # max_bytes defaults to twice the local buffer
    with pytest.raises(RuntimeError, match="overflow"):
        pool.acquire(1 << 64)
    lease.release()
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(1)


def test_blocked_acquire_wakes_on_release(store: MooncakeDistributedStore) -> None:
    pool = buffer_pool.BufferPool(store, max_bytes=LOCAL)
    held = pool.acquire(LOCAL)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(LOCAL, timeout=60)))
    waiter.start()
    # counted under the pool's lock just before the acquire waits for room: the waiter
    # is then waiting (stats() takes that lock, which the waiting acquire has let go)
    assert wait_until(lambda: pool._pool.stats()["waits"] >= 1 or not waiter.is_alive(), 30)
    assert not got and waiter.is_alive() and pool._pool.stats()["waits"] == 1
    held.release()
    waiter.join(30)
    assert got and got[0].size == LOCAL
    got[0].release()
    pool.close()


@pytest.mark.parametrize("alignment", [0, 4, 12345])
def test_pool_rejects_bad_alignment(store: MooncakeDistributedStore, alignment: int) -> None:
    with pytest.raises(RuntimeError, match="alignment"):
        buffer_pool.BufferPool(store, alignment=alignment)


def test_pool_needs_a_set_up_store_with_local_buffer(master: MasterServer) -> None:
    with pytest.raises(RuntimeError, match="not initialized"):
        buffer_pool.BufferPool(MooncakeDistributedStore())
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 1 << 20, 0, "tcp", "", master.address) == 0
    try:
        with pytest.raises(RuntimeError, match="local buffer"):
            buffer_pool.BufferPool(s)
    finally:
        s.close()


def test_views_hold_the_lease(store: MooncakeDistributedStore) -> None:
    pool = buffer_pool.BufferPool(store)
    lease = pool.acquire(8)
    view = lease.buffer[2:6]             # a slice holds it as well
    view[:] = b"abcd"
    with pytest.raises(RuntimeError, match="exported views"):
        lease.release()
    with pytest.raises(RuntimeError, match="active leases"):
        pool.close()
    del view
    lease.release()
    lease.release()                      # idempotent
    pool.close()


def test_dropped_lease_is_released(store: MooncakeDistributedStore) -> None:
    pool = core_pool.BufferPool(store.client, LOCAL, max_regions=1)
    lease = pool.acquire(1)
    view = lease.buffer
    del lease                            # the view keeps it
    assert pool.stats()["active_leases"] == 1
    del view
    gc.collect()
    assert pool.stats()["active_leases"] == 0
    pool.acquire(1).release()
    pool.close()


def test_core_pool_errors_and_stats(store: MooncakeDistributedStore) -> None:
    with pytest.raises(InvalidParams, match="alignment"):
        core_pool.BufferPool(store.client, LOCAL, alignment=3)
    pool = core_pool.BufferPool(store.client, LOCAL, max_size_class=100,
                                block_on_exhaustion=False, max_regions=2)
    pool.prewarm(4096, 4)
    a, b = pool.acquire(LOCAL), pool.acquire(200)
    with pytest.raises(NoAvailableSpace, match="exhausted"):
        pool.acquire(1)
    with pytest.raises(RegionBusy, match="active leases"):
        pool.close()
    stats = pool.stats()
    assert (stats["acquires"], stats["overflows"], stats["oversize"]) == (2, 1, 2)
    assert stats["used_bytes"] == LOCAL + 200
    a.release()
    b.release()
    assert pool.stats()["releases"] == 2
    pool.close()


# -- http metadata server ----------------------------------------------------------------
class FakeRequest:
    def __init__(self, method: str, key: str | None = None, body: bytes = b"") -> None:
        self.method, self.body = method, body
        self.query = {} if key is None else {"key": key}

    async def read(self) -> bytes:
        return self.body


def _http(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def test_bootstrap_server_over_http() -> None:
    server = KVBootstrapServer(port=0, host="127.0.0.1")
    assert server.poll() is KVPoll.Failed
    assert server.run() is not None
    try:
        assert server.poll() is KVPoll.Success and server.port > 0
        url = f"http://127.0.0.1:{server.port}/metadata?key="
        assert _http("PUT", url + "%20seg%20", b"v1")[0] == 200
        assert dict(server.store) == {"seg": b"v1"}
        assert _http("GET", url + "seg") == (200, b"v1")
        assert _http("PUT", url + "%20%20", b"v")[0] == 400
        assert _http("PUT", url + "mooncake/rpc_meta/a", b"ep1")[0] == 200
        assert _http("PUT", url + "mooncake/rpc_meta/a", b"ep1")[0] == 200
        assert _http("PUT", url + "mooncake/rpc_meta/a", b"ep2")[0] == 400
        assert _http("DELETE", url + "seg")[0] == 200
        assert _http("GET", url + "seg")[0] == 404
    finally:
        server.close()
    assert server.poll() is KVPoll.Failed


def test_bootstrap_server_in_process() -> None:
    server = KVBootstrapServer(port=0)

    async def run() -> None:
        for method in ("GET", "PUT", "DELETE"):
            reply = await server._handle_metadata(FakeRequest(method, " ", b"x"))
            assert (reply.status, reply.content_type) == (400, "application/json")
        assert (await server._handle_metadata(FakeRequest("PUT", " k ", b"v"))).status == 200
        reply = await server._handle_metadata(FakeRequest("GET", "k"))
        assert (reply.status, reply.body) == (200, b"v")
        assert (await server._handle_metadata(FakeRequest("POST", "k"))).status == 405
        assert (await server._handle_metadata(FakeRequest("DELETE", "k"))).status == 200
        assert (await server._handle_metadata(FakeRequest("DELETE", "k"))).status == 404

    asyncio.run(run())
    assert "k" not in server.store


def test_core_server_in_process_api_shares_limits() -> None:
    server = MetadataServer(max_nbytes=1000)
    assert server.put("a", b"x" * 100) is True
    assert server.get("a") == b"x" * 100 and server.get("b") is None
    with pytest.raises(Refused) as full:
        server.put("b", b"y" * 1000)
    assert full.value.status == 507
    assert server.put("p/rpc_meta/x", b"e") is True
    assert server.put("p/rpc_meta/x", b"e") is False
    with pytest.raises(Refused, match="rpc_meta"):
        server.put("p/rpc_meta/x", b"f")
    with pytest.raises(InvalidArgument):
        server.put("", b"v")
    assert server.get(" a ") is None                 # keys are not stripped by default
    with server:                                      # the same entries served over HTTP
        assert _http("GET", f"{server.url}?key=a") == (200, b"x" * 100)
        assert _http("PUT", f"{server.url}?key=c", b"z" * 1000)[0] == 507
    assert server.delete("a") is True and server.delete("a") is False
    assert server.used_nbytes == len("p/rpc_meta/x") + 1 + 256


def test_http_metadata_server_command() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys, mooncake.http_metadata_server as m; sys.exit(m.main())",
         "--port", str(port), "--host", "127.0.0.1", "--log-level", "WARNING"],
        start_new_session=True)
    try:
        def up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0
        assert wait_until(up, 20)
        url = f"http://127.0.0.1:{port}/metadata?key=k"
        assert _http("PUT", url, b"v")[0] == 200 and _http("GET", url) == (200, b"v")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        terminate_group(proc)


@pytest.mark.parametrize("host, warned", [("127.0.0.1", False), ("0.0.0.0", True)])
def test_http_metadata_server_command_warns_off_loopback(host: str, warned: bool) -> None:
    from mooncake import http_metadata_server as m
    assert m._is_loopback("localhost") and m._is_loopback("::1")
    assert not m._is_loopback("node-7.example")  # a name: assumed reachable from elsewhere
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys, mooncake.http_metadata_server as m; sys.exit(m.main())",
         "--port", "0", "--host", host], stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        lines = []
        for line in proc.stderr:  # INFO logs "started" once it listens
            lines.append(line)
            if "started" in line:
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        terminate_group(proc)
        proc.stderr.close()
    assert any("any host that reaches this port" in line for line in lines) is warned


# -- fast copy ---------------------------------------------------------------------------
CONCATS = {"python": fast_copy._py_concat_arrays_into,
           **({"native": native_concat} if native_concat else {})}


@pytest.fixture(params=sorted(CONCATS))
def concat(request: pytest.FixtureRequest):
    return CONCATS[request.param]


def test_concat_copies_a_range(concat) -> None:
    arrays = [np.arange(n, dtype=np.float32) + n for n in (3, 0, 5, 7, 2)]
    want = np.concatenate(arrays[1:4]).tobytes()
    dest = ctypes.create_string_buffer(len(want) + 4)
    assert concat(arrays, ctypes.addressof(dest), len(dest), 1, 3) == len(want)
    assert dest.raw[:len(want)] == want and dest.raw[len(want):] == b"\0" * 4
    # out-of-range start/count clamp to the list
    assert concat(arrays, ctypes.addressof(dest), 0, 9, 3) == 0
    assert concat(arrays, ctypes.addressof(dest), len(dest), 4, 99) == 8


def test_concat_with_threads(concat) -> None:
    arrays = [np.random.default_rng(i).integers(0, 255, 1000 + i, dtype=np.uint8)
              for i in range(37)]
    want = np.concatenate(arrays).tobytes()
    dest = ctypes.create_string_buffer(len(want))
    assert concat(arrays, ctypes.addressof(dest), len(dest), 0, -1, 4) == len(want)
    assert dest.raw == want


def test_concat_errors(concat) -> None:
    dest = ctypes.create_string_buffer(8)
    addr = ctypes.addressof(dest)
    with pytest.raises(ValueError, match="destination buffer too small: need 9 bytes, got 8"):
        concat([np.zeros(9, np.uint8)], addr, 8)
    with pytest.raises(ValueError, match=r"arrays\[1\] is not C-contiguous"):
        concat([np.zeros(1, np.uint8), np.zeros((2, 2), np.uint8).T], addr, 8)
    with pytest.raises(TypeError, match=r"arrays\[0\]"):
        concat([object()], addr, 8)
    with pytest.raises(TypeError):
        concat((np.zeros(1, np.uint8),), addr, 8)
    assert dest.raw == b"\0" * 8                     # nothing copied on error


def test_fast_copy_implementation_follows_env() -> None:
    pure = native_concat is None or os.environ.get("MOONCAKE_PUREPYTHON") == "1"
    assert _fast_copy.concat_arrays_into is (fast_copy._py_concat_arrays_into if pure
                                             else native_concat)
    out = subprocess.run([sys.executable, "-c",
                          "import mooncake._fast_copy as f; print(f.IMPLEMENTATION)"],
                         env={**os.environ, "MOONCAKE_PUREPYTHON": "1"},
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "python"


# -- async store -------------------------------------------------------------------------
def test_async_store(master: MasterServer) -> None:
    store = MooncakeDistributedStoreAsync()
    assert store.setup("localhost", "P2PHANDSHAKE", 4 << 20, 1 << 20, "tcp", "", master.address) == 0

    async def run() -> None:
        rcs = await asyncio.gather(*(store.async_put(f"k{i}", b"v%d" % i) for i in range(4)))
        assert rcs == [0] * 4
        assert await store.async_get("k3") == b"v3"
        assert await store.async_is_exist("k0") == 1

    try:
        asyncio.run(run())
        assert store.async_get is store.async_get   # made once per name
        with pytest.raises(AttributeError, match="nor 'nope'"):
            _ = store.async_nope
        with pytest.raises(AttributeError):
            _ = store.nope
    finally:
        store.close()
