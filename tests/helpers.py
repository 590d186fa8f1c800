"""Test helpers: readiness waits, free ports, child process groups, and the skip that
fails instead under ``MOONCAKE_CI=1`` (:func:`skip_or_fail`, :func:`require_module`).

Children are started in their own session (process group) so that
:func:`terminate_group` ends them together with anything they spawned.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import random
import re
import select
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import IO, NoReturn

_log = logging.getLogger(__name__)

_READY = re.compile(rb"^READY (\d+)\s*$")


def wait_until(predicate: Callable[[], object], timeout_s: float,
               interval_s: float = 0.01) -> bool:
    """Poll ``predicate`` until it returns something truthy or ``timeout_s`` passes.

    Returns:
        True when the predicate held before the deadline, else False (one last try
        is made at the deadline).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(interval_s, remaining))


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago (the kernel picked it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def unclaimable_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now and below the kernel's ephemeral range, so that no
    process binding port 0 meanwhile (a vLLM engine opening its own sockets) can take it
    before the process it is meant for binds it: for ports handed to a child to bind."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    start = random.randrange(10000, max(10001, low - 1000))
    for port in [*range(start, low), *range(10000, start)]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below the ephemeral range (which starts at {low})")


def unclaimable_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct :func:`unclaimable_port` ports."""
    ports: list[int] = []
    while len(ports) < count:
        port = unclaimable_port(host)
        if port not in ports:
            ports.append(port)
    return ports


def terminate_group(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int:
    """SIGTERM ``proc``'s process group, wait up to ``timeout_s``, then SIGKILL it.

    ``proc`` must have been started with ``start_new_session=True``. The group is only
    signalled while ``proc`` is unreaped, so its pid cannot have been reused.

    Returns:
        The exit status of ``proc`` (negative: killed by that signal).
    """
    try:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _log.warning("pid %d ignored SIGTERM for %.1f s; killing its group",
                             proc.pid, timeout_s)
                _signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=timeout_s)
        return int(proc.returncode)
    finally:
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group is already gone
        os.killpg(proc.pid, signum)


def spawn_ready(cmd: Sequence[str], timeout_s: float,
                env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """Start ``cmd`` in a new session and wait for its ``READY <port>`` stdout line.

    Lines before READY are ignored; after READY a daemon thread drains stdout so the
    child never blocks on a full pipe (``proc.stdout`` is then None). The child's
    stderr goes to an unnamed temp file.

    Args:
        cmd: the argv to run.
        timeout_s: how long the child may take to print READY.
        env: the child's environment (default: inherit ours).

    Returns:
        (the running child, the port it printed).

    Raises:
        RuntimeError: the child exited or stayed silent past the deadline; the child
            has been terminated and the message includes its stderr.
    """
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=stderr, env=None if env is None else dict(env),
                                start_new_session=True)
        try:
            port = _read_ready(proc, timeout_s)
        except (TimeoutError, EOFError) as exc:
            status = terminate_group(proc)
            stderr.seek(0)
            text = stderr.read()[-4000:].decode("utf-8", "replace")
            raise RuntimeError(f"{' '.join(cmd)}: {exc} (exit status {status}); "
                               f"stderr:\n{text}") from None
        except BaseException:
            terminate_group(proc)
            raise
    # The drain thread owns stdout from now on and closes it at EOF.
    stdout, proc.stdout = proc.stdout, None
    threading.Thread(target=_drain, args=(stdout, proc.pid),
                     name=f"drain-{proc.pid}", daemon=True).start()
    return proc, port


def _read_ready(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """Read ``proc``'s stdout line by line until ``READY <port>``, with a deadline."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    pending = b""
    while True:
        *lines, pending = pending.split(b"\n")
        for line in lines:
            match = _READY.match(line)
            if match:
                return int(match.group(1))
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no READY line within {timeout_s} s")
        readable, _, _ = select.select([fd], [], [], remaining)
        if readable:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError("exited before printing READY")
            pending += chunk


def _drain(stream: IO[bytes], pid: int) -> None:
    """Discard a child's remaining stdout (logged at debug level), then close it at EOF."""
    with stream:
        for line in stream:
            _log.debug("pid %d stdout: %r", pid, line)


class LineChild:
    """A child process driven one line at a time: it prints ``READY <json>``, then answers.

    Started in its own session; ``close()`` sends ``quit`` and then ends the group.
    """

    def __init__(self, cmd: Sequence[str], timeout_s: float = 30.0,
                 env: Mapping[str, str] | None = None) -> None:
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(list(cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, start_new_session=True,
                                     env=None if env is None else dict(env))
        try:
            line = self.readline(timeout_s)
        except TimeoutError:
            line = ""
        if not line.startswith("READY "):
            terminate_group(self.proc, 5)
            self._stderr.seek(0)
            err = self._stderr.read()[-4000:].decode("utf-8", "replace")
            self._stderr.close()
            raise RuntimeError(f"{list(cmd)[1:3]} did not start: {line!r}\nstderr:\n{err}")
        self.info = json.loads(line[len("READY "):])

    def readline(self, timeout_s: float) -> str:
        """The next stdout line; TimeoutError when none comes within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while time.monotonic() < deadline:
            if select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return self.proc.stdout.readline().decode().strip()
        raise TimeoutError("the child did not answer in time")

    def ask(self, line: str, timeout_s: float = 60.0) -> str:
        """Send one command line and return the answer line."""
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()
        return self.readline(timeout_s)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(b"quit\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            terminate_group(self.proc)
            self._stderr.close()


def etcd_healthy(client_url: str) -> bool:
    """Whether the etcd at ``client_url`` answers ``/health`` with health true."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{client_url}/health", timeout=1.0) as response:
            return bool(json.loads(response.read()).get("health") == "true")
    except (OSError, ValueError):
        return False


def live_children() -> set[int]:
    """Pids of this process's children that are still running (zombies excluded)."""
    me = str(os.getpid())
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":  # fields: state, ppid, ...
            out.add(int(entry))
    return out


def in_ci() -> bool:
    """Whether this is a CI run (``MOONCAKE_CI=1``), where every test must run."""
    return os.environ.get("MOONCAKE_CI") == "1"


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the calling test (or module) with ``reason``; under ``MOONCAKE_CI=1`` fail it
    instead: CI provides everything the tests need, so a test that cannot run there is
    a broken CI setup, not a skip."""
    import pytest

    if in_ci():
        pytest.fail(f"MOONCAKE_CI=1 and {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_module(name: str, reason: str) -> ModuleType:
    """Import ``name``, or :func:`skip_or_fail` with ``reason`` when it cannot be imported."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        error = str(exc)
    skip_or_fail(f"{reason} ({error})")
