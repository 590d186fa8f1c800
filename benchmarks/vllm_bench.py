#!/usr/bin/env python3
"""vLLM on CPU with a KV store connector: the save path and the hit path, one run.

Run with the vLLM venv's python (``.ci/run`` makes ``.venv-vllm``)::

    .venv-vllm/bin/python benchmarks/vllm_bench.py

The model is a random-weight Llama large enough that prefill dominates on a CPU
(``--hidden`` 1024, ``--layers`` 8, 16 heads, 4 KV heads). Each variant gets a fresh
master and a holder process (its segment holds every prompt's KV with room to spare, so
nothing is evicted: the KV outlives the engines). Engine A (a fresh process) generates one
token for ``--repeats`` distinct prompts of each length of ``--prompt-lens`` (1k, 4k and
16k tokens), one ``generate`` each, and saves their blocks; the variants' engines A run one
after another (the save path column). Then every variant's engine B (another fresh
process, kept running) is sent the same prompts: its ``generate`` time is the time to
first token with a store hit, the no-connector engine's is the recompute time. The engines
B take turns on each prompt, the first of them rotating, so that this VM's drift (the
same copy measured 2-3x slower an hour apart) hits every variant alike instead of whichever
ran last. All engines warm up with a prompt shorter than one block (nothing is saved or
loaded), so the timed ``generate`` is the connector's path, not vLLM's first-call cost.
Per length, the first hit is the engine's first of that length (at the first length: its
first contact with the holder) and the median is over the repeats.

Every engine binds its compute threads to the same cores (``--omp-bind all``: every core,
through ``VLLM_CPU_OMP_THREADS_BIND``). Left to itself (``--omp-bind vllm``), vLLM keeps one
core more for itself when a KV connector is configured, so on two cores the engine without
a connector computes with one thread and those with one with two: an unfair recompute
baseline (it measured 2x slower).
Variants: no connector; our ``MooncakePluginsStoreConnector``; vLLM's in-tree
``MooncakeStoreConnector`` on our drop-in ``mooncake`` package; the same in-tree connector on
the original wheel (``mooncake-transfer-engine-non-cuda==0.3.13.post1``, its own master and
holder from benchmarks/.venv-orig, its Python modules put first on the engines' path).
``--variants`` picks the variants to run (e.g. ``none,ours``). Prints a table; writes
benchmarks/results/vllm_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from compat_bench import start_master  # noqa: E402
from store_bench import spawn, stop_all  # noqa: E402
from transfer_bench import ensure_original, log, write_results  # noqa: E402

ENGINES = ROOT / "tests" / "integrations" / "vllm"
RUN_LLM = str(ENGINES / "run_llm.py")
SERVE_LLM = str(ENGINES / "serve_llm.py")
sys.path.insert(0, str(ENGINES))
from run_llm import prompt_tokens  # noqa: E402
WORKLOAD = str(HERE / "compat_workload.py")
ORIG_MODULES = HERE / ".orig-mooncake"   # the original wheel's files, for the vLLM venv
ORIG_WHEEL = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
VARIANTS = ("none", "ours", "in-tree on ours", "in-tree on original")


HEAD_DIM = 64
KV_HEADS = 4
CPU_BLOCK = 128   # vLLM's block size on CPU
QUIET_S = 1.5     # between engines' turns: longer than an idle vLLM worker spins (1 s)


def random_llama(hidden: int, layers: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM
    import torch

    d = tempfile.mkdtemp(prefix="vllm-bench-model-")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        hidden_size=hidden, intermediate_size=4 * hidden,
        num_attention_heads=hidden // HEAD_DIM, num_key_value_heads=KV_HEADS,
        num_hidden_layers=layers, vocab_size=1024, max_position_embeddings=32768,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)).save_pretrained(d)
    return d


def engine_env(a: argparse.Namespace, rpc: str, env: dict) -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_RPC_BASE_PATH": rpc, **omp_env(a), **env}


def run_engine(model: str, a: argparse.Namespace, kv: dict | None, env: dict) -> dict:
    """Engine A: one process over every length's prompts (``run_llm.py``), then exits."""
    out = tempfile.mktemp(suffix=".json")
    rpc = tempfile.mkdtemp(prefix="vllm-rpc-")
    lens = ",".join(str(n) for n in a.lens for _ in range(a.repeats))
    cmd = [sys.executable, RUN_LLM, model, out, "--prompt-lens", lens,
           "--max-tokens", str(a.max_tokens), "--warmup"]
    if kv:
        cmd += ["--kv-config", json.dumps(kv)]
    try:
        p = subprocess.run(cmd, cwd=tempfile.gettempdir(), capture_output=True, text=True,
                           timeout=3600, env=engine_env(a, rpc, env))
        if p.returncode:
            raise RuntimeError(f"engine failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
        return json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(rpc, ignore_errors=True)
        Path(out).unlink(missing_ok=True)


class Served:
    """Engine B: a long-lived engine process (``serve_llm.py``) answering one prompt at a
    time, so that the variants' engines take turns and machine drift hits them alike."""

    def __init__(self, name: str, model: str, a: argparse.Namespace, kv: dict | None,
                 env: dict) -> None:
        self.name = name
        self.rpc = tempfile.mkdtemp(prefix="vllm-rpc-")
        self.log = tempfile.NamedTemporaryFile(prefix="vllm-bench-", suffix=".log", delete=False)
        cmd = [sys.executable, SERVE_LLM, model,
               "--max-model-len", str(-(-(max(a.lens) + a.max_tokens) // 1024) * 1024)]
        if kv:
            cmd += ["--kv-config", json.dumps(kv)]
        self.proc = spawn(cmd, cwd=tempfile.gettempdir(), stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=self.log, text=True,
                          env=engine_env(a, self.rpc, env))
        if not self.proc.stdout.readline().startswith("READY"):
            self.close()
            raise RuntimeError(f"{name}: engine B did not start:\n{self.log_tail()}")
        self.ask([5, 6, 7], a.max_tokens)   # warm-up: shorter than a block, nothing stored

    def ask(self, prompt: list[int], max_tokens: int) -> dict:
        sampling = {"max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1,
                    "detokenize": False, "ignore_eos": True}
        self.proc.stdin.write(json.dumps({"prompt": prompt, "sampling": sampling}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: engine B died:\n{self.log_tail()}")
        return json.loads(line)

    def log_tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def close(self) -> None:
        """End the engine and every process it started (its engine core and worker)."""
        try:
            self.proc.stdin.close()   # serve_llm.py shuts vLLM down at end of input
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # spawn() made it a group leader
        except ProcessLookupError:
            pass
        self.proc.wait()
        shutil.rmtree(self.rpc, ignore_errors=True)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def segment_bytes(a: argparse.Namespace) -> int:
    """The holder's segment: room for every prompt's KV with a margin, so that nothing is
    evicted before engine B reads it (at least 1 GiB)."""
    tokens = sum(a.lens) * a.repeats
    kv = tokens * 2 * KV_HEADS * HEAD_DIM * 4 * a.layers   # K and V, fp32
    return max(1 << 30, -(-kv * 3 // 2 // (1 << 30)) * (1 << 30))


def omp_env(a: argparse.Namespace) -> dict[str, str]:
    """The compute-thread binding every engine gets (none: vLLM's own choice)."""
    if a.omp_bind == "vllm":
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0))))}


def start_store(name: str, system: str, a: argparse.Namespace,
                procs: list[subprocess.Popen]) -> tuple[dict, dict[str, str]]:
    """A fresh master and holder of ``system`` (added to ``procs``); the KV connector
    config and environment of variant ``name`` against them."""
    py = sys.executable if system == "ours" else str(ensure_original())
    master, address, metadata = start_master(system, py)
    procs.append(master)
    holder = spawn([py, WORKLOAD, "--master", address, "--metadata", metadata,
                    "--role", "holder", "--segment", str(segment_bytes(a))],
                   cwd=tempfile.gettempdir(), stdin=subprocess.PIPE,
                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                   env={**os.environ, "GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"})
    procs.append(holder)
    if not holder.stdout.readline().startswith(b"READY"):
        raise RuntimeError(f"{system} holder did not start")
    if name == "ours":
        return ({"kv_connector": "MooncakePluginsStoreConnector", "kv_role": "kv_both",
                 "kv_load_failure_policy": "recompute",
                 "kv_connector_extra_config": {"master_server_address": address,
                                               "global_segment_size": 0}}, {})
    conf = Path(tempfile.mkdtemp(prefix="vllm-bench-")) / "mooncake.json"
    conf.write_text(json.dumps({
        "metadata_server": metadata, "master_server_address": address,
        "protocol": "tcp", "device_name": "", "mode": "standalone-store",
        "global_segment_size": 0, "local_buffer_size": "1GB"}))
    env = {"MOONCAKE_CONFIG_PATH": str(conf), "GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}
    if system == "original":
        env["PYTHONPATH"] = str(ORIG_MODULES)
    return ({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
             "kv_load_failure_policy": "recompute"}, env)


def hit_rounds(engines: list[Served], a: argparse.Namespace) -> dict[str, dict]:
    """Every engine B over the same prompts as the engines A, in ``run_llm.py``'s order
    (length by length, ``--repeats`` each); the engines take turns on each prompt, the
    first of them rotating, so none always goes first after another's work. Each turn
    starts ``QUIET_S`` after the last one ended: a vLLM worker spins on its message queue
    for a second after each step, and a neighbour's spinning cost the engine computing
    next about 0.4 s per request (measured), a cost no engine has when it runs alone."""
    out = {e.name: {"round_seconds": [], "requests": []} for e in engines}
    for i, length in enumerate(a.lens):
        for r in range(a.repeats):
            seed = i * a.repeats + r   # the prompt engine A's round of this index saved
            turn = engines[r % len(engines):] + engines[:r % len(engines)]
            for e in turn:
                time.sleep(QUIET_S)
                reply = e.ask(prompt_tokens(length, seed), a.max_tokens)
                out[e.name]["round_seconds"].append(reply.pop("seconds"))
                out[e.name]["requests"].append(reply)
            log(f"hits at {length} tokens, prompt {r + 1} of {a.repeats}: " + ", ".join(
                f"{n} {o['round_seconds'][-1]:.3f} s" for n, o in out.items()))
    return out


def ensure_original_modules() -> bool:
    if (ORIG_MODULES / "mooncake" / "store.so").exists():
        return True
    log(f"installing {ORIG_WHEEL}'s files into {ORIG_MODULES} ...")
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(ORIG_MODULES), ORIG_WHEEL], capture_output=True, text=True)
    if p.returncode:
        log(f"original wheel unavailable: {p.stderr[-500:]}")
    return p.returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-lens", default="1025,4097,16385",
                    help="comma-separated prompt lengths (CPU blocks are 128 tokens)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="distinct prompts of each length, one generate each")
    ap.add_argument("--omp-bind", choices=("all", "vllm"), default="all",
                    help="compute threads on every core for every engine, or vLLM's choice")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--skip-original", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--out", default=str(HERE / "results" / "vllm_bench.json"))
    a = ap.parse_args()
    chosen = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = sorted(set(chosen) - set(VARIANTS))
    try:
        lens = [int(n) for n in a.prompt_lens.split(",")]
    except ValueError:
        lens = []
    if unknown or not lens or min(lens) < 2 or a.hidden % HEAD_DIM or a.repeats < 1:
        ap.error(f"unknown variants {unknown}" if unknown else
                 f"--hidden must be a multiple of {HEAD_DIM}" if a.hidden % HEAD_DIM else
                 "--repeats must be at least 1" if a.repeats < 1 else
                 "--prompt-lens: comma-separated lengths of at least 2 tokens")
    a.lens = lens
    model = random_llama(a.hidden, a.layers)
    results: dict[str, dict] = {}
    procs: list[subprocess.Popen] = []
    engines: list[Served] = []
    try:
        plan = [(n, "ours") for n in ("ours", "in-tree on ours") if n in chosen]
        if ("in-tree on original" in chosen and not a.skip_original and ensure_original()
                and ensure_original_modules()):
            plan.append(("in-tree on original", "original"))
        configs = {}
        for name, system in plan:   # engines A, one after another, each to its own store
            configs[name] = start_store(name, system, a, procs)
            log(f"{name}: engine A (computes and saves)")
            results[name] = {"save": run_engine(model, a, *configs[name])}
        if "none" in chosen:
            configs = {"none": (None, {}), **configs}
        for name, (kv, env) in configs.items():
            log(f"{name}: engine B starting")
            engines.append(Served(name, model, a, kv, env))
        results = {name: {**results.get(name, {}), "hit": hit}   # in the engines' order
                   for name, hit in hit_rounds(engines, a).items()}
    finally:
        for e in engines:
            e.close()
        stop_all(procs)
        shutil.rmtree(model, ignore_errors=True)

    def per_length(run: dict, i: int) -> tuple[list[float], list[dict]]:
        """Round seconds and requests of the ``i``-th length's repeats."""
        first = i * a.repeats
        return (run["round_seconds"][first:first + a.repeats],
                run["requests"][first:first + a.repeats])

    rows, short = [], []
    print(f"\n{os.cpu_count()} cores, compute threads: {omp_env(a) or 'vLLM default'}; "
          f"random Llama (hidden {a.hidden}, {a.layers} layers, {KV_HEADS} KV heads x "
          f"{HEAD_DIM}, fp32); {a.repeats} distinct prompts per length, "
          f"max_tokens {a.max_tokens}; generate seconds after a warm-up, fresh engine "
          "processes; hit = engine B (loads; the variants' engines B take turns on each "
          "prompt): its first generate of the length and the median; save = engine A "
          "(computes and saves; one variant after another), median")
    print("\n| prompt tokens | connector | save path (s) | hit, first (s) | hit, median (s) | "
          "median vs recompute | cached tokens | tokens = no connector |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for i, length in enumerate(lens):
        base = per_length(results["none"]["hit"], i) if "none" in results else None
        for name, r in results.items():
            hits, reqs = per_length(r["hit"], i)
            save_s = statistics.median(per_length(r["save"], i)[0]) if "save" in r else None
            hit_s = statistics.median(hits)
            cached = sum(q["num_cached_tokens"] for q in reqs)
            same = (None if base is None else
                    [q["tokens"] for q in reqs] == [q["tokens"] for q in base[1]])
            speedup = (None if base is None or name == "none" else
                       statistics.median(base[0]) / hit_s)
            rows.append({"prompt_len": length, "connector": name, "save_s": save_s,
                         "hit_first_s": hits[0], "hit_s": hit_s, "hit_speedup": speedup,
                         "cached_tokens": cached, "prompt_tokens": length * len(reqs),
                         "same_tokens": same})
            print(f"| {length} | {name} | {'' if save_s is None else f'{save_s:.3f}'} | "
                  f"{hits[0]:.3f} | {hit_s:.3f} | "
                  f"{'' if speedup is None else f'{speedup:.0f}x'} | {cached} | "
                  f"{'n/a' if same is None else 'yes' if same else 'NO'} |")
            full = (length - 1) // CPU_BLOCK * CPU_BLOCK * len(reqs)
            if name != "none" and cached < full:
                short.append(f"{name} at {length} tokens loaded {cached} of {full} "
                             "full-block tokens: its hit times include recompute")
    for line in short:
        print(f"WARNING: {line}")
    write_results(a.out, vars(a), rows, results)


if __name__ == "__main__":
    main()
