"""Disaggregated prefill end to end: a prefill and a decode vLLM engine (CPU), each in
its own process, and the example proxy's routing function between them.

The decode side's greedy tokens and logprobs must equal a single engine's (``run_llm.py``
without a connector); a prefill killed before the transfer must leave the decode able
to answer by computing the prompt itself. Two engines share this 2-core machine: each
is bound to its own core, and they start side by side.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from engines import PROMPT_LEN, SAMPLING, Engine, EngineSpec, engines_running, same_answer
from run_llm import prompt_tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from vllm_pd_proxy import disaggregated_generate, prefill_request  # noqa: E402

BLOCK_NBYTES = 2 * 2 * 64 * 2 * 128 * 4   # layers x kv heads x head dim x K,V x 128 x fp32

pytestmark = pytest.mark.timeout(600)


@dataclass
class Setup:
    baseline: list[dict[str, Any]]   # the session's no-connector engine, two prompts
    prefill: Engine
    decode: Engine


def _spec(name: str, core: str, role: str) -> EngineSpec:
    return EngineSpec(name, {"kv_connector": "MooncakePluginsPDConnector", "kv_role": role,
                             "kv_load_failure_policy": "recompute",
                             "kv_connector_extra_config": {"pull_wait_s": 20,
                                                           "transfer_timeout_s": 20}}, core)


@pytest.fixture(scope="module")
def setup(tiny_llama, baseline, tmp_path_factory) -> Iterator[Setup]:
    specs = [_spec("decode", "1", "kv_consumer"), _spec("prefill", "0", "kv_producer")]
    with engines_running(tiny_llama, tmp_path_factory.mktemp("pd-engines"),
                         specs) as (decode, prefill):
        yield Setup(baseline, prefill, decode)


def _shm_inodes_of_group(pgid: int) -> set[int]:
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


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL a child's whole group (a crash), then remove the shared memory it left."""
    inodes = _shm_inodes_of_group(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for entry in os.scandir("/dev/shm"):
        try:
            if entry.inode() in inodes:
                os.unlink(entry.path)
        except FileNotFoundError:
            pass


def test_decode_generates_from_the_prefills_kv(setup):
    prompt = prompt_tokens(PROMPT_LEN, 0)
    got = disaggregated_generate(setup.prefill.generate, setup.decode.generate, prompt,
                                 SAMPLING)
    same_answer(got, setup.baseline[0])
    assert got["num_cached_tokens"] == PROMPT_LEN, "the transferred prompt counts as cached"
    sent = re.findall(r"wrote (\d+) blocks \((\d+) bytes\)", setup.prefill.log.read_text())
    received = re.findall(r"received (\d+) blocks \((\d+) bytes\)",
                          setup.decode.log.read_text())
    assert sent == received == [("6", str(6 * BLOCK_NBYTES))]


def test_a_prefill_killed_before_the_transfer_leaves_decode_computing(setup):
    prompt = prompt_tokens(PROMPT_LEN, 1)
    params = prefill_request(setup.prefill.generate, prompt, SAMPLING)
    assert params is not None and params["do_remote_prefill"]
    _kill(setup.prefill.child.proc)
    got = setup.decode.generate(prompt, SAMPLING, params)
    same_answer(got, setup.baseline[1])
    assert "not received" in setup.decode.log.read_text()
    assert got["num_cached_tokens"] == 0, "nothing was received: all of it was computed"
