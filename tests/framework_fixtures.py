"""What the framework integration tests share (tests/integrations/<framework>/).

``require_framework`` skips a framework's tests where it is not installed, with the
reason, except in CI's framework steps (``MOONCAKE_REQUIRE_FRAMEWORKS=1``), where a broken
install fails the run. ``store`` is a master plus a holder process lending memory, so
stored KV outlives the process that wrote it (as with a ``mooncake_client`` in
production); ``@pytest.mark.master_flags(...)`` adds master flags.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import pytest
from helpers import LineChild, spawn_ready, terminate_group

NODE = str(Path(__file__).resolve().parent / "store" / "node.py")
MASTER = [sys.executable, "-m", "mooncake_plugins.cli.master"]


def require_framework(module: str, reason: str) -> None:
    """Import ``module``, or skip the calling conftest's tests with ``reason``."""
    if os.environ.get("MOONCAKE_REQUIRE_FRAMEWORKS") == "1":
        importlib.import_module(module)
    else:
        pytest.importorskip(module, reason=reason)


@dataclass
class Store:
    address: str
    master: subprocess.Popen
    holder: LineChild

    def stop_master(self) -> None:
        terminate_group(self.master)


@contextlib.contextmanager
def running_store(flags: Sequence[str] = (), segment: int = 256 << 20) -> Iterator[Store]:
    """A master (with extra ``flags``) and a holder lending ``segment`` bytes."""
    master, port = spawn_ready(MASTER + ["--rpc_port", "0", "--metrics_port", "0", *flags],
                               timeout_s=30)
    address = f"127.0.0.1:{port}"
    try:
        holder = LineChild([sys.executable, NODE, "--master", address, "--segment",
                            str(segment)])
    except BaseException:
        terminate_group(master)
        raise
    try:
        yield Store(address, master, holder)
    finally:
        holder.close()
        terminate_group(master)


@pytest.fixture
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    marker = request.node.get_closest_marker("master_flags")
    with running_store(list(marker.args) if marker else []) as s:
        yield s
