"""Fixtures of the transfer tests: peer engines in their own processes."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from helpers import terminate_group

PEER = str(Path(__file__).with_name("peer.py"))


class PeerProcess:
    """A running ``peer.py``: its segment, buffer and a line-based command channel."""

    def __init__(self, args: list[str], prefix: list[str] | None = None,
                 env: dict[str, str] | None = None, timeout_s: float = 30.0) -> None:
        cmd = (prefix or []) + [sys.executable, PEER] + args
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True,
                                     env={**os.environ, **(env or {})})
        line = self.readline(timeout_s)
        if not line.startswith("READY "):
            terminate_group(self.proc)
            err = self.proc.stderr.read().decode()
            self.close()
            raise RuntimeError(f"peer did not start: {line!r}\n{err}")
        info = json.loads(line[6:])
        self.segment: str = info["segment"]
        self.port: int = info["port"]
        self.address: int = info["address"]
        self.nbytes: int = info["nbytes"]

    def readline(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                return self.proc.stdout.readline().decode().strip()
        raise TimeoutError("peer did not answer in time")

    def ask(self, line: str, timeout_s: float = 60.0) -> str:
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()
        return self.readline(timeout_s)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(b"quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            terminate_group(self.proc)
            for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                f.close()


@pytest.fixture
def spawn_peer() -> Iterator:
    """Factory: ``spawn_peer(*args)`` starts a peer process, closed after the test."""
    peers: list[PeerProcess] = []

    def spawn(*args: str, prefix: list[str] | None = None, env: dict[str, str] | None = None) -> PeerProcess:
        peer = PeerProcess(list(args), prefix, env)
        peers.append(peer)
        return peer

    yield spawn
    for p in peers:
        p.close()
