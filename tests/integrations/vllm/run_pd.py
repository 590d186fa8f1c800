"""Host one vLLM engine (CPU) with a KV connector and answer generate requests.

    python run_pd.py MODEL_DIR --kv-config JSON

Prints ``READY {}`` once the engine is up, then reads one JSON request per stdin line,
``{"prompt": [token ids], "sampling": {SamplingParams kwargs}, "kv_transfer_params":
{...} | null}``, and answers each with one JSON line: the greedy tokens, their
logprobs, ``num_cached_tokens`` and the ``kv_transfer_params`` the engine returned
(see ``examples/vllm_pd_proxy.py``). ``quit`` ends it. The engine is built as in
``run_llm.py``, so results compare with its single-engine baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--kv-config", required=True, help="KVTransferConfig fields as JSON")
    args = ap.parse_args()
    # the protocol keeps fd 1 to itself; whatever else writes to stdout (e.g. the access
    # log of vLLM's in-tree Mooncake bootstrap server) goes to stderr
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm_pd_proxy import llm_generate

    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=2048, max_num_seqs=4, disable_hybrid_kv_cache_manager=True,
              kv_transfer_config=KVTransferConfig(**json.loads(args.kv_config)), seed=0)
    generate = llm_generate(llm)
    print("READY {}", file=reply, flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        req = json.loads(line)
        out = generate(req["prompt"], req["sampling"], req.get("kv_transfer_params"))
        print(json.dumps(out), file=reply, flush=True)


if __name__ == "__main__":
    main()
