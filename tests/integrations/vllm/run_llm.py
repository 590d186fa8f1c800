"""Run one vLLM engine (CPU) over a prompt and write what it produced as JSON.

    python run_llm.py MODEL_DIR OUT.json --prompt-len 641 [--kv-config JSON] [--single-process]

The prompt is deterministic (the same tokens in every process). The output holds each
request's greedy tokens, their logprobs, ``num_cached_tokens`` and the wall time of
``generate``. With ``--warmup``, a prompt shorter than one block runs first (vLLM's first
logprobs request of a process is slow), outside the timing. With ``--rounds R``, ``generate``
runs R times, each over its own distinct prompts (no prefix shared with another round);
``seconds`` is the first round's time, ``round_seconds`` all of them, and ``requests``
lists every round's requests in order. ``--prompt-lens 1025,4097`` runs one round per
length instead.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any


def prompt_tokens(n: int, seed: int = 0) -> list[int]:
    return [(i * 7919 + seed * 104729) % 1000 + 3 for i in range(n)]


def build_llm(model: str, kv_config: str = "", single_process: bool = False,
              tp: int = 1, max_model_len: int = 2048) -> Any:
    """The tests' engine: greedy-comparable settings, ``kv_config`` (JSON) as its KV
    connector. ``single_process`` runs the engine core and the worker in this process
    (one vLLM import instead of three: it starts in about half the time); ``tp`` > 1 runs
    that many tensor-parallel workers, each a process of its own."""
    if single_process and tp > 1:
        raise ValueError("tensor parallelism needs a worker process per rank")
    if single_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(**json.loads(kv_config)) if kv_config else None
    return LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
               max_model_len=max_model_len, max_num_seqs=4, disable_hybrid_kv_cache_manager=True,
               kv_transfer_config=kv, seed=0, tensor_parallel_size=tp,
               distributed_executor_backend="uni" if single_process else None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--prompt-len", type=int, default=641)
    ap.add_argument("--prompts", type=int, default=1, help="distinct prompts, one request each")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-config", default="", help="KVTransferConfig fields as JSON")
    ap.add_argument("--warmup", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="timed generate calls")
    ap.add_argument("--prompt-lens", default="",
                    help="comma-separated: round r's prompts have the r-th length "
                         "(replaces --prompt-len and --rounds)")
    ap.add_argument("--single-process", action="store_true",
                    help="engine core and worker in this process (quicker to start)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    args = ap.parse_args()

    lens = ([int(n) for n in args.prompt_lens.split(",")] if args.prompt_lens
            else [args.prompt_len] * args.rounds)
    longest = max(lens) + args.max_tokens
    llm = build_llm(args.model, args.kv_config, args.single_process, args.tp,
                    max(2048, -(-longest // 1024) * 1024))
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=1,
                            detokenize=False, ignore_eos=True)
    if args.warmup:
        llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], params, use_tqdm=False)
    outs, rounds = [], []
    for r, length in enumerate(lens):
        prompts = [TokensPrompt(prompt_token_ids=prompt_tokens(length, s))
                   for s in range(r * args.prompts, (r + 1) * args.prompts)]
        t0 = time.perf_counter()
        outs += llm.generate(prompts, params, use_tqdm=False)
        rounds.append(time.perf_counter() - t0)
    result = {"seconds": rounds[0], "round_seconds": rounds, "requests": []}
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
