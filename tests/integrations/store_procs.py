"""A store for framework tests: a master and a holder process lending memory, so stored
KV outlives the process that wrote it (as with a ``mooncake_client`` in production)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from helpers import LineChild, spawn_ready, terminate_group

TESTS = Path(__file__).resolve().parents[1]
NODE = str(TESTS / "store" / "node.py")
MASTER = [sys.executable, "-m", "mooncake_plugins.cli.master"]


@dataclass
class Store:
    address: str
    master: subprocess.Popen
    holder: LineChild

    def stop_master(self) -> None:
        terminate_group(self.master)


@contextlib.contextmanager
def running_store(flags: Sequence[str] = (), segment: int = 128 << 20) -> Iterator[Store]:
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
