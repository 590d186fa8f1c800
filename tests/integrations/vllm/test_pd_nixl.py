"""vLLM's own ``NixlConnector``, unchanged, with our NIXL backend: a prefill engine and a
decode engine in two processes, the decode pulling the prompt's KV blocks with NIXL READs
on ``"backends": ["MOONCAKE"]``, and answering as a single engine does. The same pair on
NIXL's UCX backend is the control.

NIXL is found by vLLM's processes through our ``vllm.general_plugins`` entry point, which
points ``NIXL_PLUGIN_DIR`` at our plugin directory: the engines here get no NIXL setting
beyond vLLM's own flags. Needs nixl 1.5.1 in this venv (``.ci/run`` installs it).
"""

from __future__ import annotations

import re
import warnings
from typing import Iterator

import pytest
from engines import MAX_TOKENS, PROMPT_LEN, SAMPLING, Engine, EngineSpec, engines_running, same_answer
from framework_fixtures import require_framework
from helpers import unclaimable_port
from run_llm import prompt_tokens

require_framework("nixl", "NIXL is not installed in this venv: .ci/run installs nixl 1.5.1 "
                          "into .venv-vllm")

pytestmark = pytest.mark.timeout(600)
BLOCK = 128  # vLLM's CPU block size, in tokens


def _spec(backend: str, name: str, core: str, role: str, port: int) -> EngineSpec:
    kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
          "engine_id": f"nixl-{backend}-{name}",
          "kv_connector_extra_config": {"backends": [backend]}}
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
           "NIXL_MOONCAKE_IP_ADDR": "127.0.0.1"}
    return EngineSpec(f"{backend}-{name}", kv, core, env)


@pytest.fixture(scope="module", params=["MOONCAKE", "UCX"])
def pair(request, tiny_llama, tmp_path_factory) -> Iterator[tuple[str, Engine, Engine]]:
    backend = request.param
    # side-channel ports below the ephemeral range: an engine starting beside them opens
    # its own sockets on port 0 and once took the other engine's port (CI, under load)
    specs = [_spec(backend, "decode", "1", "kv_consumer", unclaimable_port()),
             _spec(backend, "prefill", "0", "kv_producer", unclaimable_port())]
    with engines_running(tiny_llama, tmp_path_factory.mktemp(f"pd-nixl-{backend}"),
                         specs) as (decode, prefill):
        yield backend, prefill, decode


def nixl_failures(engine: Engine) -> list[str]:
    """vLLM's ``NIXL transfer failure`` lines in ``engine``'s log, each with the exception
    that ended its traceback, where one followed."""
    lines = engine.log_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        if "NIXL transfer failure" not in line:
            continue
        after = lines[i + 1:i + 60]
        if after and after[0].startswith("Traceback"):
            cause = next((a for a in after[1:] if a and not a[0].isspace()), "")
            line = f"{line} -> {cause}"
        found.append(line)
    return found


def disaggregated(prefill: Engine, decode: Engine, prompt: list[int]) -> tuple[dict, dict]:
    """The prompt's prefill on ``prefill``, then its decode on ``decode`` pulling the KV
    blocks: the prefill's ``kv_transfer_params`` (as sent to the decode) and the answer."""
    first = prefill.generate(prompt, {**SAMPLING, "max_tokens": 1}, {"do_remote_decode": True})
    params = dict(first["kv_transfer_params"])
    assert params["do_remote_prefill"] and params["remote_block_ids"]
    # vLLM 0.32 adds the prefill's own prefix hits here, and the decode would then report
    # them as its cached tokens: without it, num_cached_tokens counts what was pulled
    params.pop("remote_prefill_cached_tokens", None)
    return params, decode.generate(prompt, SAMPLING, params)


def test_nixl_connector_pulls_the_prompt_over_the_backend(pair, baseline):
    backend, prefill, decode = pair
    prompt = prompt_tokens(PROMPT_LEN, 0)
    logged_before = len(nixl_failures(decode))
    params, got = disaggregated(prefill, decode, prompt)
    failures = nixl_failures(decode)[logged_before:]
    if backend == "UCX" and not got["tokens"] and failures:
        # The control is vLLM's connector over NIXL's own UCX backend, none of our transfer
        # code in the path. It failed once in CI: the decode ended with no token after
        # 13 s, vLLM's log not kept (a pull that fails ends so; a side-channel handshake
        # that times out takes 5 s). It did not come back in 6 runs here, 4 of them beside
        # two busy loops: one retry, said aloud. Our backend gets none.
        warnings.warn(f"UCX control: the decode failed its pull once ({got['finish_reason']}, "
                      f"{got['seconds']:.1f} s), retried: {failures}")
        decode.reset_prefix_cache()
        prefill.reset_prefix_cache()
        params, got = disaggregated(prefill, decode, prompt)
    assert got["tokens"], (f"the decode answered nothing ({got['finish_reason']} after "
                           f"{got['seconds']:.1f} s); vLLM logged {nixl_failures(decode)}")
    same_answer(got, baseline[0])
    assert len(got["tokens"]) == MAX_TOKENS
    # every block of the prompt, the partial last one too, came from the prefill
    assert [len(group) for group in params["remote_block_ids"]] == [-(-PROMPT_LEN // BLOCK)]
    assert got["num_cached_tokens"] == PROMPT_LEN, "the decode computed the prompt itself"
    if backend == "MOONCAKE":  # our backend's engine served the decode's NIXL agent
        assert re.search(r"NIXL agent \S+: backend on segment 127\.0\.0\.1:\d+",
                         decode.log_text())
