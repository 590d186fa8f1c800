"""The master's metadata survives it: kill -9 of an HA leader, kill -9 and restart of a single
master, and a writer that crashed mid-put (its key and space come back)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Iterator

import pytest
from durability_load import Load, value
from helpers import free_port, spawn_ready, terminate_group, wait_until

from mooncake_plugins.errors import MooncakeError
from mooncake_plugins.store.client import StoreClient
from mooncake_plugins.store.journal import FileJournal, Journal
from mooncake_plugins.store.master import MasterConfig, MasterService, PutConfig
from mooncake_plugins.store.server import MasterServer, ServerOptions

# This module checks the master's journal, restarts and HA failover. CI's
# MOONCAKE_PUREPYTHON=1 pass leaves it out (-m 'not control_plane'): the Python fallbacks
# would carry only its RPC frames, which that pass's data-path modules and
# tests/security/test_master_rpc.py cover.
pytestmark = pytest.mark.control_plane

MASTER = [sys.executable, "-m", "mooncake_plugins.cli.master"]
ROUNDS = 5
RECOVERY_TIMEOUT_S = 40.0
_RECOVERED = re.compile(r"recovered (\d+) objects on \d+ segments from the metadata journal in ([\d.]+) s")


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _recovery_line(stderr) -> tuple[int, float]:
    stderr.seek(0)
    found = _RECOVERED.findall(stderr.read().decode("utf-8", "replace"))
    assert found, "the master did not report a recovery"
    return int(found[-1][0]), float(found[-1][1])


def _await_recovery(load: Load, killed_at: float) -> float:
    assert wait_until(lambda: load.serving_since(killed_at), RECOVERY_TIMEOUT_S, 0.05), \
        "puts and gets did not succeed again after the master was killed"
    return time.monotonic() - killed_at


class Candidate:
    """An HA master process; it prints READY once it leads."""

    def __init__(self, endpoints: str, cluster: str, port: int = 0) -> None:
        self.port = port or free_port()
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            MASTER + ["--rpc_port", str(self.port), "--metrics_port", "0", "--enable_ha",
                      "--etcd_endpoints", endpoints, "--cluster_id", cluster],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.stderr,
            start_new_session=True)

    def wait_leading(self, timeout_s: float) -> None:
        fd = self.proc.stdout.fileno()
        line = self.proc.stdout.readline() if select.select([fd], [], [], timeout_s)[0] else b""
        if not line.startswith(b"READY "):
            self.stderr.seek(0)
            raise AssertionError(f"no READY ({line!r}): {self.stderr.read()[-3000:].decode()}")

    def close(self) -> None:
        terminate_group(self.proc)
        self.stderr.close()


def _elected(waiting: list[Candidate], timeout_s: float) -> Candidate:
    """The one of ``waiting`` that wins the election."""
    ready = select.select([c.proc.stdout for c in waiting], [], [], timeout_s)[0]
    assert ready, "no candidate was elected in time"
    winner = next(c for c in waiting if c.proc.stdout is ready[0])
    winner.wait_leading(1)
    return winner


@pytest.fixture
def candidates(etcd_server: str) -> Iterator:
    endpoints = etcd_server.split("://", 1)[1]
    cluster = f"durable-{uuid.uuid4().hex[:8]}"
    started: list[Candidate] = []

    def start(port: int = 0) -> Candidate:
        started.append(Candidate(endpoints, cluster, port))
        return started[-1]

    start.endpoints, start.cluster = endpoints, cluster  # type: ignore[attr-defined]
    yield start
    for c in started:
        c.close()


def _ha_store(candidates, nodes) -> StoreClient:
    """Two holder processes and a client following the candidates' leader through etcd."""
    master = f"etcd://{candidates.endpoints}"
    for _ in range(2):
        nodes(master, "--cluster_id", candidates.cluster, "--segment", str(64 << 20))
    return StoreClient(master, cluster_id=candidates.cluster, global_segment_size=0,
                       rpc_timeout_s=5, failover_timeout_s=RECOVERY_TIMEOUT_S)


@pytest.mark.etcd
@pytest.mark.slow
def test_leader_kill_under_load_loses_no_acknowledged_object(candidates, nodes) -> None:
    leader = candidates()
    leader.wait_leading(30)
    waiting = [candidates()]
    client = _ha_store(candidates, nodes)
    report = []
    try:
        with Load(client) as load:
            for _ in range(ROUNDS):
                before = len(load.acked)
                assert wait_until(lambda: len(load.acked) >= before + 100, 20)
                killed_at = time.monotonic()
                _kill(leader.proc)
                waiting.append(candidates())
                leader = _elected(waiting, RECOVERY_TIMEOUT_S)
                waiting.remove(leader)
                recovery_s = _await_recovery(load, killed_at)
                n = load.check()
                objects, load_s = _recovery_line(leader.stderr)
                assert objects >= n - len(load.unacked) - 200  # those acked since it started
                report.append((round(recovery_s, 2), n, objects, load_s))
            assert load.check() > ROUNDS * 100
    finally:
        client.close()
    print(f"\nHA failover (recovery s, objects acknowledged, recovered, load s): {report}")


@pytest.mark.etcd
@pytest.mark.slow
def test_leader_restarted_on_its_own_address_loses_nothing(candidates, nodes) -> None:
    """kill -9 of the leader, restarted with the same command (same port) as under systemd or
    Kubernetes: it wins the next term at the address of the last one. Clients and holders
    must follow the new term there, and the holders' segments outlive the recovery."""
    port = free_port()
    leader = candidates(port)
    leader.wait_leading(30)
    client = _ha_store(candidates, nodes)
    report = []
    try:
        with Load(client) as load:
            for _ in range(3):
                before = len(load.acked)
                assert wait_until(lambda: len(load.acked) >= before + 100, 20)
                killed_at = time.monotonic()
                _kill(leader.proc)
                leader = candidates(port)
                leader.wait_leading(RECOVERY_TIMEOUT_S)
                recovery_s = _await_recovery(load, killed_at)
                report.append((round(recovery_s, 2), load.check()))
                # the holders came back to the new term (none was dropped as silent)
                leader.stderr.seek(0)
                assert b"missed heartbeats" not in leader.stderr.read()
            assert load.check() > 300
    finally:
        client.close()
    print(f"\nleader restarted on its address (recovery s, objects acknowledged): {report}")


def _journaled_master(tmp_path, nodes,
                      segment: int) -> tuple[list[str], subprocess.Popen, StoreClient]:
    """A master with ``--metadata_dir`` (its command, to restart it, and its process), two
    holders lending ``segment`` bytes each, and a client of it."""
    port = free_port()
    cmd = MASTER + ["--rpc_port", str(port), "--metrics_port", "0",
                    "--metadata_dir", str(tmp_path / "meta")]
    proc, _ = spawn_ready(cmd, timeout_s=30)
    address = f"127.0.0.1:{port}"
    for _ in range(2):
        nodes(address, "--segment", str(segment))
    return cmd, proc, StoreClient(address, global_segment_size=0, rpc_timeout_s=5)


@pytest.mark.slow
def test_master_restart_under_load_loses_no_acknowledged_object(tmp_path, nodes) -> None:
    cmd, proc, client = _journaled_master(tmp_path, nodes, 64 << 20)
    report = []
    try:
        with Load(client) as load:
            for _ in range(ROUNDS):
                before = len(load.acked)
                assert wait_until(lambda: len(load.acked) >= before + 100, 20)
                killed_at = time.monotonic()
                _kill(proc)
                proc, _ = spawn_ready(cmd, timeout_s=30)
                recovery_s = _await_recovery(load, killed_at)
                report.append((round(recovery_s, 2), load.check()))
    finally:
        client.close()
        terminate_group(proc)
    print(f"\nmaster restart (recovery s, objects acknowledged): {report}")


def _put_once_get_works(client: StoreClient, old: int, new: int) -> None:
    """Get ``obj-<old>`` until that succeeds, then put ``obj-<new>`` at once: that put must
    succeed too (issue 44)."""
    started = time.monotonic()
    while True:
        try:
            data = client.get(f"obj-{old}")
            break
        except MooncakeError:
            assert time.monotonic() - started < RECOVERY_TIMEOUT_S, f"obj-{old} unreadable"
            time.sleep(0.02)
    assert data == value(old)
    client.put(f"obj-{new}", value(new))


@pytest.mark.etcd
def test_a_new_leader_takes_puts_as_soon_as_gets(candidates, nodes) -> None:
    """Three masters; kill -9 of the leader, its command restarted (same port): the new
    leader places data on the segments it recovered from the journal at once, not only once
    their holders are back (they may still be waiting on the restarted candidate)."""
    leader = candidates()
    leader.wait_leading(30)
    waiting = [candidates() for _ in range(2)]
    client = _ha_store(candidates, nodes)
    try:
        client.put("obj-0", value(0))
        for i in range(1, 4):
            _kill(leader.proc)
            waiting.append(candidates(leader.port))
            _put_once_get_works(client, i - 1, i)
            leader = _elected(waiting, RECOVERY_TIMEOUT_S)
            waiting.remove(leader)
        assert [client.get(f"obj-{i}") for i in range(4)] == [value(i) for i in range(4)]
    finally:
        client.close()


def test_a_restarted_master_takes_puts_as_soon_as_gets(tmp_path, nodes) -> None:
    """kill -9 and restart of a single master with --metadata_dir: the holders' segments it
    recovered take new data before their holders' next heartbeat."""
    cmd, proc, client = _journaled_master(tmp_path, nodes, 16 << 20)
    try:
        client.put("obj-0", value(0))
        for i in range(1, 6):
            _kill(proc)
            proc, _ = spawn_ready(cmd, timeout_s=30)
            _put_once_get_works(client, i - 1, i)
        assert [client.get(f"obj-{i}") for i in range(6)] == [value(i) for i in range(6)]
    finally:
        client.close()
        terminate_group(proc)


def test_cli_keeps_the_journal_flags_apart() -> None:
    res = subprocess.run(MASTER + ["--enable_ha", "--etcd_endpoints", "127.0.0.1:1",
                                   "--metadata_dir", "/tmp/x"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "--metadata_dir is for a single master" in res.stderr


def test_crashed_writer_key_is_released_and_its_space_reused(master_process, nodes) -> None:
    _, address = master_process("--put_start_discard_timeout_sec", "3", "--client_ttl", "1")
    holder = nodes(address, "--segment", str(8 << 20))
    writer = nodes(address, "--segment", "0")
    assert writer.ask(f"begin k {4 << 20}") == "ok"
    begun = time.monotonic()
    assert json.loads(holder.ask("stats"))["used_bytes"] == 4 << 20
    _kill(writer.proc)
    # in flight: refused until the put is discarded, then the key and its space are free
    first = holder.ask("put k 7 1024")
    assert first == "ok" or first.startswith("error ObjectAlreadyExists")
    if first == "ok":
        assert time.monotonic() - begun >= 3
    assert wait_until(lambda: holder.ask("put k 7 1024") == "ok" or holder.ask("exists k") == "1",
                      15, 0.2)
    stats = json.loads(holder.ask("stats"))
    assert stats["used_bytes"] == 1024 and stats["clients"] == 1  # the writer expired too
    assert holder.ask(f"put big 8 {6 << 20}") == "ok"               # the 4 MiB came back


# -- in-process: the journal and the index rebuilt from it -----------------------------------

def _service(directory: str) -> tuple[MasterService, Journal]:
    journal = Journal(FileJournal(directory))
    state = journal.backend.load()
    service = MasterService(MasterConfig(client_ttl_s=5))
    service.attach_journal(journal)
    service.restore(state)
    journal.start()
    return service, journal


def test_restored_index_keeps_objects_and_their_space(tmp_path) -> None:
    s, journal = _service(str(tmp_path))
    s.register_client("c", "h")
    s.mount_segment("c", "seg", 1 << 20, 1 << 20)
    placed = {}
    for i in range(20):
        placed[f"k{i}"] = s.put_start("c", f"k{i}", 10_000 + i, PutConfig())
        s.put_end("c", f"k{i}")
    s.put_start("c", "pending", 5000, PutConfig())
    s.remove("k3")
    journal.wait(journal.seq)
    journal.close()

    s2, journal2 = _service(str(tmp_path))
    try:
        assert s2.stats()["objects"] == 19 and not s2.exist("k3") and not s2.exist("pending")
        assert s2.get("k7")[1] == placed["k7"]
        s2.register_client("w", "h")
        kept = [shard for key, r in placed.items() if key != "k3" for shard in r[0]]
        # at once, before the segment's owner is back (issue 44): in the space of k3 and
        # after the objects, never theirs
        for i in range(8):
            _, a, n = s2.put_start("w", f"x{i}", 9000, PutConfig())[0][0]
            assert all(a + n <= ka or ka + kn <= a for _, ka, kn in kept)
    finally:
        journal2.close()


def test_restored_segment_owners_get_three_ttls_to_come_back(tmp_path) -> None:
    """A new leader's clients are still finding it: segments restored from the journal are
    kept for three client TTLs (not one) unless their owner heartbeats or registers, and
    meanwhile take new data after those whose owner is back (unless a put names them)."""
    s, journal = _service(str(tmp_path))   # client TTL 5 s
    for owner in ("back", "gone"):
        s.register_client(owner, "h")
        s.mount_segment(owner, f"seg-{owner}", 1 << 20, 1 << 20)
        s.put_start(owner, f"obj-{owner}", 1000, PutConfig(preferred_segments=[f"seg-{owner}"]))
        s.put_end(owner, f"obj-{owner}")
    journal.wait(journal.seq)
    journal.close()

    now = [1000.0]
    journal2 = Journal(FileJournal(str(tmp_path)))
    s2 = MasterService(MasterConfig(client_ttl_s=5), clock=lambda: now[0])
    try:
        s2.restore(journal2.backend.load())
        now[0] += 6       # one TTL after the recovery: nobody is dropped yet
        s2.reap()
        assert s2.exist("obj-back") and s2.exist("obj-gone")
        s2.heartbeat("back")
        placed = [s2.put_start("back", f"x{i}", 1000, PutConfig())[0][0][0] for i in range(8)]
        assert set(placed) == {"seg-back"}
        named = PutConfig(preferred_segments=["seg-gone"])
        assert s2.put_start("back", "named", 1000, named)[0][0][0] == "seg-gone"
        now[0] += 4
        s2.heartbeat("back")
        now[0] += 4       # 14 s: "gone" is still within its 15 s
        s2.reap()
        assert s2.exist("obj-gone") and s2.stats()["segments"] == 2
        s2.heartbeat("back")
        now[0] += 2       # 16 s: "gone" never came back; "back" beats like any client
        s2.reap()
        assert s2.exist("obj-back") and not s2.exist("obj-gone")
        assert s2.stats()["segments"] == 1 and s2.counters["expired_clients"] == 1
        now[0] += 6       # a confirmed owner has one TTL, as always
        s2.reap()
        assert not s2.exist("obj-back") and s2.stats()["segments"] == 0
    finally:
        journal2.close()


def test_file_journal_drops_a_torn_tail_and_compacts(tmp_path) -> None:
    backend = FileJournal(str(tmp_path))
    backend.load()
    backend.write({("o", "a"): [1], ("o", "b"): [2]})
    backend.write({("o", "a"): None, ("s", "seg"): ["c", "h", 0, 4096]})
    backend.close()
    with open(tmp_path / "journal.log", "ab") as f:
        f.write(b"\x10\x00\x00\x00garbage")   # a batch cut short by a crash
    backend = FileJournal(str(tmp_path))
    try:
        assert backend.load() == {("o", "b"): [2], ("s", "seg"): ["c", "h", 0, 4096]}
        with pytest.raises(Exception, match="another master"):
            FileJournal(str(tmp_path))
    finally:
        backend.close()


def test_restarted_master_serves_the_same_objects(tmp_path) -> None:
    options = ServerOptions(rpc_port=free_port(), metadata_dir=str(tmp_path))
    server = MasterServer(MasterConfig(), options)
    server.start()
    try:
        with StoreClient(server.address, global_segment_size=4 << 20) as client:
            client.put("kept", b"bytes of kept")
            server.close()
            server = MasterServer(MasterConfig(), options)
            server.start()
            assert client.get("kept") == b"bytes of kept"   # re-registers on its own
            client.put("after", b"2")
            assert server.service.stats()["objects"] == 2
    finally:
        server.close()
