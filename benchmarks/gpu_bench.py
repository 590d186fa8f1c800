#!/usr/bin/env python3
"""GPU memory through the engine, against the copy ceilings of the same GPU, one run.

Rows (two processes on one host, 64 MiB buffers, WRITE in 4 MiB requests, 16 per batch):
  cudaMemcpy D2D      cuda.copy device to device in this process (the cuda_ipc ceiling)
  cuda_ipc gpu->gpu   into the peer's device memory through its IPC handle
  tcp host->host      the host-memory baseline of the staged tcp rows
  tcp gpu->host       local device memory staged through pinned memory
  tcp gpu->gpu        staged on both sides (the peer's tcp server stages too)
  shm host->host      the host-memory baseline of the staged shm row
  shm gpu->host       local device memory staged, then process_vm
Goals (issue 23): cuda_ipc >= 0.8x D2D; staged tcp >= 0.8x host tcp.

Then one request's KV cache as vLLM keeps it on the GPU (issue 24; --kv-tokens, Llama-8B
shapes: 32 layers, 8 KV heads of 128, bf16, blocks of 16 tokens, flash attention's layout
per layer), saved to the store block by block (the store connector's gathered puts) and
loaded back into other blocks (its reads), with a holder process on this host (staged shm)
and over tcp only (staged tcp), against recomputing that prefill on the same GPU: one
Llama-8B layer (attention and MLP, random bf16 weights) timed on the prompt, times 32.
These rows need torch with CUDA; without it they are left out, saying so.
Needs a CUDA GPU (else one sentence and exit 2). Prints a table and writes
benchmarks/results/gpu_bench.json (or --out).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests" / "gpu"))

from mooncake_plugins.config import EngineConfig  # noqa: E402
from mooncake_plugins.transfer import TransferEngine, cuda  # noqa: E402
from mooncake_plugins.transfer.batch import OpCode, TransferRequest  # noqa: E402
from peers import TARGET, Target  # noqa: E402  (the GPU tests' target process)
from transfer_bench import log, write_results  # noqa: E402

MIB = 1 << 20
TOTAL = 64 * MIB
REQUEST = 4 * MIB


ROWS = [  # label, transports, local kind, remote kind
    ("cuda_ipc gpu->gpu", ["cuda_ipc"], "gpu", "gpu"),
    ("tcp host->host", ["tcp"], "host", "host"),
    ("tcp gpu->host", ["tcp"], "gpu", "host"),
    ("tcp gpu->gpu", ["tcp"], "gpu", "gpu"),
    ("shm host->host", ["shm"], "host", "host"),
    ("shm gpu->host", ["shm"], "gpu", "host"),
]


def d2d_gbps(duration_s: float) -> float:
    with cuda.DeviceBuffer(TOTAL) as a, cuda.DeviceBuffer(TOTAL) as b:
        cuda.copy(b.address, a.address, TOTAL)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < duration_s:
            cuda.copy(b.address, a.address, TOTAL)
            n += 1
        return n * TOTAL / (time.perf_counter() - t0) / 1e9


def row(transports: list[str], local_kind: str, remote_kind: str, duration_s: float) -> float:
    with Target(TARGET % (transports, TOTAL, remote_kind == "gpu")) as target, \
            TransferEngine(config=EngineConfig(transports=transports)) as eng:
        dev = cuda.DeviceBuffer(TOTAL) if local_kind == "gpu" else None
        host = bytearray(TOTAL)
        local = eng.register_address(dev.address, TOTAL).address if dev \
            else eng.register(host).address
        reqs = [TransferRequest(OpCode.WRITE, local + off, target.address + off, REQUEST)
                for off in range(0, TOTAL, REQUEST)]
        eng.submit(target.segment, reqs).wait(120)  # warm-up: connections, handles, buffers
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < duration_s:
            eng.submit(target.segment, reqs).wait(120)
            n += 1
        gbps = n * TOTAL / (time.perf_counter() - t0) / 1e9
        eng.unregister(local)
        if dev:
            dev.close()
    return gbps


LLAMA8B = {"layers": 32, "kv_heads": 8, "head": 128, "hidden": 4096, "heads": 32,
           "ffn": 14336, "block": 16}

HOLDER = textwrap.dedent("""
    import sys
    from mooncake_plugins.config import EngineConfig
    from mooncake_plugins.store.client import StoreClient
    from mooncake_plugins.transfer import TransferEngine
    engine = TransferEngine(config=EngineConfig(transports=%r))
    client = StoreClient(%r, global_segment_size=%d, engine=engine)
    print(engine.segment_name, 0, flush=True)
    sys.stdin.readline()   # the benchmark's "exit"
    client.close()
    engine.close()
    print("bye", flush=True)
""")


def prefill_seconds(torch, tokens: int, device: str, reps: int = 3) -> float:
    """One Llama-8B layer over ``tokens`` (QKV, causal GQA attention, O, SwiGLU MLP; random
    bf16 weights), median of ``reps`` after a warm-up, times the layer count."""
    m = LLAMA8B
    g = torch.Generator(device=device).manual_seed(0)
    def w(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16) * 0.02
    wq, wk, wv, wo = w(m["hidden"], m["hidden"]), w(m["hidden"], m["kv_heads"] * m["head"]), \
        w(m["hidden"], m["kv_heads"] * m["head"]), w(m["hidden"], m["hidden"])
    wg, wu, wd = w(m["hidden"], m["ffn"]), w(m["hidden"], m["ffn"]), w(m["ffn"], m["hidden"])
    x = w(tokens, m["hidden"])
    F = torch.nn.functional

    def layer():
        q = (x @ wq).view(tokens, m["heads"], m["head"]).transpose(0, 1)
        k = (x @ wk).view(tokens, m["kv_heads"], m["head"]).transpose(0, 1)
        v = (x @ wv).view(tokens, m["kv_heads"], m["head"]).transpose(0, 1)
        rep = m["heads"] // m["kv_heads"]
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0),
                                           v.repeat_interleave(rep, 0), is_causal=True)
        h = x + a.transpose(0, 1).reshape(tokens, m["hidden"]) @ wo
        return h + (F.silu(h @ wg) * (h @ wu)) @ wd

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    layer()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        layer()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * m["layers"]


def kv_rows(tokens: int, device: str = "cuda", reps: int = 3) -> list[dict]:
    """The KV of one ``tokens``-token request saved and loaded through the store, per
    holder path, and the recompute it replaces."""
    try:
        import torch
    except ImportError:
        log("KV rows left out: torch is not installed here")
        return []
    if device == "cuda" and not torch.cuda.is_available():
        log("KV rows left out: torch here has no CUDA")
        return []
    sys.path.insert(0, str(REPO / "integrations"))
    from mooncake_plugins.store.client import StoreClient
    from mooncake_plugins.store.master import MasterConfig
    from mooncake_plugins.store.server import MasterServer, ServerOptions
    from mooncake_vllm.cuda_fence import fence
    from mooncake_vllm.kv_layout import KVLayout

    m = LLAMA8B
    blocks = -(-tokens // m["block"])
    kv = {f"model.layers.{i}.self_attn": torch.randn(
        2, 2 * blocks, m["block"], m["kv_heads"], m["head"], dtype=torch.bfloat16, device=device)
        for i in range(m["layers"])}
    layout = KVLayout(kv, 2 * blocks)
    nbytes = blocks * layout.block_nbytes
    out = []
    server = MasterServer(MasterConfig(), ServerOptions(rpc_port=0))
    server.start()
    try:
        for label, transports in (("same-host holder (staged shm)", ["cuda_ipc", "shm", "tcp"]),
                                  ("holder over tcp (staged tcp)", ["tcp"])):
            log(f"KV {tokens} tokens, {label}")
            script = HOLDER % (transports, server.address, nbytes + (64 << 20))
            with Target(script), TransferEngine(config=EngineConfig(transports=transports)) as eng, \
                    StoreClient(server.address, global_segment_size=0, engine=eng) as client:
                for address, n, location in layout.regions:
                    client.register_buffer(address, n, location)
                keys = [f"{label}/{tokens}/{b}" for b in range(blocks)]
                after = fence(layout.cuda_devices)
                if after is not None:
                    after.wait()
                t0 = time.perf_counter()
                errors = client.batch_put_from_parts(keys, [layout.block_pieces(b)
                                                             for b in range(blocks)])
                save = time.perf_counter() - t0
                assert all(e is None for e in errors), errors[:3]
                loads = []
                for _ in range(reps):   # the first is a cold load: fresh lookup, fresh paths
                    t0 = time.perf_counter()
                    located = client.locate(keys)
                    got = client.batch_get_ranges_into(
                        located, [(j, 0, layout.block_pieces(blocks + j)) for j in range(blocks)])
                    loads.append(time.perf_counter() - t0)
                    assert got == [layout.block_nbytes] * blocks, got[:3]
                for name, t in kv.items():
                    assert torch.equal(t[:, blocks:], t[:, :blocks]), f"{name}: bytes differ"
                for address, _, _ in layout.regions:
                    client.unregister_buffer(address)
            out.append({"row": f"KV load {tokens} tok, {label}", "bytes": nbytes,
                        "save_s": save, "first_load_s": loads[0],
                        "load_s": sorted(loads)[len(loads) // 2],
                        "load_gbps": nbytes / sorted(loads)[len(loads) // 2] / 1e9,
                        "per_block_us": sorted(loads)[len(loads) // 2] / blocks * 1e6})
    finally:
        server.close()
    del kv
    log(f"recompute: one Llama-8B layer over {tokens} tokens, x{m['layers']}")
    out.append({"row": f"recompute {tokens} tok (Llama-8B shapes)",
                "recompute_s": prefill_seconds(torch, tokens, device)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=2.0, help="seconds per row")
    ap.add_argument("--out", default=str(HERE / "results" / "gpu_bench.json"))
    ap.add_argument("--kv-tokens", type=int, default=4096,
                    help="prompt length of the KV load rows (0: leave them out)")
    a = ap.parse_args()
    if not cuda.available():
        print(f"gpu_bench needs a CUDA GPU: {cuda.why_unavailable()}", file=sys.stderr)
        return 2
    rows = [{"row": "cudaMemcpy D2D", "gbps": d2d_gbps(a.duration)}]
    for label, transports, local_kind, remote_kind in ROWS:
        log(label)
        rows.append({"row": label, "gbps": row(transports, local_kind, remote_kind, a.duration)})
    by = {r["row"]: r["gbps"] for r in rows}
    ratios = {"cuda_ipc / D2D": by["cuda_ipc gpu->gpu"] / by["cudaMemcpy D2D"],
              "staged tcp gpu->host / tcp host->host": by["tcp gpu->host"] / by["tcp host->host"],
              "staged tcp gpu->gpu / tcp host->host": by["tcp gpu->gpu"] / by["tcp host->host"],
              "staged shm gpu->host / shm host->host": by["shm gpu->host"] / by["shm host->host"]}
    print(f"\n{'row':22} {'GB/s':>8}")
    for r in rows:
        print(f"{r['row']:22} {r['gbps']:8.2f}")
    for k, v in ratios.items():
        print(f"{k:40} {v:.2f}x")
    failed = None
    try:
        kv = kv_rows(a.kv_tokens) if a.kv_tokens > 0 else []
    except Exception as exc:   # keep the rows above: they are written all the same
        failed = f"KV rows failed: {exc!r}"
        print(failed, file=sys.stderr)
        kv = [{"row": "KV rows", "error": failed}]
    recompute = next((r["recompute_s"] for r in kv if "recompute_s" in r), None)
    if kv:
        print(f"\n{'KV of one request':48} {'save s':>7} {'first load s':>12} "
              f"{'load s':>7} {'GB/s':>6} {'us/block':>8} {'x recompute':>11}")
        for r in kv:
            if "error" in r:
                continue
            if "recompute_s" in r:
                print(f"{r['row']:48} {'':>7} {'':>12} {r['recompute_s']:7.3f}")
                continue
            r["x_recompute"] = recompute / r["load_s"] if recompute else None
            print(f"{r['row']:48} {r['save_s']:7.3f} {r['first_load_s']:12.3f} "
                  f"{r['load_s']:7.3f} {r['load_gbps']:6.2f} {r['per_block_us']:8.0f} "
                  f"{r['x_recompute'] or 0:10.1f}x")
    write_results(a.out, {"total": TOTAL, "request": REQUEST, "duration_s": a.duration,
                          "kv_tokens": a.kv_tokens, "device": cuda.device_name(0)}, rows,
                  {"ratios": ratios, "kv": kv})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
