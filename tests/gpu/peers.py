"""A target process for the GPU tests and benchmarks/gpu_bench.py (no pytest needed).

``TARGET % (transports, nbytes, on_gpu)`` is a script: an engine with those transports
lends ``nbytes`` of host memory, or of device memory when ``on_gpu``; it prints its segment
name and the region's address, then answers each ``hash`` line on stdin with the sha256
of the region (device memory copied to host first), and on any other line closes and
prints ``bye``.
"""

import textwrap

TARGET = textwrap.dedent("""
    import hashlib, sys
    from mooncake_plugins.config import EngineConfig
    from mooncake_plugins.transfer import TransferEngine, cuda, memory
    eng = TransferEngine(config=EngineConfig(transports=%r))
    host = bytearray(%d)
    dev = cuda.DeviceBuffer(len(host)) if %r else None
    region = eng.register_address(dev.address, dev.nbytes) if dev else eng.register(host)
    print(eng.segment_name, region.address, flush=True)
    for line in sys.stdin:
        if line.strip() != "hash":
            break
        if dev:
            cuda.copy(memory.address_of(host)[0], dev.address, dev.nbytes)
        print(hashlib.sha256(host).hexdigest(), flush=True)
    eng.close()
    if dev:
        dev.close()
    print("bye", flush=True)
""")


class Target:
    """A running target ``script`` (printing ``<segment> <address>`` first, answering
    ``hash`` lines, ``bye`` on exit) in its own process, this repository on its path.
    ``with Target(script) as t``: ``t.segment``, ``t.address``, ``t.ask("hash")``; on
    leaving, it is told to exit and must say ``bye`` and end with status 0 (killed if not).
    """

    def __init__(self, script: str) -> None:
        import os
        import subprocess
        import sys
        from pathlib import Path

        repo = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen([sys.executable, "-c", script], cwd=repo, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        first = self.proc.stdout.readline().split()
        if len(first) != 2:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"target failed to start (exit {self.proc.poll()})")
        self.segment, self.address = first[0], int(first[1])

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def __enter__(self) -> "Target":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                assert self.ask("exit") == "bye"
                assert self.proc.wait(30) == 0
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
