"""Real vLLM CPU engines in subprocesses, and how to compare their answers.

``run_engine`` runs one engine over prompts and exits (``run_llm.py``); ``start_engines``
starts long-lived engines (``serve_llm.py``) at once, each answering requests line by
line, so one engine serves several checks and engines start side by side (an engine
start is mostly single-threaded Python imports: on an idle two-core machine two take
little longer than one).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from helpers import LineChild, terminate_group

HERE = Path(__file__).resolve().parent
RUN_LLM = str(HERE / "run_llm.py")
SERVE_LLM = str(HERE / "serve_llm.py")
PROMPT_LEN = 641          # 5 full CPU blocks of 128 tokens and one more token
FULL_BLOCK_TOKENS = 640
MAX_TOKENS = 8
SAMPLING = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 1,
            "detokenize": False, "ignore_eos": True}
START_S = 240


def run_engine(model: str, tmp_path: Path, name: str, kv: dict | None = None,
               env: dict | None = None, prompts: int = 1,
               single_process: bool = False, tp: int = 1) -> tuple[list[dict], str]:
    """One engine process over ``prompts`` distinct prompts of ``PROMPT_LEN`` tokens, with
    ``tp`` tensor-parallel workers; (one JSON result per prompt, the engine's log)."""
    out, log = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
    rpc = tempfile.mkdtemp(prefix="vllm-rpc-")   # zmq ipc paths must stay short
    cmd = [sys.executable, RUN_LLM, model, str(out), "--prompt-len", str(PROMPT_LEN),
           "--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS)]
    if kv is not None:
        cmd += ["--kv-config", json.dumps(kv)]
    if single_process:
        cmd.append("--single-process")
    if tp > 1:
        cmd += ["--tp", str(tp)]
    child_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
                 "VLLM_RPC_BASE_PATH": rpc, **(env or {})}
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=300)
        finally:
            terminate_group(proc)
            shutil.rmtree(rpc, ignore_errors=True)
    text = log.read_text(errors="replace")
    assert rc == 0, f"engine {name} failed (rc {rc}):\n{text[-4000:]}"
    return json.loads(out.read_text())["requests"], text


def engine_env(tmp: Path, name: str, rpc: str, core: str | None = None) -> dict[str, str]:
    """An engine's environment: its own RPC directory ``rpc``, loopback addresses, a 1 GiB
    KV cache, its compute threads on ``core`` (vLLM's default binding when None), and the
    logs of vLLM and of our packages in ``tmp/<name>.log``."""
    log = tmp / f"{name}.log"
    config = tmp / f"{name}-logging.json"
    handler = {"class": "logging.FileHandler", "filename": str(log), "formatter": "plain"}
    config.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(asctime)s %(process)d %(name)s "
                                           "%(levelname)s %(message)s"}},
        "handlers": {"file": handler},
        "loggers": {n: {"handlers": ["file"], "level": "INFO", "propagate": False}
                    for n in ("vllm", "mooncake_vllm", "mooncake_plugins")}}))
    env = {**os.environ, "VLLM_RPC_BASE_PATH": rpc, "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_CONFIG_PATH": str(config)}
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = core
    return env


def shm_inodes_of_group(pgid: int) -> set[int]:
    """Inodes of the /dev/shm files the processes of group ``pgid`` map or hold open
    (by inode: a POSIX semaphore is mapped under a temporary name, then renamed)."""
    inodes: set[int] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) != pgid:
                    continue
            with open(f"/proc/{pid}/maps") as f:
                inodes |= {int(fields[4]) for fields in map(str.split, f)
                           if len(fields) >= 6 and fields[5].startswith("/dev/shm/")}
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"):
                    inodes.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except (OSError, ValueError, IndexError):
            continue
    return inodes


def remove_shm(inodes: set[int], prefix: str = "") -> None:
    """Unlink the /dev/shm files named ``prefix*`` whose inode is in ``inodes``."""
    for entry in os.scandir("/dev/shm"):
        try:
            if entry.name.startswith(prefix) and entry.inode() in inodes:
                os.unlink(entry.path)
        except FileNotFoundError:
            pass


def kill_engine(proc: subprocess.Popen) -> None:
    """SIGKILL an engine's whole process group (a crash), then remove the shared memory
    it left."""
    inodes = shm_inodes_of_group(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    remove_shm(inodes)


@dataclass
class Engine:
    """A running ``serve_llm.py`` engine, its log file and its RPC directory."""

    child: LineChild
    log: Path
    rpc: str

    def generate(self, prompt: list[int], sampling: dict[str, Any] = SAMPLING,
                 kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
        line = json.dumps({"prompt": prompt, "sampling": sampling,
                           "kv_transfer_params": kv_transfer_params})
        return json.loads(self.child.ask(line, timeout_s=120))

    def reset_prefix_cache(self, timeout_s: float = 30.0) -> None:
        """Empty vLLM's own prefix cache (retried while finished requests still hold
        blocks), so a prompt seen before is asked of the connector again."""
        deadline = time.monotonic() + timeout_s
        while not json.loads(self.child.ask('{"reset_prefix_cache": true}'))["reset"]:
            assert time.monotonic() < deadline, "vLLM kept refusing to reset its prefix cache"
            time.sleep(0.2)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def close(self, timeout_s: float = 120.0) -> None:
        """Quit and wait for the engine's own shutdown (its connector finishes its saves
        then), ending whatever is left of it after ``timeout_s``. vLLM kills TP workers
        that take over 5 s to exit (two engines closing at once on two cores can), and a
        killed worker leaves its ``vllm_dist_*`` shared memory: that is removed too."""
        proc = self.child.proc
        vllm_shm = shm_inodes_of_group(proc.pid) if proc.poll() is None else set()
        try:
            if proc.poll() is None:
                proc.stdin.write(b"quit\n")
                proc.stdin.flush()
                proc.wait(timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.child.close()
        remove_shm(vllm_shm, "vllm_dist_")
        shutil.rmtree(self.rpc, ignore_errors=True)


@dataclass(frozen=True)
class EngineSpec:
    """What to start: a name (for its log), a KV transfer config, the core of its compute
    threads (``"0|1"``: rank 0 on core 0, rank 1 on core 1), env overrides, whether its
    engine core and worker share one process (vLLM's default is three processes: front
    end, engine core, worker), and its tensor-parallel size."""

    name: str
    kv: dict[str, Any] | None = None
    core: str | None = None
    env: dict[str, str] | None = None
    single_process: bool = False
    tp: int = 1


def start_engines(model: str, tmp: Path, specs: Sequence[EngineSpec]) -> list[Engine]:
    """Start ``serve_llm.py`` engines side by side and wait until all are up; if one fails,
    the others are closed and its error raised."""
    def start(spec: EngineSpec) -> Engine:
        cmd = [sys.executable, SERVE_LLM, model]
        if spec.kv is not None:
            cmd += ["--kv-config", json.dumps(spec.kv)]
        if spec.single_process:
            cmd.append("--single-process")
        if spec.tp > 1:
            cmd += ["--tp", str(spec.tp)]
        rpc = tempfile.mkdtemp(prefix="vllm-rpc-")   # zmq ipc paths must stay short
        env = {**engine_env(tmp, spec.name, rpc, spec.core), **(spec.env or {})}
        try:
            return Engine(LineChild(cmd, timeout_s=START_S, env=env), tmp / f"{spec.name}.log",
                          rpc)
        except BaseException:
            shutil.rmtree(rpc, ignore_errors=True)
            raise

    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(start, s) for s in specs]
    started = [f.result() for f in futures if f.exception() is None]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        close_engines(started)
        raise errors[0]
    return started


def close_engines(engines: Sequence[Engine]) -> None:
    """:meth:`Engine.close` the engines, all at once."""
    with ThreadPoolExecutor(max(1, len(engines))) as pool:
        list(pool.map(lambda e: e.close(), engines))


@contextlib.contextmanager
def engines_running(model: str, tmp: Path, specs: Sequence[EngineSpec]) -> Iterator[list[Engine]]:
    """:func:`start_engines`, closed on leaving the block."""
    engines = start_engines(model, tmp, specs)
    try:
        yield engines
    finally:
        close_engines(engines)


def same_answer(got: dict, want: dict) -> None:
    """Equal greedy tokens, and logprobs within float noise."""
    assert got["tokens"] == want["tokens"]
    assert len(got["logprobs"]) == len(want["logprobs"]) == len(got["tokens"])
    assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) < 1e-4


def http(url: str, body: dict[str, Any] | None = None, timeout_s: float = 120) -> Any:
    """GET (or POST ``body`` as JSON to) ``url``: the answer as JSON, or as text when it is
    not JSON (a /metrics page)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        raw = resp.read()
    return json.loads(raw or b"null") if raw[:1] in (b"{", b"[", b"") else raw.decode()


def http_up(url: str) -> bool:
    """Whether an HTTP server answers at ``url`` (an error status is an answer)."""
    try:
        urllib.request.urlopen(url, timeout=2).close()
        return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False
