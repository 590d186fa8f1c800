"""Real vLLM CPU engines in subprocesses (``run_llm.py``), and how to compare answers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from helpers import terminate_group

RUN_LLM = str(Path(__file__).with_name("run_llm.py"))
PROMPT_LEN = 641          # 5 full CPU blocks of 128 tokens and one more token
FULL_BLOCK_TOKENS = 640


def run_engine(model: str, tmp_path: Path, name: str, kv: dict | None = None,
               env: dict | None = None, prompts: int = 1) -> tuple[list[dict], str]:
    """One engine process over ``prompts`` distinct prompts of ``PROMPT_LEN`` tokens;
    (one JSON result per prompt, the engine's log)."""
    out, log = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
    rpc = tempfile.mkdtemp(prefix="vllm-rpc-")   # zmq ipc paths must stay short
    cmd = [sys.executable, RUN_LLM, model, str(out), "--prompt-len", str(PROMPT_LEN),
           "--prompts", str(prompts)]
    if kv is not None:
        cmd += ["--kv-config", json.dumps(kv)]
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


def same_answer(got: dict, want: dict) -> None:
    assert got["tokens"] == want["tokens"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"])) < 1e-4
