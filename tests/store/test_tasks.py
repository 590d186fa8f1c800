"""Copy/move tasks and replica clearing against an in-process master and real clients."""

import os

import pytest
from helpers import wait_until

from mooncake_plugins.errors import (InvalidParams, ObjectNotFound, TaskNotFound,
                                     UnavailableInCurrentStatus)
from mooncake_plugins.store import tasks
from mooncake_plugins.store.client import ReplicateConfig, StoreClient


@pytest.fixture
def trio(master):
    cs = [StoreClient(master.address, global_segment_size=8 << 20) for _ in range(3)]
    yield cs
    for c in cs:
        c.close()


def _segments(client, key):
    _, memory, _ = client.replicas([key])[0]
    return sorted(s[0] for r in memory for s in r)


def _finish(client, task_id):
    wait_until(lambda: client.query_task(task_id)["status"] in (tasks.SUCCESS, tasks.FAILED),
               timeout_s=20)
    return client.query_task(task_id)


def test_copy_adds_replicas_with_the_same_bytes(trio):
    a, b, c = trio
    data = os.urandom(3 << 20)
    a.put("k", data, ReplicateConfig(preferred_segments=[a.segment_name]))
    assert _segments(a, "k") == [a.segment_name]
    tid = a.create_copy_task("k", [b.segment_name, c.segment_name])
    assert len(tid) == 2 and all(isinstance(x, int) for x in tid)
    info = _finish(a, tid)
    assert info["status"] == tasks.SUCCESS, info
    assert info["type"] == tasks.COPY and info["client_id"] == a.client_id
    assert _segments(a, "k") == sorted([a.segment_name, b.segment_name, c.segment_name])
    # the copies hold the bytes: without the source segment, and then with one copy left
    a.close()
    assert _segments(b, "k") == sorted([b.segment_name, c.segment_name])
    assert b.get("k") == data
    c.close()
    assert b.get("k") == data


def test_copy_to_a_segment_that_has_one_adds_nothing(trio):
    a, b, _ = trio
    a.put("k", b"x" * 5000, ReplicateConfig(replica_num=2,
                                            preferred_segments=[a.segment_name, b.segment_name]))
    info = _finish(a, a.create_copy_task("k", [b.segment_name]))
    assert info["status"] == tasks.SUCCESS
    assert _segments(a, "k") == sorted([a.segment_name, b.segment_name])


def test_move_leaves_only_the_target(trio):
    a, b, c = trio
    data = os.urandom(100_000)
    c.put("m", data, ReplicateConfig(preferred_segments=[a.segment_name]))
    info = _finish(c, c.create_move_task("m", a.segment_name, b.segment_name))
    assert info["status"] == tasks.SUCCESS, info
    assert _segments(c, "m") == [b.segment_name]
    assert c.get("m") == data
    st = c.stats()
    assert st["used_bytes"] < 2 * 100_000 + 8192   # the source's space was freed


def test_bad_tasks_are_refused(trio):
    a, b, _ = trio
    a.put("k", b"v" * 100, ReplicateConfig(preferred_segments=[a.segment_name]))
    with pytest.raises(ObjectNotFound):
        a.create_copy_task("missing", [b.segment_name])
    with pytest.raises(ObjectNotFound):
        a.create_move_task("missing", a.segment_name, b.segment_name)
    with pytest.raises(InvalidParams):
        a.create_copy_task("k", ["nowhere:1"])
    with pytest.raises(InvalidParams):
        a.create_copy_task("k", [])
    with pytest.raises(InvalidParams):
        a.create_move_task("k", a.segment_name, a.segment_name)
    with pytest.raises(InvalidParams):
        a.create_move_task("k", b.segment_name, a.segment_name)   # no replica on b
    with pytest.raises(TaskNotFound):
        a.query_task((1, 2))


def test_draining_target_is_refused(master, trio):
    a, b, _ = trio
    a.put("k", b"v" * 100, ReplicateConfig(preferred_segments=[a.segment_name]))
    master.service.set_draining([b.segment_name], True)
    with pytest.raises(UnavailableInCurrentStatus):
        a.create_copy_task("k", [b.segment_name])


def test_removed_object_fails_its_task(master, trio):
    a, b, _ = trio
    a.put("k", b"v" * 100, ReplicateConfig(preferred_segments=[a.segment_name]))
    tid = master.service.create_copy_task("k", [b.segment_name])
    a.remove("k")
    info = _finish(a, tid)
    assert info["status"] == tasks.FAILED and "ObjectNotFound" in info["message"]
    assert master.service.stats()["used_bytes"] == 0


def test_batch_replica_clear(trio):
    a, b, _ = trio
    a.put("two", b"2" * 4096, ReplicateConfig(replica_num=2,
                                              preferred_segments=[a.segment_name, b.segment_name]))
    a.put("one", b"1" * 4096)
    b.put("theirs", b"3" * 4096)
    assert b.batch_replica_clear(["two", "one"]) == []            # not b's objects
    assert a.batch_replica_clear(["two"], b.segment_name) == ["two"]
    assert _segments(a, "two") == [a.segment_name]
    a.get("one")                                                  # a read lease: kept
    assert a.batch_replica_clear(["one", "theirs", "missing"]) == []
    wait_until(lambda: a.batch_replica_clear(["one"]) == ["one"], timeout_s=5)
    assert not a.exists("one") and a.exists("two") and b.exists("theirs")


@pytest.fixture
def admin_master():
    from mooncake_plugins.store.master import MasterConfig
    from mooncake_plugins.store.server import MasterServer, ServerOptions

    server = MasterServer(MasterConfig(default_kv_lease_ttl_ms=200),
                          ServerOptions(rpc_port=0, metrics_port=0))
    server.start()
    yield server
    server.close()


def _http(port, path, body=None):
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST" if body else "GET",
                                 data=json.dumps(body).encode() if body else None)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read()) if path != "/health" else r.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


def test_drain_moves_everything_off_a_segment_over_http(admin_master):
    port = admin_master.metrics_port
    assert _http(port, "/health") == (200, b"OK")
    with StoreClient(admin_master.address, global_segment_size=8 << 20) as a, \
            StoreClient(admin_master.address, global_segment_size=8 << 20) as b:
        data = {f"d{i}": os.urandom(50_000) for i in range(6)}
        for k, v in data.items():
            a.put(k, v, ReplicateConfig(preferred_segments=[a.segment_name]))
        status, job = _http(port, "/api/v1/drain_jobs", {"segments": [a.segment_name],
                                                         "target_segments": [b.segment_name],
                                                         "max_concurrency": 2})
        assert status == 200 and job["success"], job
        seg = f"/api/v1/segments/status?segment={a.segment_name}"
        assert _http(port, seg)[1]["status_name"] in ("DRAINING", "DRAINED")
        a.put("late", b"x" * 1000, ReplicateConfig(preferred_segments=[a.segment_name]))
        assert _segments(a, "late") == [b.segment_name]          # no new data on a draining segment
        query = f"/api/v1/drain_jobs/query?job_id={job['job_id']}"
        wait_until(lambda: _http(port, query)[1]["status_name"] == "SUCCEEDED", timeout_s=30)
        final = _http(port, query)[1]
        assert final["succeeded_units"] == 6 and final["active_units"] == 0
        assert _http(port, seg)[1]["status_name"] == "DRAINED"
        for k, v in data.items():
            assert _segments(b, k) == [b.segment_name] and b.get(k) == v
    # bad requests
    assert _http(port, "/api/v1/drain_jobs", {"segments": ["nowhere"]})[1]["error_code"] == -101
    assert _http(port, "/api/v1/drain_jobs", {"segments": "x"})[0] == 400
    assert _http(port, "/api/v1/drain_jobs/query?job_id=nope") == (
        404, {"success": False, "error_code": -1402, "error_message": "no drain job 'nope'"})
    assert _http(port, "/api/v1/segments/status")[0] == 400
