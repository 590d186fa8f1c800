"""The master's admin HTTP API in the original's shapes (upstream master_admin_service.cpp),
against an in-process master with real clients, and two HA masters on a real etcd."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
from helpers import wait_until

from mooncake_plugins.store.client import ReplicateConfig, StoreClient
from mooncake_plugins.store.master import MasterConfig
from mooncake_plugins.store.server import MasterServer, ServerOptions

# the original's HttpSegmentDetailItem fields
SEGMENT_FIELDS = {"segment_name", "segment_id", "client_id", "base_address", "size_bytes",
                  "size_human", "te_endpoint", "protocol", "status", "allocator_used_bytes",
                  "allocator_capacity_bytes", "allocator_usage_percent"}
DESCRIPTOR_FIELDS = {"size_", "buffer_address_", "protocol_", "transport_endpoint_"}
NOT_FOUND = {"success": False, "error_code": -704, "error_message": "OBJECT_NOT_FOUND"}


def _get(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers), exc.read()


def _json(port: int, path: str, method: str = "GET") -> tuple[int, dict]:
    status, _, body = _get(port, path, method)
    return status, json.loads(body)


def test_keys_and_segments_answer_in_the_originals_shapes(admin_master):
    port = admin_master.metrics_port
    with StoreClient(admin_master.address, global_segment_size=8 << 20) as a, \
            StoreClient(admin_master.address, global_segment_size=8 << 20) as b:
        a.put("two", b"x" * 3000, ReplicateConfig(replica_num=2))
        a.put("gone", b"y" * 10)
        a.remove("gone")
        segments = {a.segment_name, b.segment_name}

        status, doc = _json(port, "/query_key?key=two")
        assert status == 200 and doc["success"] is True and len(doc["data"]) == 2, doc
        for d in doc["data"]:
            assert set(d) == DESCRIPTOR_FIELDS and d["size_"] == 3000 and d["protocol_"] == "tcp"
        assert {d["transport_endpoint_"] for d in doc["data"]} == segments
        assert _json(port, "/query_key?key=gone") == (404, NOT_FOUND)
        assert _json(port, "/query_key")[0] == 400

        status, doc = _json(port, "/batch_query_keys?keys=two,gone,never")
        assert status == 200 and doc["success"] is True
        assert doc["data"]["two"]["ok"] is True and len(doc["data"]["two"]["values"]) == 2
        assert "disk_values" not in doc["data"]["two"]
        for key in ("gone", "never"):
            assert doc["data"][key] == {"ok": False, "error": "OBJECT_NOT_FOUND"}
        assert _json(port, "/batch_query_keys") == (
            400, {"success": False, "error": "No keys provided. Use ?keys=key1,key2,..."})
        assert _json(port, "/batch_query_keys?keys=a%FFb")[0] == 400   # not UTF-8

        assert _get(port, "/get_all_keys")[2] == b"two\n"
        assert set(_get(port, "/get_all_segments")[2].decode().split()) == segments
        status, doc = _json(port, "/get_segments_detail")
        assert status == 200 and doc["total_segments"] == 2
        by_name = {s["segment_name"]: s for s in doc["segments"]}
        for name, seg in by_name.items():
            assert set(seg) == SEGMENT_FIELDS and seg["size_bytes"] == 8 << 20
            assert seg["base_address"].startswith("0x") and seg["status"] == "OK"
            assert seg["size_human"] == "0.0078125 GiB"
            # each segment holds one replica of "two" (its bytes rounded up to the allocator's
            # alignment); "gone" was freed
            assert 3000 <= seg["allocator_used_bytes"] < 8192, seg
            assert seg["allocator_usage_percent"] == pytest.approx(
                seg["allocator_used_bytes"] / (8 << 20) * 100)
        status, _, body = _get(port, f"/query_segment?segment={a.segment_name}")
        assert status == 200 and body.decode() == (
            f"{a.segment_name}\nUsed(bytes): {by_name[a.segment_name]['allocator_used_bytes']}"
            f"\nCapacity(bytes) : {8 << 20}\n")
        assert _get(port, "/query_segment?segment=nowhere")[0] == 500
        assert _get(port, "/query_segment")[0] == 400


def test_role_summary_events_and_remove_all(admin_master):
    port = admin_master.metrics_port
    assert _get(port, "/role")[2] == b"leader"
    assert _get(port, "/ha_status")[2] == b"serving"
    assert _json(port, "/leader") == (200, {"present": False})     # no HA: none published
    summary = _get(port, "/metrics/summary")[2].decode()
    assert summary.startswith("role=leader, state=serving, service_ready=true, master={objects=0 ")
    assert _json(port, "/kv_events/status") == (200, {
        "enabled": False, "published_batches": 0, "published_events": 0, "dropped_events": 0,
        "skipped_unparsed_keys": 0})
    with StoreClient(admin_master.address, global_segment_size=8 << 20) as a:
        for i in range(3):
            a.put(f"k{i}", b"v")
        assert _json(port, "/api/v1/remove_all", "GET")[0] == 405
        assert _json(port, "/api/v1/remove_all?tenant_id=other", "POST")[0] == 400
        assert _json(port, "/api/v1/remove_all?force=true", "POST") == (
            200, {"success": True, "removed_count": 3})
        assert _get(port, "/get_all_keys")[2] == b"" and not a.exists("k0")


def test_all_keys_stream_without_a_length(admin_master):
    """Thousands of keys come back complete, in chunks (no Content-Length: the server
    need not hold the whole answer)."""
    port = admin_master.metrics_port
    keys = [f"key-{i:05d}-{'p' * 40}" for i in range(3000)]
    with StoreClient(admin_master.address, global_segment_size=16 << 20) as a:
        assert a.batch_put(keys, [b"v"] * len(keys)) == [None] * len(keys)
        status, headers, body = _get(port, "/get_all_keys")
    assert status == 200 and "Content-Length" not in headers
    assert sorted(body.decode().splitlines()) == keys


@pytest.mark.etcd
def test_a_candidate_says_standby_and_names_the_leader(etcd_server):
    endpoints = etcd_server.split("://", 1)[1]

    def ha() -> MasterServer:
        from helpers import free_port

        return MasterServer(MasterConfig(), ServerOptions(
            rpc_port=free_port(), metrics_port=0, enable_ha=True, etcd_endpoints=endpoints,
            cluster_id="admin-api-ha"))

    first, second = ha(), ha()
    stop = threading.Event()
    running = [first, second]
    try:
        assert first.start()
        runner = threading.Thread(target=second.start, kwargs={"stop": stop}, daemon=True)
        runner.start()
        port = wait_until(lambda: second.metrics_port, 10) and second.metrics_port
        assert wait_until(lambda: _get(port, "/ha_status")[2] == b"candidate", 10)
        assert _get(port, "/role")[2] == b"standby"
        status, doc = _json(port, "/query_key?key=k")
        assert status == 503 and doc == {"success": False, "error_code": -1011,
                                         "error_message": "service plane is not active"}
        status, leader = _json(port, "/leader")
        assert status == 200 and leader["present"] and leader["leader_address"] == first.address
        running.remove(first)
        first.close()   # resigns: the candidate wins
        assert wait_until(lambda: _get(port, "/role")[2] == b"leader", 20)
        status, now = _json(port, "/leader")
        assert now["leader_address"] == second.address
        assert now["view_version"] > leader["view_version"]
        assert _json(port, "/query_key?key=k") == (404, NOT_FOUND)
        runner.join(10)
    finally:
        stop.set()
        for server in running:
            server.close()


@pytest.mark.parametrize("query", ["", "?key=", "?key=%00", "?keys=,,,", "?keys=%zz",
                                   "?segment=%FF%FE", "?key=a&key=b", "?force=maybe",
                                   "?" + "x" * 5000, "?keys=" + ",".join(["k"] * 10_001)])
def test_malformed_queries_get_a_reason_and_the_server_goes_on(admin_master, query):
    port = admin_master.metrics_port
    for path in ("/query_key", "/batch_query_keys", "/query_segment", "/get_all_keys",
                 "/get_segments_detail", "/role", "/leader", "/kv_events/status"):
        status, _, body = _get(port, path + query)
        assert status in (200, 400, 404, 500), (path, query, status)
        if status == 400:
            assert b"error" in body, (path, query, body)
        if status == 500:
            assert path == "/query_segment" and body.startswith(b"Failed to query segment")
    assert _get(port, "/health")[2] == b"OK"
    assert _get(port, "/batch_query_keys?keys=" + ",".join(["k"] * 10_001))[0] == 400
