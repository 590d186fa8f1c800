"""Fixtures of the transfer tests: peer engines in their own processes."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest
from helpers import LineChild

PEER = str(Path(__file__).with_name("peer.py"))


class PeerProcess(LineChild):
    """A running ``peer.py``: its segment and buffer, and a line-based command channel."""

    def __init__(self, args: list[str], prefix: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        super().__init__((prefix or []) + [sys.executable, PEER] + args,
                         env={**os.environ, **(env or {})})
        self.segment: str = self.info["segment"]
        self.port: int = self.info["port"]
        self.address: int = self.info["address"]
        self.nbytes: int = self.info["nbytes"]


@pytest.fixture
def spawn_peer() -> Iterator:
    """Factory: ``spawn_peer(*args)`` starts a peer process, closed after the test."""
    peers: list[PeerProcess] = []

    def spawn(*args: str, prefix: list[str] | None = None,
              env: dict[str, str] | None = None) -> PeerProcess:
        peer = PeerProcess(list(args), prefix, env)
        peers.append(peer)
        return peer

    yield spawn
    for p in peers:
        p.close()
