"""Run one vLLM engine (CPU) over a prompt and write what it produced as JSON.

    python run_llm.py MODEL_DIR OUT.json --prompt-len 641 [--kv-config JSON]

The prompt is deterministic (the same tokens in every process). The output holds each
request's greedy tokens, their logprobs, ``num_cached_tokens`` and the wall time of
``generate``. With ``--warmup``, a prompt shorter than one block runs first (vLLM's first
logprobs request of a process is slow), outside the timing.
"""

from __future__ import annotations

import argparse
import json
import time


def prompt_tokens(n: int, seed: int = 0) -> list[int]:
    return [(i * 7919 + seed * 104729) % 1000 + 3 for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--prompt-len", type=int, default=641)
    ap.add_argument("--prompts", type=int, default=1, help="distinct prompts, one request each")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-config", default="", help="KVTransferConfig fields as JSON")
    ap.add_argument("--warmup", action="store_true")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = KVTransferConfig(**json.loads(args.kv_config)) if args.kv_config else None
    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=2048, max_num_seqs=4, disable_hybrid_kv_cache_manager=True,
              kv_transfer_config=kv, seed=0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=1,
                            detokenize=False, ignore_eos=True)
    if args.warmup:
        llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], params, use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=prompt_tokens(args.prompt_len, s))
               for s in range(args.prompts)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    result = {"seconds": seconds, "requests": []}
    for o in outs:
        c = o.outputs[0]
        result["requests"].append({
            "tokens": list(c.token_ids),
            "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
            "num_cached_tokens": o.num_cached_tokens,
        })
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
