"""NIXL backend fixtures: NIXL agents with our backend, in this process and in peers.

These tests need NIXL's wheel: ``.ci/run`` creates ``.venv-nixl`` (``nixl`` and
``nixl-cu12`` 1.5.1 without dependencies, on top of the base environment) and runs them
there. Elsewhere they are skipped with that reason.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.resource_tracker
import os
from typing import Iterator

import pytest
from framework_fixtures import require_framework

require_framework("nixl", "NIXL is not installed here: .ci/run runs these tests in "
                          ".venv-nixl (nixl 1.5.1, CPU)")

from mooncake_plugins.nixl.plugin_dir import plugin_dir  # noqa: E402

# before the first agent of this process (NIXL reads it once), and inherited by peers
os.environ["NIXL_PLUGIN_DIR"] = str(plugin_dir())
os.environ["NIXL_MOONCAKE_IP_ADDR"] = "127.0.0.1"

import nixl_peer  # noqa: E402

# multiprocessing's resource tracker (a child that lives as long as this process) starts
# now, not inside the first test, whose leaked-process check would count it
multiprocessing.resource_tracker.ensure_running()


@pytest.fixture
def spawn_peer() -> Iterator:
    """Start NIXL agents in their own processes (:class:`nixl_peer.Peer`); all are
    stopped (killed if they hang) at the end of the test."""
    ctx = multiprocessing.get_context("spawn")
    peers: list[nixl_peer.Peer] = []

    def spawn(name: str, nbytes: int, backend: str = "MOONCAKE",
              params: dict[str, str] | None = None) -> nixl_peer.Peer:
        peer = nixl_peer.Peer.start(ctx, name, nbytes, backend, params or {})
        peers.append(peer)
        return peer

    yield spawn
    for peer in peers:
        peer.stop()
