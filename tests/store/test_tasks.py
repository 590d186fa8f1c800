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


# -- the master's copy bookkeeping, with a fake clock -----------------------------------
class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


MiB = 1 << 20


def _service(clock, **cfg):
    from mooncake_plugins.store.master import MasterConfig, MasterService

    m = MasterService(MasterConfig(client_ttl_s=1000, **cfg), clock=clock)
    for i in range(2):
        m.register_client(f"c{i}", f"host{i}")
        m.mount_segment(f"c{i}", f"seg{i}", (i + 1) << 32, 8 * MiB)
    return m


def _put(m, key, nbytes, segment, client="c0"):
    from mooncake_plugins.store.master import PutConfig

    replicas = m.put_start(client, key, nbytes, PutConfig(preferred_segments=[segment]))
    m.put_end(client, key)
    return replicas


def _used(m, segment):
    return m._segments[segment].allocator.used


def test_move_keeps_the_source_while_a_reader_holds_a_lease():
    from mooncake_plugins.errors import ObjectHasLease
    from mooncake_plugins.store.master import PutConfig

    clock = _Clock()
    m = _service(clock)
    [[source]] = _put(m, "k", MiB, "seg0")
    m.get("k")                                             # a reader's lease: 5 s
    m.replica_start("c0", "k", "seg0", ["seg1"], move=True)
    clock.t += 0.1
    m.replica_end("c0", "k", ok=True)
    assert [s[0] for r in m.get("k")[1] for s in r] == ["seg1"]
    [[other]] = m.put_start("c0", "other", MiB, PutConfig(preferred_segments=["seg0"]))
    assert other[1] != source[1]                           # the reader's bytes are not reused
    clock.t += 5.5
    m.reap()
    assert _used(m, "seg0") == MiB                         # freed once the lease ended
    # a failed copy keeps the reader's lease too
    _put(m, "j", MiB, "seg0")
    m.replica_start("c0", "j", "seg0", ["seg1"], move=False)
    m.get("j")
    m.replica_end("c0", "j", ok=False)
    with pytest.raises(ObjectHasLease):
        m.remove("j")


def test_a_copy_that_never_ends_is_cancelled_at_its_deadline():
    from mooncake_plugins.errors import ObjectAlreadyExists

    clock = _Clock()
    m = _service(clock, put_start_discard_timeout_s=30, task_processing_timeout_s=0)
    _put(m, "k", MiB, "seg0")
    m.replica_start("c0", "k", "seg0", ["seg1"], move=False)
    with pytest.raises(ObjectAlreadyExists):
        m.replica_start("c1", "k", "seg0", ["seg1"], move=False)
    clock.t += 31
    m.reap()
    assert _used(m, "seg1") == 0                           # its reserved space is back
    with pytest.raises(ObjectNotFound):
        m.replica_end("c0", "k", ok=True)
    m.replica_start("c1", "k", "seg0", ["seg1"], move=False)   # the key is free again
    m.replica_end("c1", "k", ok=True)
    assert sorted(s[0] for r in m.get("k")[1] for s in r) == ["seg0", "seg1"]


def test_a_failed_or_expired_task_cancels_its_copy():
    clock = _Clock()
    m = _service(clock, put_start_discard_timeout_s=300, task_processing_timeout_s=10)
    _put(m, "k", MiB, "seg0")
    _put(m, "j", MiB, "seg0")
    expired = m.create_copy_task("k", ["seg1"])
    failed = m.create_copy_task("j", ["seg1"])
    assert len(m.tasks.take("c0")) == 2
    m.replica_start("c0", "k", "seg0", ["seg1"], move=False)
    m.replica_start("c0", "j", "seg0", ["seg1"], move=False)
    m.complete_task("c0", failed, ok=False, message="replica_end was lost")
    clock.t += 11
    m.reap()
    assert m.tasks.status(expired) == tasks.FAILED
    for key in ("k", "j"):                                 # neither key stays blocked
        m.replica_start("c1", key, "seg0", ["seg1"], move=False)
        m.replica_end("c1", key, ok=False)


def test_a_cancelled_copy_keeps_its_new_space_until_its_end():
    from mooncake_plugins.store.master import PutConfig

    clock = _Clock()
    m = _service(clock)
    _put(m, "k", MiB, "seg0")
    _, _, [[target]] = m.replica_start("c0", "k", "seg0", ["seg1"], move=False)
    m.remove("k", force=True)                              # cancels the copy; its writer runs on
    [[other]] = m.put_start("c1", "other", MiB, PutConfig(preferred_segments=["seg1"]))
    assert other[1] != target[1]
    with pytest.raises(ObjectNotFound):
        m.replica_end("c0", "k", ok=True)
    assert _used(m, "seg1") == MiB                         # only "other" is left there
    # an object replaced meanwhile: the cancelled copy publishes nothing
    _put(m, "u", MiB, "seg0")
    m.replica_start("c0", "u", "seg0", ["seg1"], move=True)
    new = m.put_start("c0", "u", MiB, PutConfig(upsert=True, preferred_segments=["seg0"]))
    m.put_end("c0", "u")
    with pytest.raises(ObjectNotFound):
        m.replica_end("c0", "u", ok=True)
    assert m.get("u")[1] == new


def test_finished_drain_jobs_are_forgotten_beyond_a_bound():
    from mooncake_plugins.errors import JobNotFound

    clock = _Clock()
    m = _service(clock)
    m.max_finished_drains = 3
    ids = []
    for _ in range(5):
        ids.append(m.create_drain_job(["seg0"], [], 1))
        assert m.query_drain_job(ids[-1])["status_name"] == "SUCCEEDED"
        m.set_draining(["seg0"], False)
    assert len(m._drains) == 3
    with pytest.raises(JobNotFound):
        m.query_drain_job(ids[0])
    assert m.query_drain_job(ids[-1])["status_name"] == "SUCCEEDED"


def test_a_full_task_queue_delays_a_drain_instead_of_failing_it():
    clock = _Clock()
    m = _service(clock, max_pending_tasks=1)
    _put(m, "k", MiB, "seg0")
    _put(m, "j", MiB, "seg1")
    m.create_copy_task("j", ["seg0"])                      # the queue is full
    job = m.create_drain_job(["seg0"], ["seg1"], 1)
    m.reap()
    assert m.query_drain_job(job)["active_units"] == 0
    m.tasks.take("c1")                                     # room again
    m.advance_drains()
    assert m.query_drain_job(job)["active_units"] == 1


def test_run_task_reports_any_exception_as_a_failure():
    calls = []

    class Client:
        client_id = "c"

        def copy_replicas(self, *args, **kwargs):
            raise MemoryError("no room for the copy buffer")

        def call_master(self, method, **args):
            calls.append((method, args))

    tasks.run_task(Client(), {"id": [1, 2], "key": "k", "source": "a", "targets": ["b"],
                              "type": tasks.MOVE})
    [(method, args)] = calls
    assert method == "complete_task" and args["ok"] is False
    assert "MemoryError" in args["message"]


def test_replica_end_is_retried_after_a_lost_reply(trio):
    from mooncake_plugins.errors import RpcFailed

    a, b, _ = trio
    a.put("k", b"r" * 10_000, ReplicateConfig(preferred_segments=[a.segment_name]))
    real, failures = a._call, []

    def flaky(method, **args):
        if method == "replica_end" and not failures:
            failures.append(method)
            raise RpcFailed("connection reset")
        return real(method, **args)

    a._call = flaky
    a.copy_replicas("k", a.segment_name, [b.segment_name])
    assert failures and _segments(a, "k") == sorted([a.segment_name, b.segment_name])


def test_no_task_runner_starts_after_close(master):
    c = StoreClient(master.address, global_segment_size=0)
    c.close()
    c._start_tasks([{"id": [1, 2], "key": "k", "source": "a", "targets": ["b"],
                     "type": tasks.COPY}])
    assert c._task_runner is None


def test_query_task_reports_a_client_id_that_is_not_hex(master):
    from mooncake.store import MooncakeDistributedStore
    from mooncake_plugins.compat.store_tasks import QueryTaskResponse

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 1 << 20, "tcp", "", master.address) == 0
    try:
        named = master.service.tasks.submit(tasks.COPY, "k", "a", ["b"], "worker-a")  # ids are the clients'
        got, code = store.query_task(named)
        assert code == 0 and got.id == tuple(named)
        assert got.assigned_client == QueryTaskResponse({"client_id": "worker-a"}).assigned_client
        assert got.assigned_client != QueryTaskResponse({"client_id": "worker-b"}).assigned_client
        assert all(0 <= half < 1 << 64 for half in got.assigned_client)
        for odd in ("0x12", " 12", "1_2", "f" * 33):  # hex that int() bends, or too long for a uuid
            assert all(0 <= half < 1 << 64 for half in QueryTaskResponse({"client_id": odd}).assigned_client)
        uuid_id = "0123456789abcdef" * 2
        assert QueryTaskResponse({"client_id": uuid_id}).assigned_client == (0x0123456789ABCDEF,) * 2
    finally:
        store.close()


def test_deeply_nested_drain_body_is_a_bad_request(admin_master, caplog):
    import urllib.error
    import urllib.request

    nested = b"[" * 100_000 + b"]" * 100_000
    req = urllib.request.Request(f"http://127.0.0.1:{admin_master.metrics_port}/api/v1/drain_jobs",
                                 method="POST", data=nested)
    with caplog.at_level("WARNING", logger="mooncake_plugins.store.admin"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=5)
    with err.value as reply:
        assert reply.code == 400 and b'"error_code": -600' in reply.read()
    assert any("refused" in r.getMessage() for r in caplog.records)


def test_a_client_that_closes_fails_its_tasks_cancels_its_copies_and_unmounts():
    """unregister_client (a client's close): what a client death does, at once."""
    clock = _Clock()
    m = _service(clock, put_start_discard_timeout_s=300, task_processing_timeout_s=60)
    m.register_client("c2", "host2")
    m.mount_segment("c2", "seg2", 3 << 32, 8 * MiB)
    _put(m, "on-seg1", MiB, "seg1", client="c1")
    _put(m, "k", MiB, "seg0")
    task = m.create_copy_task("k", ["seg2"])
    assert len(m.tasks.take("c0")) == 1
    m.replica_start("c1", "k", "seg0", ["seg2"], move=False)   # c1 copies k to seg2
    m.unregister_client("c1")
    assert "seg1" not in m._segments and not m.exist("on-seg1")
    assert "k" not in m._copies and m.get("k")[0] == MiB     # cancelled; k keeps its replica
    assert m.stats()["clients"] == 2 and m.stats()["expired_clients"] == 0
    m.unregister_client("c0")
    assert m.tasks.status(task) == tasks.FAILED and not m.exist("k")
    clock.t += 301                                  # the cancelled copy's space comes back
    m.heartbeat("c2")
    m.reap()
    assert _used(m, "seg2") == 0
    m.unregister_client("c1")                       # twice, or after expiry: no error
