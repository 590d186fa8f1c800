"""Shared service fixtures: real etcd and redis-server processes, the embedded metadata server.

Servers run as child processes in their own session on free loopback ports, with data in
a fresh temp dir; readiness is polled, never slept for. Everything is terminated and
removed in ``finally``. A missing binary skips the tests that need it, or fails them
when ``MOONCAKE_CI=1``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
from helpers import etcd_healthy, free_port, live_children, terminate_group, wait_until

from mooncake_plugins.transfer import implementation
from mooncake_plugins.transfer.metadata import MetadataServer

# Room for the metadata store's 16 MiB values plus request overhead (etcd's default is 1.5 MiB).
_ETCD_MAX_REQUEST_BYTES = 20 * 1024 * 1024
_START_TIMEOUT_S = 30.0
_PORT_ATTEMPTS = 3  # a free port can be taken by someone else before the server binds it


_SESSION_PIDS: set[int] = set()
"""Session-scoped services (etcd, redis-server): they outlive single tests on purpose."""


def _require_binary(name: str, package: str) -> str:
    """Return the path of ``name``, or skip (fail under MOONCAKE_CI=1) when it is missing."""
    path = shutil.which(name)
    if path is None:
        reason = (f"{name} not found on PATH; install the Debian package {package} "
                  f"(apt-get install -y --no-install-recommends {package})")
        if os.environ.get("MOONCAKE_CI") == "1":
            pytest.fail(f"MOONCAKE_CI=1 and {reason}", pytrace=False)
        pytest.skip(reason)
    return path


def _two_free_ports() -> tuple[int, int]:
    first = free_port()
    second = free_port()
    while second == first:
        second = free_port()
    return first, second


def _tail(path: str, nbytes: int = 4000) -> str:
    with open(path, "rb") as log:
        return log.read()[-nbytes:].decode("utf-8", "replace")


def _redis_pongs(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


_Attempt = tuple[list[str], Callable[[], bool], str]


def _wait_started(proc: subprocess.Popen[bytes], ready: Callable[[], bool]) -> bool:
    """Wait until ``ready()`` or until ``proc`` exits; True when it runs and is ready."""
    try:
        up = wait_until(lambda: proc.poll() is not None or ready(), _START_TIMEOUT_S,
                        interval_s=0.05)
    except BaseException:
        terminate_group(proc)
        raise
    return up and proc.poll() is None


def _start_until_ready(name: str, make_attempt: Callable[[int], _Attempt],
                       log_path: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start a server until one attempt becomes ready; fail the test otherwise.

    Args:
        make_attempt: attempt number -> (argv on fresh ports, readiness probe, URL).

    Returns:
        (the ready server process, its URL).
    """
    for attempt in range(_PORT_ATTEMPTS):
        cmd, ready, url = make_attempt(attempt)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        if _wait_started(proc, ready):
            return proc, url
        terminate_group(proc)
    pytest.fail(f"{name} did not become ready in {_PORT_ATTEMPTS} attempts; log tail:\n"
                f"{_tail(log_path)}", pytrace=False)


def _session_service(name: str, make_attempt: Callable[[int], _Attempt],
                     workdir: str) -> Iterator[str]:
    """Start a session service, yield its URL, then end it and remove ``workdir``."""
    proc = None
    try:
        proc, url = _start_until_ready(name, make_attempt, os.path.join(workdir, f"{name}.log"))
        _SESSION_PIDS.add(proc.pid)
        yield url
    finally:
        if proc is not None:
            terminate_group(proc)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[str]:
    """A real single-member etcd; yields its client URL ``http://127.0.0.1:<port>``.

    The metadata URL for it is ``etcd://127.0.0.1:<port>``. ``--max-request-bytes`` is
    raised to 20 MiB so 16 MiB metadata values fit.
    """
    binary = _require_binary("etcd", "etcd-server")
    workdir = tempfile.mkdtemp(prefix="mooncake-etcd-")

    def make_attempt(attempt: int) -> _Attempt:
        client_port, peer_port = _two_free_ports()
        client_url = f"http://127.0.0.1:{client_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        cmd = [binary, "--name", "test", "--data-dir", os.path.join(workdir, f"data{attempt}"),
               "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
               "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
               "--initial-cluster", f"test={peer_url}",
               "--max-request-bytes", str(_ETCD_MAX_REQUEST_BYTES),
               "--logger", "zap", "--log-outputs", "stderr"]
        return cmd, lambda: etcd_healthy(client_url), client_url

    yield from _session_service("etcd", make_attempt, workdir)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """A real redis-server without persistence; yields ``redis://127.0.0.1:<port>``."""
    binary = _require_binary("redis-server", "redis-server")
    workdir = tempfile.mkdtemp(prefix="mooncake-redis-")

    def make_attempt(attempt: int) -> _Attempt:
        port = free_port()
        cmd = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
               "--appendonly", "no", "--daemonize", "no", "--dir", workdir]
        return cmd, lambda: _redis_pongs(port), f"redis://127.0.0.1:{port}"

    yield from _session_service("redis-server", make_attempt, workdir)


@pytest.fixture
def metadata_server() -> Iterator[MetadataServer]:
    """An embedded HTTP metadata server on a free loopback port (``.url``, ``.port``)."""
    with MetadataServer() as server:
        yield server


_XDIST_DIR = os.path.join(tempfile.gettempdir(),
                          f"mooncake-xdist-{os.environ.get('PYTEST_XDIST_TESTRUNUID', '')}")


@pytest.fixture(autouse=True)
def _exclusive_under_xdist(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under pytest-xdist (the README's command runs several workers), a test marked
    ``exclusive`` (it fits or compares measured times) runs while no other test does; the
    others share the machine. A reader-writer lock over the workers (flock): an exclusive
    test raises a flag that holds new tests back, then waits for the running ones to end."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    import fcntl

    os.makedirs(_XDIST_DIR, exist_ok=True)
    flag = os.path.join(_XDIST_DIR, "exclusive-waiting")
    lock = os.open(os.path.join(_XDIST_DIR, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    writers = None
    try:
        if request.node.get_closest_marker("exclusive") is not None:
            writers = os.open(os.path.join(_XDIST_DIR, "writers"), os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(writers, fcntl.LOCK_EX)          # one exclusive test at a time
            open(flag, "w").close()
            fcntl.flock(lock, fcntl.LOCK_EX)
        else:
            while os.path.exists(flag):
                threading.Event().wait(0.05)
            fcntl.flock(lock, fcntl.LOCK_SH)
        yield
    finally:
        if writers is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(flag)
            os.close(writers)
        os.close(lock)                                    # releases the flock


@pytest.fixture(autouse=True)
def _no_leaked_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test ends every child process it started (session services are exempt)."""
    before = live_children()

    def leaked() -> set[int]:
        return live_children() - before - _SESSION_PIDS

    yield
    if not wait_until(lambda: not leaked(), 5.0):
        pytest.fail(f"{request.node.nodeid} left child processes running: {sorted(leaked())}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``MOONCAKE_PUREPYTHON=1`` (CI's second pass, on the Python fallbacks), leave out
    the tests that take the ``impl`` fixture: they run on both paths in every session."""
    if os.environ.get("MOONCAKE_PUREPYTHON") != "1":
        return
    keep, both = [], []
    for item in items:
        (both if "impl" in getattr(item, "fixturenames", ()) else keep).append(item)
    if both:
        config.hook.pytest_deselected(items=both)
        items[:] = keep


@pytest.fixture(params=implementation.NAMES)
def impl(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test on the native data path and on the pure-Python one, in this session.

    Engines and store clients made inside the test use the chosen implementation; child
    processes get it through ``impl_env``. The implementation in force before is restored.
    """
    before = implementation.current()
    try:
        implementation.use(request.param)
    except ImportError as exc:
        pytest.fail(f"the native extensions are not built: {exc}", pytrace=False)
    try:
        yield request.param
    finally:
        implementation.use(before)


@pytest.fixture
def impl_env(impl: str) -> dict[str, str]:
    """Environment variables that select ``impl`` in a child process."""
    return {"MOONCAKE_PUREPYTHON": "1" if impl == "python" else "0"}


def _resources() -> Counter[str]:
    """What a test may not leave behind: our memfds, sockets, /dev/shm files, our threads."""
    held: Counter[str] = Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("/memfd:mooncake-"):
            held[link.split(" ")[0]] += 1
        elif link.startswith("socket:"):
            held["socket"] += 1
    for name in os.listdir("/dev/shm"):
        # torch's shared-memory manager (psm_*) and multiprocessing's semaphores (sem.mp-*)
        # belong to whatever else runs on the machine (a vLLM engine of another suite run
        # at the same time); nothing of ours creates them
        if not name.startswith(("psm_", "sem.mp-")):
            held[f"/dev/shm/{name}"] += 1
    for t in threading.enumerate():
        if t.name.startswith("mc-"):
            held[f"thread {t.name.rstrip('0123456789_-')}"] += 1
    return held


@pytest.fixture(autouse=True)
def _resources_balanced(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test gives back the memfds, sockets, /dev/shm files and threads it took.

    Longer-lived fixtures (module, session) are set up before and torn down after this
    check, so what they hold is in both counts.
    """
    before = _resources()

    def leaked() -> Counter[str]:
        gc.collect()
        return _resources() - before

    yield
    if not wait_until(lambda: not leaked(), 5.0, interval_s=0.1):
        pytest.fail(f"{request.node.nodeid} leaked: {dict(leaked())}", pytrace=False)
