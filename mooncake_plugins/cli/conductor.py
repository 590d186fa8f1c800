"""``mooncake-sim``: replay a Mooncake trace through the Conductor's policies.

Prints a table of hit rate, TTFT/TBT percentiles, SLO attainment and rejections; with
``--capacity`` also the effective request capacity. ``--plot`` draws hit rate against
per-instance cache capacity and SLO attainment against rate scale; ``--json`` writes
everything. A progress bar goes to stderr when it is a terminal (``--quiet`` hides it).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from mooncake_plugins.cli._args import ArgumentParser
from mooncake_plugins.conductor.policies import POLICY_NAMES, Policy, Slo, make_policy
from mooncake_plugins.conductor.sim import (CapacityResult, ClusterConfig, SimResult,
                                            find_capacity, simulate)
from mooncake_plugins.conductor.traces import (BUNDLED_TRACES, TraceRequest,
                                              bundled_trace, load_trace)
from mooncake_plugins.errors import InvalidArgument

_CACHE_FACTORS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8)
_RATE_FACTORS = (0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="mooncake-sim",
        description="Replay a Mooncake JSONL trace on a simulated prefill/decode cluster.")
    parser.add_argument("trace", help="trace file (JSON Lines: timestamp, input_length, "
                                      "output_length, hash_ids; plain or gzipped), or the "
                                      "name of a trace shipped with the package: "
                                      f"{', '.join(BUNDLED_TRACES)}")
    parser.add_argument("--policy", choices=POLICY_NAMES, default="conductor",
                        help="scheduling policy (default: %(default)s)")
    parser.add_argument("--compare", action="store_true",
                        help="run every policy and print one row each")
    parser.add_argument("--prefill", type=int, default=8,
                        help="prefill instances (default: %(default)s)")
    parser.add_argument("--decode", type=int, default=4,
                        help="decode instances (default: %(default)s)")
    parser.add_argument("--cache-tokens", type=int, default=1_000_000,
                        help="KV cache per prefill instance, tokens (default: %(default)s)")
    parser.add_argument("--pool-tokens", type=int, default=0,
                        help="global KV pool (Mooncake Store), tokens; 0 = none "
                             "(default: %(default)s)")
    parser.add_argument("--max-batch", type=int, default=64,
                        help="decode batch size limit (default: %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=0, metavar="N",
                        help="the engines' --max-num-batched-tokens: prompts waiting at an "
                             "instance are prefilled together in steps of N tokens; 0 = one "
                             "after the other (default: %(default)s)")
    parser.add_argument("--ttft-slo-ms", type=float, default=30_000.0,
                        help="TTFT objective, ms (default: %(default)s)")
    parser.add_argument("--tbt-slo-ms", type=float, default=100.0,
                        help="TBT objective, ms (default: %(default)s)")
    parser.add_argument("--rate-scale", type=float, default=1.0,
                        help="arrival-rate multiplier; 2 replays the trace twice as fast "
                             "(default: %(default)s)")
    parser.add_argument("--no-early-reject", action="store_true",
                        help="conductor: serve every request")
    parser.add_argument("--no-migrate", action="store_true",
                        help="conductor: never pull prefixes from peer instances")
    parser.add_argument("--capacity", action="store_true",
                        help="also find the highest rate scale meeting --slo-target")
    parser.add_argument("--slo-target", type=float, default=0.9,
                        help="SLO attainment that defines capacity (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random policy (default: %(default)s)")
    parser.add_argument("--plot", metavar="PATH",
                        help="write a PNG: hit rate vs cache capacity, SLO attainment vs "
                             "rate scale")
    parser.add_argument("--json", metavar="PATH", help="write all results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging level on stderr (default: %(default)s)")
    return parser.parse_args(argv)


def _factory(args: argparse.Namespace, name: str, cluster: ClusterConfig,
             slo: Slo) -> Callable[[], Policy]:
    def build() -> Policy:
        return make_policy(name, cluster.cost, slo, seed=args.seed,
                           early_reject=not args.no_early_reject, migrate=not args.no_migrate)
    return build


def _table(results: Sequence[SimResult], capacities: dict[str, CapacityResult]) -> str:
    header = ["policy", "hit", "local", "TTFT p50 s", "p90", "p99", "TBT p50 ms", "p99",
              "SLO att", "rejected", "wall s"]
    if capacities:
        header += ["capacity x", "req/s"]
    rows = [header]
    for r in results:
        row = [r.policy, f"{r.hit_rate:.3f}", f"{r.local_hit_rate:.3f}", f"{r.ttft.p50:.2f}",
               f"{r.ttft.p90:.2f}", f"{r.ttft.p99:.2f}", f"{r.tbt.p50 * 1e3:.1f}",
               f"{r.tbt.p99 * 1e3:.1f}", f"{r.slo_attainment:.3f}", str(r.rejected),
               f"{r.wall_s:.2f}"]
        if capacities:
            cap = capacities[r.policy]
            lowest = min(scale for scale, _ in cap.probes)
            scale = f"{cap.rate_scale:.3g}" if cap.rate_scale else f"<{lowest:.3g}"
            row += [scale, f"{cap.requests_per_s:.2f}"]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(row, widths)))
                     for row in rows)


def _plot(path: str, cache_sweep: dict[str, list[tuple[int, float]]],
          rate_sweep: dict[str, list[tuple[float, float]]], slo_target: float,
          title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, points in cache_sweep.items():
        left.plot([c / 1e6 for c, _ in points], [h for _, h in points], marker="o", label=name)
    left.set_xscale("log", base=2)
    left.set_xlabel("KV cache per prefill instance (M tokens)")
    left.set_ylabel("cache hit rate (blocks)")
    left.set_ylim(0, 1)
    left.grid(True, alpha=0.3)
    left.legend()
    for name, points in rate_sweep.items():
        right.plot([s for s, _ in points], [a for _, a in points], marker="o", label=name)
    right.axhline(slo_target, color="grey", linestyle="--", linewidth=1)
    right.set_xlabel("rate scale (x trace arrival rate)")
    right.set_ylabel("SLO attainment")
    right.set_ylim(0, 1.02)
    right.grid(True, alpha=0.3)
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _jsonable(value: Any) -> Any:
    """Dataclasses to dicts and NaN/inf to None, so the output is strict JSON."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _run(args: argparse.Namespace, requests: list[TraceRequest]) -> dict[str, Any]:
    cluster = ClusterConfig(num_prefill=args.prefill, num_decode=args.decode,
                            cache_tokens=args.cache_tokens, pool_tokens=args.pool_tokens,
                            decode_max_batch=args.max_batch,
                            prefill_step_tokens=args.max_num_batched_tokens)
    slo = Slo(ttft_s=args.ttft_slo_ms / 1e3, tbt_s=args.tbt_slo_ms / 1e3)
    names = list(POLICY_NAMES) if args.compare else [args.policy]
    replays = len(names) * (1 + (len(_CACHE_FACTORS) + len(_RATE_FACTORS) if args.plot else 0))
    disable = args.quiet or not sys.stderr.isatty()
    total = None if args.capacity else replays * len(requests)
    results: list[SimResult] = []
    capacities: dict[str, CapacityResult] = {}
    cache_sweep: dict[str, list[tuple[int, float]]] = {}
    rate_sweep: dict[str, list[tuple[float, float]]] = {}
    with tqdm(total=total, unit="req", desc="replay", disable=disable, file=sys.stderr) as bar:
        for name in names:
            build = _factory(args, name, cluster, slo)
            bar.set_postfix_str(name)
            results.append(simulate(requests, build(), cluster, slo,
                                    rate_scale=args.rate_scale, progress=bar.update))
            if args.capacity:
                capacities[name] = find_capacity(requests, build, cluster, slo,
                                                 target=args.slo_target, progress=bar.update)
            if args.plot:
                cache_sweep[name] = []
                for factor in _CACHE_FACTORS:
                    tokens = int(args.cache_tokens * factor)
                    swept = dataclasses.replace(cluster, cache_tokens=tokens)
                    r = simulate(requests, build(), swept, slo, rate_scale=args.rate_scale,
                                 progress=bar.update)
                    cache_sweep[name].append((tokens, r.hit_rate))
                rate_sweep[name] = []
                for factor in _RATE_FACTORS:
                    scale = args.rate_scale * factor
                    r = simulate(requests, build(), cluster, slo, rate_scale=scale,
                                 progress=bar.update)
                    rate_sweep[name].append((scale, r.slo_attainment))
    print(_table(results, capacities))
    if args.plot:
        _plot(args.plot, cache_sweep, rate_sweep, args.slo_target,
              f"{args.trace.rsplit('/', 1)[-1]}: {args.prefill}P{args.decode}D, "
              f"SLO TTFT {args.ttft_slo_ms / 1e3:g} s / TBT {args.tbt_slo_ms:g} ms")
        print(f"plot written to {args.plot}", file=sys.stderr)
    return {"trace": args.trace, "cluster": cluster, "slo": slo, "results": results,
            "capacity": capacities, "cache_sweep": cache_sweep, "rate_sweep": rate_sweep}


def _trace_path(arg: str) -> str | os.PathLike[str]:
    """The trace file ``arg`` names: an existing file, else a bundled trace of that name."""
    if arg in BUNDLED_TRACES and not os.path.exists(arg):
        return bundled_trace(arg)
    return arg


def main(argv: list[str] | None = None) -> int:
    """Run ``mooncake-sim``; return the exit status (1 on a bad trace or argument)."""
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("error: --plot needs matplotlib: pip install 'mooncake_plugins[sim]'",
              file=sys.stderr)
        return 1
    try:
        requests = load_trace(_trace_path(args.trace))
        report = _run(args, requests)
    except (InvalidArgument, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as stream:
                json.dump(_jsonable(report), stream, indent=2)
        except OSError as exc:
            print(f"error: cannot write {args.json}: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
