"""A NIXL agent in its own process, driven over a pipe by the tests.

The agent registers one DRAM buffer (filled with a known pattern), hands its metadata and
the buffer's address to the test, and then answers commands: add a remote agent, collect
notifications (and, as each arrives, a digest of a given range, to check the data was
there first), digest or refill ranges, deregister, exit.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

BACKEND_PARAMS = {"ip_addr": "127.0.0.1"}


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def digest(view: np.ndarray) -> str:
    return hashlib.sha256(view.tobytes()).hexdigest()


def make_agent(name: str, backend: str, params: dict[str, str]) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    agent.create_backend(backend, {**BACKEND_PARAMS, **params} if backend == "MOONCAKE" else params)
    return agent


def _serve(conn: Any, name: str, nbytes: int, backend: str, params: dict[str, str]) -> None:
    agent = make_agent(name, backend, params)
    buf = pattern(nbytes, 1)
    reg = agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    while True:
        cmd, *args = conn.recv()
        if cmd == "add":
            conn.send(agent.add_remote_agent(args[0]))
        elif cmd == "notifs":  # (count, timeout_s, offset, nbytes): wait for count
            count, timeout_s, off, n = args
            got: list[tuple[str, bytes, str]] = []
            deadline = time.monotonic() + timeout_s
            while len(got) < count and time.monotonic() < deadline:
                for peer, msgs in agent.get_new_notifs().items():
                    got.extend((peer, m, digest(buf[off:off + n])) for m in msgs)
                time.sleep(0.001)
            conn.send(got)
        elif cmd == "digest":
            off, n = args
            conn.send(digest(buf[off:off + n]))
        elif cmd == "fill":
            buf[:] = pattern(nbytes, args[0])
            conn.send(True)
        elif cmd == "deregister":
            agent.deregister_memory(reg)
            conn.send(True)
        elif cmd == "exit":
            conn.send(True)
            return


@dataclass
class Peer:
    name: str
    proc: Any
    conn: Any
    metadata: bytes
    address: int
    nbytes: int

    @classmethod
    def start(cls, ctx: Any, name: str, nbytes: int, backend: str,
              params: dict[str, str]) -> "Peer":
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(theirs, name, nbytes, backend, params),
                           daemon=True)
        proc.start()
        if not ours.poll(60):
            proc.kill()
            raise RuntimeError(f"NIXL peer {name} did not start")
        metadata, address = ours.recv()
        return cls(name, proc, ours, metadata, address, nbytes)

    def call(self, *cmd: Any, timeout_s: float = 60) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"NIXL peer {self.name} did not answer {cmd[0]!r}")
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout_s=10)
            except (OSError, EOFError, TimeoutError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()
