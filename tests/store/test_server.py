"""The master process surface: RPC robustness, CLI flags, metrics, embedded metadata, HA."""

import json
import random
import socket
import subprocess
import sys
import time
import urllib.request

import msgpack
import pytest
from helpers import free_port, spawn_ready, terminate_group, wait_until

from mooncake_plugins.errors import ObjectNotFound, RpcFailed
from mooncake_plugins.store.client import StoreClient
from mooncake_plugins.store.rpc import LENGTH, RpcClient

# This module checks the master's server: RPC, reaper, metrics. CI's MOONCAKE_PUREPYTHON=1
# pass leaves it out (-m 'not control_plane'): the Python fallbacks would carry only its RPC
# frames, which that pass's data-path modules and tests/security/test_master_rpc.py cover.
pytestmark = pytest.mark.control_plane


def raw(port, data):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            return b""
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return out
            if not chunk:
                return out
            out += chunk


def frame(obj):
    body = msgpack.packb(obj)
    return LENGTH.pack(len(body)) + body


@pytest.mark.parametrize("data", [
    b"\xff\xff\xff\xff", LENGTH.pack(0), LENGTH.pack(5) + b"\xc1\xc1\xc1\xc1\xc1",
    frame("not a list"), frame([1, "get_replicas"]), frame([1, 2, {}]),
    frame([1, "rm_rf", {}]), frame([1, "get_replicas", {"keys": "k"}]),
    frame([1, "get_replicas", {"keys": [1, 2]}]), frame([1, "get_replicas", {}]),
    frame([1, "get_replicas", {"keys": ["k"], "extra": 1}]),
    frame([1, "put_start", {"client_id": "c", "keys": ["k"], "sizes": ["1"],
                            "config": {"replica_num": 1}}]),
    frame([1, "put_start", {"client_id": "c", "keys": ["k"], "sizes": [1],
                            "config": {"bogus": 1}}]),
    frame([1, "remove", {"keys": ["k"], "force": "yes"}]),
    frame([1, "unregister_client", {"client_id": 5}]),
], ids=lambda d: d[:12].hex())
def test_malformed_rpc_frames_close_only_that_connection(master, data, caplog):
    assert raw(master.port, data) == b""
    assert "malformed frame" in caplog.text
    rpc = RpcClient("127.0.0.1", master.port)
    assert rpc.call("exist", keys=["k"]) == [0]  # the master still serves
    rpc.close()


def test_random_garbage_and_valid_errors(master):
    rng = random.Random(3)
    for _ in range(100):
        raw(master.port, rng.randbytes(rng.randrange(1, 200)))
    rpc = RpcClient("127.0.0.1", master.port)
    with pytest.raises(ObjectNotFound):
        code, msg = rpc.call("get_replicas", keys=["missing"])[0]
        raise ObjectNotFound(msg) if code == -704 else AssertionError(code)
    big_key = ["x" * 10000]
    assert rpc.call("get_replicas", keys=big_key)[0][0] == -400  # INVALID_KEY
    rpc.close()


def test_cli_flags_metrics_and_embedded_metadata():
    mport, hport = free_port(), free_port()
    proc, port = spawn_ready([sys.executable, "-m", "mooncake_plugins.cli.master", "-rpc_port=0",
                              "--enable_metric_reporting=true", f"--metrics_port={mport}",
                              "--enable_http_metadata_server", f"--http_metadata_server_port={hport}",
                              "--allocation_strategy", "free_ratio_first"], timeout_s=30)
    try:
        meta = f"http://127.0.0.1:{hport}/metadata"
        with StoreClient(f"127.0.0.1:{port}", metadata_server=meta, global_segment_size=1 << 20) as c:
            c.put("m", b"v" * 100)
            assert c.get("m") == b"v" * 100
            # the segment was published in the master's own metadata server
            with urllib.request.urlopen(f"{meta}?key=mooncake/segments/{c.segment_name}") as r:
                assert r.status == 200
            text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics").read().decode()
            assert "mooncake_master_objects 1.0" in text
            assert "mooncake_master_puts_total 1.0" in text
    finally:
        assert terminate_group(proc) == 0


def test_an_idle_master_logs_its_stats_once(caplog):
    """The stats line comes again only when a counter changed since the last one."""
    from mooncake_plugins.store.master import MasterConfig
    from mooncake_plugins.store.server import MasterServer, ServerOptions

    def lines() -> int:
        return sum(r.getMessage().startswith("master stats:") for r in caplog.records)

    caplog.set_level("INFO", logger="mooncake_plugins.store.server")
    server = MasterServer(MasterConfig(), ServerOptions(rpc_port=0, metric_report_interval_s=0.02,
                                                        reap_interval_s=0.01))
    server.start()
    try:
        assert wait_until(lambda: lines() == 1, timeout_s=10)
        time.sleep(0.3)                     # 15 intervals, idle
        assert lines() == 1
        server.service.register_client("c", "host")
        assert wait_until(lambda: lines() == 2, timeout_s=10)
        time.sleep(0.3)
        assert lines() == 2
    finally:
        server.close()


def test_json_logs():
    proc = subprocess.Popen([sys.executable, "-m", "mooncake_plugins.cli.master", "--rpc_port", "0",
                             "--metrics_port", "0", "--log_format", "json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout.readline().startswith(b"READY ")
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    finally:
        terminate_group(proc)
    lines = [json.loads(line) for line in err.decode().splitlines() if line.strip()]
    assert any(e["message"].startswith("master serving on") and e["level"] == "INFO" for e in lines)


def test_cli_rejects_bad_flags():
    res = subprocess.run([sys.executable, "-m", "mooncake_plugins.cli.master", "--enable_ha"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "etcd_endpoints" in res.stderr
    res = subprocess.run([sys.executable, "-m", "mooncake_plugins.cli.master",
                          "--allocation_strategy", "best"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2
    res = subprocess.run([sys.executable, "-m", "mooncake_plugins.cli.master", "--enable_offload"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "--root_fs_dir" in res.stderr
    res = subprocess.run([sys.executable, "-m", "mooncake_plugins.cli.master", "--enable_offload",
                          "--root_fs_dir", "/nonexistent/mooncake"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "not a directory" in res.stderr


@pytest.mark.etcd
def test_ha_failover_clients_follow_the_leader(etcd_server):
    endpoints = etcd_server.split("://", 1)[1]
    masters = []
    flags = ["--enable_ha", "--etcd_endpoints", endpoints, "--cluster_id", "ha-test", "--metrics_port=0"]
    try:
        ports = [free_port(), free_port()]
        first, _ = spawn_ready([sys.executable, "-m", "mooncake_plugins.cli.master",
                                "--rpc_port", str(ports[0]), *flags], timeout_s=30)
        masters.append(first)
        second = subprocess.Popen([sys.executable, "-m", "mooncake_plugins.cli.master",
                                   "--rpc_port", str(ports[1]), *flags],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        masters.append(second)
        with StoreClient(f"etcd://{endpoints}", cluster_id="ha-test",
                         global_segment_size=1 << 20) as c:
            assert c.master_address == f"127.0.0.1:{ports[0]}"
            c.put("before", b"1")
            first.kill()
            first.wait(10)
            assert second.stdout.readline().decode().strip() == f"READY {ports[1]}"
            # the next calls find the new leader, re-register and remount on their own
            assert wait_until(lambda: _try_put(c, "after", b"2"), 30)
            assert c.master_address == f"127.0.0.1:{ports[1]}"
            assert c.get("after") == b"2"
            assert c.get("before") == b"1"   # the new leader recovered it from etcd
            assert wait_until(lambda: c.stats()["segments"] == 1, 10)
    finally:
        for p in masters:
            terminate_group(p)
            if p.stdout:
                p.stdout.close()


def _try_put(client, key, value):
    try:
        client.put(key, value)
        return True
    except RpcFailed:
        return False
