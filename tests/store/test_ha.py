"""Leader election and leader discovery for the store master, against a real etcd."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import etcd3gw
import pytest
import requests
from helpers import etcd_healthy, free_port, spawn_ready, terminate_group, wait_until

from mooncake_plugins.errors import InvalidArgument, MetadataError
from mooncake_plugins.store.ha import (
    Leader,
    LeaderElection,
    LeaderWaitTimeout,
    current_leader,
    find_leader,
    leader_key,
    parse_etcd_endpoints,
    wait_for_leader,
)

# This module checks leader election through etcd. CI's MOONCAKE_PUREPYTHON=1 pass leaves it
# out (-m 'not control_plane'): the Python fallbacks would carry only its RPC frames, which
# that pass's data-path modules and tests/security/test_master_rpc.py cover.
pytestmark = [pytest.mark.control_plane, pytest.mark.exclusive]

CANDIDATE = str(Path(__file__).with_name("ha_candidate.py"))
# A leader steps down after 2/3 of this without a lease refresh: 2 s, so a loaded machine's
# scheduling stalls do not demote the test's leaders.
TTL_S = 3.0
# etcd rounds a lease up to whole seconds and to its minimum TTL (2 s with default timings),
# and checks for expired leases every 0.5 s.
EFFECTIVE_TTL_S = max(2.0, math.ceil(TTL_S)) + 0.5
MARGIN_S = 3.0


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:2379", [("127.0.0.1", 2379)]),
    ("127.0.0.1:2379;host2:2380", [("127.0.0.1", 2379), ("host2", 2380)]),
    ("etcd://h:1,http://h2:2/", [("h", 1), ("h2", 2)]),
    (" a:1 ; ; a:1 ;", [("a", 1)]),
    ("HTTP://[::1]:2379", [("::1", 2379)]),
    ("etcd://[fe80::1]:65535;localhost:1", [("fe80::1", 65535), ("localhost", 1)]),
])
def test_parse_good(text: str, expected: list[tuple[str, int]]) -> None:
    assert parse_etcd_endpoints(text) == expected


@pytest.mark.parametrize("text", [
    "", " ; ,", "host", "host:", ":2379", "host:0", "host:65536", "host:12ab", "host:-1",
    "https://h:2379", "redis://h:1", "::1:2379", "[::1]", "[::1]2379", "h h:1", "a:1;b",
    "http://h:1/v3", "user@h:1",
])
def test_parse_bad(text: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_etcd_endpoints(text)


def test_parse_rejects_non_string() -> None:
    with pytest.raises(InvalidArgument):
        parse_etcd_endpoints(None)  # type: ignore[arg-type]


def test_leader_key() -> None:
    assert leader_key("mooncake_cluster") == "mooncake-store/mooncake_cluster/master/leader"
    for bad in ("", "a/b", "a b", "a\nb"):
        with pytest.raises(InvalidArgument):
            leader_key(bad)


# --------------------------------------------------------------------------------------------
# Against etcd
# --------------------------------------------------------------------------------------------

def _endpoint(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}"


@pytest.fixture
def etcd(etcd_server: str) -> str:
    """The session etcd as an endpoint string ``127.0.0.1:<port>``."""
    return _endpoint(etcd_server)


@pytest.fixture
def cluster() -> str:
    """A cluster id of its own for each test (the etcd server is shared by the session)."""
    return f"ha-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def elections() -> Iterator[list[LeaderElection]]:
    """Collects LeaderElections to close after the test, even when it failed."""
    made: list[LeaderElection] = []
    yield made
    for election in made:
        election.close()


def _keepalive_threads(cluster_id: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"ha-keepalive-{cluster_id}"]


class _Campaign:
    """campaign() running in a thread; ``result`` is set when it returns or raises."""

    def __init__(self, election: LeaderElection, stop: threading.Event | None = None,
                 timeout_s: float | None = 30.0) -> None:
        self.result: object = None
        self.done = threading.Event()
        self.finished_at = 0.0

        def run() -> None:
            try:
                self.result = election.campaign(stop=stop, timeout_s=timeout_s)
            except BaseException as exc:
                self.result = exc
            finally:
                self.finished_at = time.monotonic()
                self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout_s: float) -> object:
        assert self.done.wait(timeout_s), f"campaign still running after {timeout_s} s"
        self.thread.join()
        return self.result


@pytest.mark.etcd
def test_two_candidates_one_wins_then_hands_over(etcd: str, cluster: str,
                                                 elections: list[LeaderElection]) -> None:
    a = LeaderElection(etcd, cluster, "10.0.0.1:50051", ttl_s=TTL_S)
    b = LeaderElection(etcd, cluster, "10.0.0.2:50051", ttl_s=TTL_S)
    elections += [a, b]
    assert current_leader(etcd, cluster) is None
    assert a.campaign(timeout_s=10)
    assert a.is_leader and a.campaign(timeout_s=0)  # already leader: at once
    assert current_leader(etcd, cluster) == "10.0.0.1:50051"

    started = time.monotonic()
    assert b.campaign(timeout_s=0.6) is False
    assert time.monotonic() - started >= 0.6
    assert not b.is_leader and a.is_leader

    waiting = _Campaign(b)
    # Several lease refreshes of the leader (every TTL/3) pass while b keeps waiting.
    assert not waiting.done.wait(TTL_S)
    assert a.is_leader and current_leader(etcd, cluster) == "10.0.0.1:50051"
    resigned_at = time.monotonic()
    a.resign()
    assert not a.is_leader
    assert waiting.join(10) is True
    # watched: well before the lease (revoked here) could have expired
    assert waiting.finished_at - resigned_at < TTL_S
    assert b.is_leader and not a.is_leader
    assert current_leader(etcd, cluster) == "10.0.0.2:50051"
    assert wait_until(lambda: len(_keepalive_threads(cluster)) == 1, 5)

    b.close()
    b.close()  # idempotent
    assert not b.is_leader
    assert current_leader(etcd, cluster) is None
    assert wait_until(lambda: not _keepalive_threads(cluster), 5)


@pytest.mark.etcd
def test_campaign_stops_on_event_and_on_close(etcd: str, cluster: str,
                                              elections: list[LeaderElection]) -> None:
    a = LeaderElection(etcd, cluster, "A", ttl_s=TTL_S)
    b = LeaderElection(etcd, cluster, "B", ttl_s=TTL_S)
    c = LeaderElection(etcd, cluster, "C", ttl_s=TTL_S)
    elections += [a, b, c]
    assert a.campaign(timeout_s=10)

    stop = threading.Event()
    stopped = _Campaign(b, stop=stop, timeout_s=None)
    closed = _Campaign(c, timeout_s=None)
    assert not stopped.done.wait(0.3)
    stop.set()
    set_at = time.monotonic()
    assert stopped.join(5) is False
    assert stopped.finished_at - set_at < 3.0   # about 0.5 s: a quiet watch slice
    c.close()
    assert closed.join(5) is False
    assert c.campaign(timeout_s=1) is False  # closed for good
    assert a.is_leader and current_leader(etcd, cluster) == "A"


@pytest.mark.etcd
def test_killed_leader_is_replaced_after_its_lease_expires(etcd: str, cluster: str,
                                                           elections: list[LeaderElection]
                                                           ) -> None:
    child, _ = spawn_ready([sys.executable, CANDIDATE, "--endpoints", etcd, "--cluster", cluster,
                            "--address", "child:1", "--ttl", str(TTL_S)], timeout_s=30)
    try:
        term = find_leader(etcd, cluster).term
        standby = LeaderElection(etcd, cluster, "standby:2", ttl_s=TTL_S)
        elections.append(standby)
        waiting = _Campaign(standby)
        assert not waiting.done.wait(0.3)

        os.killpg(child.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert child.wait(10) == -signal.SIGKILL
        follower = wait_for_leader(etcd, cluster, EFFECTIVE_TTL_S + MARGIN_S, exclude_term=term)
        assert follower.address == "standby:2" and follower.term > term
        assert waiting.join(5) is True
        took_s = waiting.finished_at - killed_at
        assert took_s < EFFECTIVE_TTL_S + MARGIN_S, took_s
        assert standby.is_leader and current_leader(etcd, cluster) == "standby:2"
    finally:
        terminate_group(child)


@pytest.mark.etcd
def test_terminated_leader_resigns_at_once(etcd: str, cluster: str) -> None:
    child, _ = spawn_ready([sys.executable, CANDIDATE, "--endpoints", etcd, "--cluster", cluster,
                            "--address", "child:1", "--ttl", "5"], timeout_s=30)
    try:
        assert current_leader(etcd, cluster) == "child:1"
        assert terminate_group(child) == 0  # SIGTERM -> close() -> lease revoked
        assert current_leader(etcd, cluster) is None  # well before the 5 s TTL
    finally:
        terminate_group(child)


@pytest.mark.etcd
def test_on_lost_runs_once_when_key_deleted_behind_its_back(
        etcd_server: str, etcd: str, cluster: str, elections: list[LeaderElection]) -> None:
    a = LeaderElection(etcd, cluster, "A", ttl_s=TTL_S)
    elections.append(a)
    calls: list[float] = []
    lost = threading.Event()

    def on_lost() -> None:
        calls.append(time.monotonic())
        lost.set()

    a.on_lost(on_lost)
    with pytest.raises(InvalidArgument):
        a.on_lost("not callable")  # type: ignore[arg-type]
    assert a.campaign(timeout_s=10)

    parts = urlsplit(etcd_server)
    session = requests.Session()
    session.trust_env = False
    client = etcd3gw.Etcd3Client(host=parts.hostname, port=parts.port, session=session,
                                 timeout=5)
    try:
        assert client.delete(leader_key(cluster).encode())
        deleted_at = time.monotonic()
        assert lost.wait(TTL_S + MARGIN_S)
        assert calls[0] - deleted_at < TTL_S + 1.0
        assert not a.is_leader
        assert wait_until(lambda: not _keepalive_threads(cluster), 5)
        assert len(calls) == 1

        # It may run again and win; a second loss calls the callback again.
        assert a.campaign(timeout_s=10) and current_leader(etcd, cluster) == "A"
        client.put(leader_key(cluster).encode(), b"intruder")
        assert lost.wait(5) and wait_until(lambda: len(calls) == 2, TTL_S + MARGIN_S)
        assert not a.is_leader and current_leader(etcd, cluster) == "intruder"
        assert wait_until(lambda: not _keepalive_threads(cluster), 5)
        assert len(calls) == 2
    finally:
        client.delete(leader_key(cluster).encode())
        session.close()


@pytest.mark.etcd
def test_resign_does_not_call_on_lost(etcd: str, cluster: str,
                                      elections: list[LeaderElection]) -> None:
    a = LeaderElection(etcd, cluster, "A", ttl_s=TTL_S)
    elections.append(a)
    calls: list[int] = []
    a.on_lost(lambda: calls.append(1))
    assert a.campaign(timeout_s=10)
    a.resign()
    a.resign()  # no-op when not leader
    assert not a.is_leader and current_leader(etcd, cluster) is None
    assert not _keepalive_threads(cluster)
    assert calls == []


@pytest.mark.etcd
def test_wait_for_leader(etcd: str, cluster: str, elections: list[LeaderElection]) -> None:
    started = time.monotonic()
    with pytest.raises(LeaderWaitTimeout, match="no leader") as info:
        wait_for_leader(etcd, cluster, 0.5)
    assert 0.5 <= time.monotonic() - started < 3.0
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, MetadataError)

    a = LeaderElection(etcd, cluster, "A:1", ttl_s=TTL_S)
    b = LeaderElection(etcd, cluster, "B:1", ttl_s=TTL_S)
    elections += [a, b]
    assert a.campaign(timeout_s=10)
    first = wait_for_leader(etcd, cluster, 1)
    assert first.address == "A:1" and first == find_leader(etcd, cluster)
    assert wait_for_leader(etcd, cluster, 1, exclude_term=first.term + 1) == first
    with pytest.raises(LeaderWaitTimeout, match=f"other than {first.term}"):
        wait_for_leader(etcd, cluster, 0.5, exclude_term=first.term)

    # A client that lost A follows the next leader as soon as it is published.
    found: list[Leader] = []
    follower = threading.Thread(
        target=lambda: found.append(wait_for_leader(etcd, cluster, 20, exclude_term=first.term)))
    follower.start()
    try:
        waiting = _Campaign(b)
        a.resign()
        assert waiting.join(10) is True
        elected_at = waiting.finished_at
        follower.join(10)
        assert [f.address for f in found] == ["B:1"] and found[0].term > first.term
        assert time.monotonic() - elected_at < TTL_S   # watched, not polled
    finally:
        follower.join(30)
    with pytest.raises(InvalidArgument):
        wait_for_leader(etcd, cluster, -1)


@pytest.mark.etcd
def test_fails_over_to_the_next_endpoint(etcd: str, cluster: str,
                                         elections: list[LeaderElection]) -> None:
    endpoints = f"127.0.0.1:{free_port()};{etcd}"
    a = LeaderElection(endpoints, cluster, "A", ttl_s=TTL_S)
    b = LeaderElection(endpoints, cluster, "B", ttl_s=TTL_S)
    elections += [a, b]
    assert a.campaign(timeout_s=10)
    assert current_leader(endpoints, cluster) == "A"
    waiting = _Campaign(b)
    a.resign()
    assert waiting.join(10) is True
    assert wait_for_leader(endpoints, cluster, 5).address == "B"


@pytest.mark.etcd
def test_a_leader_reelected_at_its_address_is_a_new_term(etcd: str, cluster: str,
                                                          elections: list[LeaderElection]) -> None:
    """A master restarted in place wins at the address of the term it lost: a client waiting
    for the next term takes it (waiting for another address would wait forever)."""
    a = LeaderElection(etcd, cluster, "A:1", ttl_s=TTL_S)
    elections.append(a)
    assert a.campaign(timeout_s=10)
    lost = find_leader(etcd, cluster)
    found: list[Leader] = []
    follower = threading.Thread(
        target=lambda: found.append(wait_for_leader(etcd, cluster, 20, exclude_term=lost.term)))
    follower.start()
    try:
        a.resign()
        again = LeaderElection(etcd, cluster, "A:1", ttl_s=TTL_S)
        elections.append(again)
        assert again.campaign(timeout_s=10)
        follower.join(10)
        assert found == [find_leader(etcd, cluster)]
        assert found[0].address == "A:1" and found[0].term > lost.term
    finally:
        follower.join(30)


def test_unreachable_etcd_is_a_clear_error(cluster: str) -> None:
    dead = f"127.0.0.1:{free_port()};etcd://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(MetadataError, match="unreachable") as info:
        LeaderElection(dead, cluster, "A", ttl_s=TTL_S)
    assert "127.0.0.1" in str(info.value)
    with pytest.raises(MetadataError, match="unreachable"):
        current_leader(dead, cluster)
    with pytest.raises(MetadataError, match="unreachable") as waited:
        wait_for_leader(dead, cluster, 30)
    assert not isinstance(waited.value, LeaderWaitTimeout)
    assert time.monotonic() - started < 5.0
    with pytest.raises(InvalidArgument):
        LeaderElection("127.0.0.1:1", cluster, "", ttl_s=TTL_S)
    with pytest.raises(InvalidArgument):
        LeaderElection("127.0.0.1:1", cluster, "A", ttl_s=0)


# --------------------------------------------------------------------------------------------
# etcd dying under a leader and a candidate (a private etcd this test may kill)
# --------------------------------------------------------------------------------------------

@pytest.fixture
def private_etcd() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """An etcd of this test alone: (process, endpoint ``127.0.0.1:<port>``)."""
    binary = shutil.which("etcd")
    if binary is None:
        if os.environ.get("MOONCAKE_CI") == "1":
            pytest.fail("MOONCAKE_CI=1 and etcd not found on PATH", pytrace=False)
        pytest.skip("etcd not found on PATH; apt-get install -y etcd-server")
    workdir = tempfile.mkdtemp(prefix="mooncake-ha-etcd-")
    proc = None
    try:
        for _attempt in range(3):
            client_url = f"http://127.0.0.1:{free_port()}"
            peer_url = f"http://127.0.0.1:{free_port()}"
            with open(os.path.join(workdir, "etcd.log"), "ab") as log:
                proc = subprocess.Popen(
                    [binary, "--name", "ha", "--data-dir", os.path.join(workdir, "data"),
                     "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                     "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                     "--initial-cluster", f"ha={peer_url}"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True)
            url = client_url
            if wait_until(lambda: proc.poll() is not None or etcd_healthy(url), 30, 0.05) \
                    and proc.poll() is None:
                break
            terminate_group(proc)
            shutil.rmtree(os.path.join(workdir, "data"), ignore_errors=True)
        else:
            pytest.fail("private etcd did not start in 3 attempts")
        yield proc, _endpoint(client_url)
    finally:
        if proc is not None:
            terminate_group(proc)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.etcd
@pytest.mark.slow
def test_etcd_death_demotes_the_leader_and_fails_the_campaign(
        private_etcd: tuple[subprocess.Popen[bytes], str], cluster: str,
        elections: list[LeaderElection]) -> None:
    proc, endpoint = private_etcd
    a = LeaderElection(endpoint, cluster, "A", ttl_s=TTL_S)
    b = LeaderElection(endpoint, cluster, "B", ttl_s=TTL_S)
    elections += [a, b]
    lost = threading.Event()
    a.on_lost(lost.set)
    assert a.campaign(timeout_s=10)
    waiting = _Campaign(b)
    assert not waiting.done.wait(0.3)

    os.killpg(proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    proc.wait(10)
    # The leader steps down before its lease could have expired in etcd.
    assert lost.wait(TTL_S + MARGIN_S)
    assert time.monotonic() - killed_at < TTL_S + 1.0
    assert not a.is_leader
    # The waiting candidate gets an error, not a hang.
    result = waiting.join(10)
    assert isinstance(result, MetadataError) and "unreachable" in str(result), result
    with pytest.raises(MetadataError, match="unreachable"):
        b.campaign(timeout_s=30)


@pytest.mark.etcd
def test_a_stalled_etcd_call_does_not_delay_the_lease_refresh(
        etcd: str, cluster: str, elections: list[LeaderElection]) -> None:
    a = LeaderElection(etcd, cluster, "A", ttl_s=TTL_S)
    elections.append(a)
    lost = threading.Event()
    a.on_lost(lost.set)
    assert a.campaign(timeout_s=10)
    # A unary POST of a watch gets no reply body until its read timeout: a call that hangs
    # on a live etcd, as a slow endpoint's would.
    stall_s = 1.5 * TTL_S
    took: list[float] = []

    def stalled_call() -> None:
        started = time.monotonic()
        with pytest.raises(MetadataError):
            a._cluster.call("stalled", "/watch",
                            {"create_request": {"key": "c3RhbGw="}}, timeout_s=stall_s)
        took.append(time.monotonic() - started)

    thread = threading.Thread(target=stalled_call)
    thread.start()
    try:
        while thread.is_alive():
            assert a.is_leader, "the lease refresh waited for another thread's etcd call"
            time.sleep(0.02)
    finally:
        thread.join(stall_s + 10)
    assert took and took[0] >= stall_s * 0.9, took  # the call really stalled that long
    assert a.is_leader and not lost.is_set()
