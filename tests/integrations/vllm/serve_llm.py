"""Host one vLLM engine (CPU), optionally with a KV connector, and answer line by line.

    python serve_llm.py MODEL_DIR [--kv-config JSON] [--single-process] [--tp N]
                        [--max-model-len N]

Prints ``READY {}`` once the engine is up, then reads one JSON request per stdin line and
answers each with one JSON line:

* ``{"prompt": [token ids], "sampling": {SamplingParams kwargs}, "kv_transfer_params":
  {...} | null}``: the greedy tokens, their logprobs, ``num_cached_tokens``, the
  ``finish_reason``, the ``kv_transfer_params`` the engine returned (see
  ``examples/vllm_pd_proxy.py``) and the ``seconds`` the engine's ``generate`` took;
* ``{"reset_prefix_cache": true}``: empties vLLM's own prefix cache, so the next request
  for a prompt seen before asks the connector again; answers ``{"reset": bool}``.

``quit`` ends it. The engine is built as in ``run_llm.py``, so results compare with its
single-engine baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--kv-config", default="", help="KVTransferConfig fields as JSON")
    ap.add_argument("--single-process", action="store_true",
                    help="engine core and worker in this process (quicker to start)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args()
    # the protocol keeps fd 1 to itself; whatever else writes to stdout (e.g. the access
    # log of vLLM's in-tree Mooncake bootstrap server) goes to stderr
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    from run_llm import build_llm
    from vllm_pd_proxy import llm_generate

    llm = build_llm(args.model, args.kv_config, args.single_process, args.tp,
                    args.max_model_len)
    generate = llm_generate(llm)
    print("READY {}", file=reply, flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        req = json.loads(line)
        if req.get("reset_prefix_cache"):
            out = {"reset": bool(llm.reset_prefix_cache())}
        else:
            t0 = time.perf_counter()
            out = generate(req["prompt"], req["sampling"], req.get("kv_transfer_params"))
            out["seconds"] = time.perf_counter() - t0
        print(json.dumps(out), file=reply, flush=True)


if __name__ == "__main__":
    main()
