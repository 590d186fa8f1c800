#!/usr/bin/env python3
"""vLLM's NixlConnector on CPU: the decode's time to first token with our NIXL backend
(MOONCAKE) and with NIXL's UCX backend, one run.

Run with the vLLM venv's python, which has nixl 1.5.1 (``.ci/run`` installs it)::

    .venv-vllm/bin/python benchmarks/vllm_nixl_bench.py

Two prefill/decode pairs of vLLM engines run side by side, one per backend, each engine a
long-lived ``serve_llm.py`` process (the same random-weight Llama as vllm_bench.py: prefill
dominates on a CPU). Per prompt, each pair in turn (the first rotating, so this VM's drift
hits both alike): the prefill computes the prompt and one token (``do_remote_decode``),
then the decode is sent the prefill's ``kv_transfer_params``: its ``generate`` time is the
time to first token of a disaggregated request, the KV pulled with NIXL READs. The
decode's ``num_cached_tokens`` is checked to equal the prompt (every block pulled). The
first prompt of each pair is its first contact (handshake, metadata, first transfer).
Prints a table; writes benchmarks/results/vllm_nixl_bench.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vllm_bench import QUIET_S, Served, random_llama  # noqa: E402  (puts the engines on the path)
from run_llm import prompt_tokens  # noqa: E402
from transfer_bench import log, write_results  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

BACKENDS = ("UCX", "MOONCAKE")


class Pair:
    """A prefill engine and a decode engine with the NixlConnector on one backend."""

    def __init__(self, backend: str, model: str, a: argparse.Namespace) -> None:
        self.backend = backend
        self.engines: list[Served] = []
        for role, name in (("kv_producer", "prefill"), ("kv_consumer", "decode")):
            kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
                  "engine_id": f"{backend}-{name}",
                  "kv_connector_extra_config": {"backends": [backend]}}
            env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                   "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                   "NIXL_MOONCAKE_IP_ADDR": "127.0.0.1"}
            log(f"{backend}: {name} engine starting")
            self.engines.append(Served(f"{backend}-{name}", model, a, kv, env))
        self.prefill, self.decode = self.engines

    @staticmethod
    def ask(engine: Served, prompt: list[int], params: dict | None) -> dict:
        sampling = {"max_tokens": 1, "temperature": 0.0, "logprobs": 1, "detokenize": False,
                    "ignore_eos": True}
        engine.proc.stdin.write(json.dumps({"prompt": prompt, "sampling": sampling,
                                            "kv_transfer_params": params}) + "\n")
        engine.proc.stdin.flush()
        line = engine.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{engine.name} died:\n{engine.log_tail()}")
        return json.loads(line)

    def request(self, prompt: list[int]) -> dict:
        t0 = time.perf_counter()
        first = self.ask(self.prefill, prompt, {"do_remote_decode": True})
        prefill_s = time.perf_counter() - t0
        params = dict(first["kv_transfer_params"])
        params.pop("remote_prefill_cached_tokens", None)  # see tests/integrations/vllm
        time.sleep(QUIET_S)
        t0 = time.perf_counter()
        got = self.ask(self.decode, prompt, params)
        ttft = time.perf_counter() - t0
        if got["num_cached_tokens"] != len(prompt):
            raise RuntimeError(f"{self.backend}: the decode pulled {got['num_cached_tokens']} "
                               f"of {len(prompt)} tokens")
        return {"prefill_s": prefill_s, "decode_ttft_s": ttft, "tokens": got["tokens"]}

    def close(self) -> None:
        for e in self.engines:
            e.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-lens", default="1025,4097")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--omp-bind", choices=("all", "vllm"), default="all")
    ap.add_argument("--out", default=str(HERE / "results" / "vllm_nixl_bench.json"))
    a = ap.parse_args()
    a.lens = [int(n) for n in a.prompt_lens.split(",")]
    a.max_tokens = 1
    model = random_llama(a.hidden, a.layers)
    pairs: list[Pair] = []
    raw: dict[str, dict[int, list[dict]]] = {b: {n: [] for n in a.lens} for b in BACKENDS}
    try:
        for backend in BACKENDS:
            pairs.append(Pair(backend, model, a))
        turn = 0
        for n in a.lens:
            for r in range(a.repeats):
                prompt = prompt_tokens(n, 1000 * n + r)
                order = pairs[turn % 2:] + pairs[:turn % 2]
                turn += 1
                answers = []
                for pair in order:
                    log(f"{pair.backend}: {n} tokens, prompt {r}")
                    out = pair.request(prompt)
                    raw[pair.backend][n].append(out)
                    answers.append(out.pop("tokens"))
                    time.sleep(QUIET_S)
                if answers[0] != answers[1]:
                    raise RuntimeError("the two backends' decodes answered differently")
    finally:
        for pair in pairs:
            pair.close()
        shutil.rmtree(model, ignore_errors=True)
    rows = []
    print(f"\n{'prompt':>7} {'backend':9} {'first TTFT':>11} {'median TTFT':>12} "
          f"{'prefill':>8} {'UCX/ours':>9}")
    for n in a.lens:
        med = {b: statistics.median(x["decode_ttft_s"] for x in raw[b][n]) for b in BACKENDS}
        for b in BACKENDS:
            runs = raw[b][n]
            row = {"prompt_tokens": n, "backend": b, "first_ttft_s": runs[0]["decode_ttft_s"],
                   "median_ttft_s": med[b],
                   "median_prefill_s": statistics.median(x["prefill_s"] for x in runs)}
            ratio = med["UCX"] / med[b] if b == "MOONCAKE" else None
            row["ucx_over_ours"] = ratio
            rows.append(row)
            print(f"{n:>7} {b:9} {row['first_ttft_s'] * 1e3:9.1f}ms {med[b] * 1e3:10.1f}ms "
                  f"{row['median_prefill_s']:7.2f}s {f'{ratio:.2f}x' if ratio else '':>9}")
    write_results(a.out, {"lens": a.lens, "repeats": a.repeats, "hidden": a.hidden,
                          "layers": a.layers, "omp_bind": a.omp_bind}, rows, raw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
