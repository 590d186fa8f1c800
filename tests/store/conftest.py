"""Store fixtures: masters and client nodes as real processes, or an in-process master."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from helpers import LineChild, spawn_ready, terminate_group

from mooncake_plugins.store.master import MasterConfig
from mooncake_plugins.store.server import MasterServer, ServerOptions

NODE = str(Path(__file__).with_name("node.py"))
MASTER = [sys.executable, "-m", "mooncake_plugins.cli.master"]


class Node(LineChild):
    """A ``node.py`` process: a store client with a segment, driven line by line."""

    def __init__(self, master: str, *extra: str) -> None:
        super().__init__([sys.executable, NODE, "--master", master, *extra])
        self.segment: str = self.info["segment"]


@pytest.fixture
def master_process() -> Iterator:
    """Factory: ``master_process(*flags)`` -> (Popen, "127.0.0.1:<port>")."""
    procs = []

    def start(*flags: str, timeout_s: float = 30) -> tuple[subprocess.Popen, str]:
        proc, port = spawn_ready(MASTER + ["--rpc_port", "0", "--metrics_port", "0", *flags],
                                 timeout_s=timeout_s)
        procs.append(proc)
        return proc, f"127.0.0.1:{port}"

    yield start
    for p in procs:
        terminate_group(p)


@pytest.fixture
def nodes() -> Iterator:
    """Factory: ``nodes(master, *flags)`` starts a store node process, closed after the test."""
    started: list[Node] = []

    def start(master: str, *flags: str) -> Node:
        node = Node(master, *flags)
        started.append(node)
        return node

    yield start
    for n in started:
        n.close()


@pytest.fixture
def master() -> Iterator[MasterServer]:
    """An in-process master on a free port (short TTLs so fault tests are quick)."""
    server = MasterServer(MasterConfig(client_ttl_s=2.0, default_kv_lease_ttl_ms=500),
                          ServerOptions(rpc_port=0))
    server.start()
    yield server
    server.close()


@pytest.fixture
def admin_master() -> Iterator[MasterServer]:
    """An in-process master with its metrics/admin HTTP on a free port (short read leases)."""
    server = MasterServer(MasterConfig(default_kv_lease_ttl_ms=200),
                          ServerOptions(rpc_port=0, metrics_port=0))
    server.start()
    yield server
    server.close()
