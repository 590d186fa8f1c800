"""Two hosts joined by several network links: two network namespaces the caller creates
(root and iproute2), ``n`` veth pairs between them, each its own /24, optionally each
rate-limited with ``tc tbf`` on host A's side (what A sends: a WRITE's payload).

Used by the multi-path tests and ``benchmarks/multipath_bench.py``; everything it made is
deleted on exit, processes in the namespaces included (deleting a namespace does not
kill them: the caller stops its peers first).
"""

from __future__ import annotations

import os
import shutil
import subprocess


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def usable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs root, iproute2 and tc to create network namespaces and links"
    return None


class Links:
    """``with Links(n, rate_mbit) as links``: ``links.a``/``links.b`` (namespace names),
    ``links.addr_a[i]``/``links.addr_b[i]``, ``links.down(i)``/``links.up(i)``,
    ``links.prefix(side)`` (the command prefix running a process in that namespace)."""

    def __init__(self, n: int, rate_mbit: int | None = None) -> None:
        tag = f"{os.getpid() % 100000}"
        self.a, self.b = f"mpa{tag}", f"mpb{tag}"
        base = 100 + os.getpid() % 100
        self.addr_a = [f"10.{base}.{i + 1}.1" for i in range(n)]
        self.addr_b = [f"10.{base}.{i + 1}.2" for i in range(n)]
        self.dev_a = [f"mpa{tag}l{i}" for i in range(n)]
        self.dev_b = [f"mpb{tag}l{i}" for i in range(n)]
        self.rate_mbit = rate_mbit

    def __enter__(self) -> "Links":
        try:
            probe = ip("netns", "add", self.a, check=False)
            if probe.returncode != 0:
                raise RuntimeError(f"the kernel refused a network namespace: "
                                   f"{probe.stderr.strip()}")
            ip("netns", "add", self.b)
            for ns in (self.a, self.b):
                ip("-n", ns, "link", "set", "lo", "up")
            for i, (da, db) in enumerate(zip(self.dev_a, self.dev_b)):
                ip("link", "add", da, "type", "veth", "peer", "name", db)
                ip("link", "set", da, "netns", self.a)
                ip("link", "set", db, "netns", self.b)
                ip("-n", self.a, "addr", "add", f"{self.addr_a[i]}/24", "dev", da)
                ip("-n", self.b, "addr", "add", f"{self.addr_b[i]}/24", "dev", db)
                ip("-n", self.a, "link", "set", da, "up")
                ip("-n", self.b, "link", "set", db, "up")
                if self.rate_mbit:
                    burst = max(256, self.rate_mbit * 1000 // 8 // 100)   # >= one tick's bytes
                    subprocess.run(["ip", "netns", "exec", self.a, "tc", "qdisc", "add", "dev",
                                    da, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
                                    "burst", f"{burst}kb", "latency", "100ms"],
                                   check=True, capture_output=True, text=True)
        except BaseException:
            self.__exit__()
            raise
        return self

    def prefix(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", self.a if side == "a" else self.b]

    def down(self, i: int) -> None:
        ip("-n", self.a, "link", "set", self.dev_a[i], "down")

    def up(self, i: int) -> None:
        ip("-n", self.a, "link", "set", self.dev_a[i], "up")
        ip("-n", self.b, "link", "set", self.dev_b[i], "up")

    def __exit__(self, *exc: object) -> None:
        ip("netns", "del", self.a, check=False)   # takes its veth ends, and their peers
        ip("netns", "del", self.b, check=False)
