"""``mooncake-conductor serve``: the Conductor as a router in front of vLLM instances;
``mooncake-conductor calibrate``: its cost model fitted to running engines (prefill,
decode step, a P/D pair's KV handoff, loads from the shared store).

    mooncake-conductor serve --instance http://127.0.0.1:8100 --instance http://127.0.0.1:8200 \\
        --policy conductor --slo-ttft 2 --slo-tbt 0.1 --port 8000

An instance is ``URL`` (an ordinary engine) or ``URL@prefill`` / ``URL@decode`` (a P/D
pair's sides); ``--config FILE`` takes ``{"instances": [{"url": ..., "role": ...}]}`` too.
Instances can be added, drained and removed while it runs (``/instances``). Clients talk
to it as to vLLM's OpenAI server.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING

from mooncake_plugins.cli._args import ArgumentParser, install_hint, port
from mooncake_plugins.conductor.costmodel import CostModel
from mooncake_plugins.conductor.policies import POLICY_NAMES, Slo, make_policy
from mooncake_plugins.errors import InvalidArgument

if TYPE_CHECKING:
    from mooncake_plugins.conductor.router.store_view import StoreView


def _instance(text: str) -> tuple[str, str, str | None]:
    """``URL[@ROLE][,events=ENDPOINT]``."""
    head, _, opts = text.partition(",")
    url, _, role = head.partition("@")
    events = None
    if opts:
        key, _, events = opts.partition("=")
        if key != "events" or not events:
            raise argparse.ArgumentTypeError(f"expected URL[@ROLE][,events=tcp://HOST:PORT], "
                                             f"got {text!r}")
    return url, role or "both", events


def _store_args(parser: argparse.ArgumentParser, use: str) -> None:
    """The flags of the engines' block size and of the shared store's view."""
    parser.add_argument("--block-tokens", type=int, default=16,
                        help="tokens per KV block: the engines' --block-size")
    parser.add_argument("--store", metavar="HOST:PORT", help="our master's RPC address, or "
                        "etcd://HOST:PORT of an HA group (its leader is followed): " + use)
    parser.add_argument("--store-cluster-id", default="mooncake",
                        help="the HA group's --cluster_id (with --store etcd://...)")
    parser.add_argument("--store-poll", action="store_true",
                        help="ask the master per request even where it publishes KV events "
                        "(by default they are followed: no call per request)")
    parser.add_argument("--store-hash-algo", default="sha256",
                        help="the engines' --prefix-caching-hash-algo (sha256, sha256_cbor)")
    parser.add_argument("--store-hash-seed", help="the engines' PYTHONHASHSEED, if set")
    parser.add_argument("--store-lmcache-chunk-size", type=int, metavar="N",
                        help="the engines run LMCache on the store with this chunk_size: "
                        "price its chunks too")
    parser.add_argument("--store-lmcache-hash", default="builtin",
                        help="LMCache's pre_caching_hash_algorithm (builtin, sha256, "
                        "sha256_cbor; builtin inside vLLM needs --store-hash-seed)")
    parser.add_argument("--store-lmcache-outside-vllm", action="store_true",
                        help="LMCache runs without vLLM (SGLang, standalone): its chunk "
                        "hashes start from 0, with Python's hash")


def _store_view(args: argparse.Namespace, rediscover_s: float = 30.0) -> "StoreView | None":
    """The store's view the flags name (None without ``--store``)."""
    if not args.store:
        return None
    from mooncake_plugins.conductor.router.lmcache_hashes import LmcacheChunkHashes
    from mooncake_plugins.conductor.router.store_view import StoreView
    from mooncake_plugins.conductor.router.vllm_hashes import VllmBlockHashes

    lmcache = None if args.store_lmcache_chunk_size is None else LmcacheChunkHashes(
        args.store_lmcache_chunk_size, args.store_lmcache_hash, args.store_hash_seed,
        in_vllm=not args.store_lmcache_outside_vllm)
    return StoreView(args.store, VllmBlockHashes(args.block_tokens, args.store_hash_algo,
                                                 args.store_hash_seed),
                     rediscover_s=rediscover_s, cluster_id=args.store_cluster_id,
                     lmcache=lmcache, events=not args.store_poll)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="mooncake-conductor",
                            description="The Conductor: a KV-cache-aware router for vLLM.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="route OpenAI requests over vLLM instances")
    serve.add_argument("--instance", action="append", default=[], type=_instance,
                       metavar="URL[@ROLE][,events=ENDPOINT]", help="a vLLM OpenAI "
                       "server; ROLE: both (default), prefill or decode; ENDPOINT: where it "
                       "publishes KV events (its --kv-events-config endpoint)")
    serve.add_argument("--config", help="JSON file: {\"instances\": [{\"url\", \"role\", "
                       "\"kv_events\"}]}")
    serve.add_argument("--policy", choices=POLICY_NAMES, default="conductor")
    serve.add_argument("--slo-ttft", type=float, default=30.0, help="TTFT objective, s")
    serve.add_argument("--slo-tbt", type=float, default=0.1, help="TBT objective, s")
    serve.add_argument("--no-ttft-correction", action="store_true",
                       help="price with the cost model as it is, not scaled per instance "
                       "by the measured / predicted TTFT of its streamed requests")
    serve.add_argument("--decision-headers", action="store_true",
                       help="name in each answer's X-Conductor-Prefill, -Decode and "
                       "-Predicted-TTFT headers the instances chosen and the TTFT estimate "
                       "(they show clients the engines' addresses)")
    serve.add_argument("--no-early-reject", action="store_true",
                       help="conductor: serve every request even when predicted late")
    serve.add_argument("--slo-quantile", type=float, metavar="Q",
                       help="conductor: also refuse where the estimate times the Q quantile "
                       "of recent measured/estimated TTFT ratios breaks the TTFT SLO (e.g. "
                       "0.9; default: the estimate alone)")
    serve.add_argument("--cost-model", help="JSON file of CostModel fields (a calibration)")
    serve.add_argument("--decode-max-batch", type=int, default=256,
                       help="the engines' --max-num-seqs")
    serve.add_argument("--max-num-batched-tokens", type=int, metavar="N",
                       help="the engines' --max-num-batched-tokens (vLLM's default: 2048 on "
                       "CPUs and most GPUs, 8192 on H100/H200, 16384 on B200): prompts "
                       "waiting together are prefilled in steps of N tokens, and a request's "
                       "first token comes with the later prompts that fill its last step "
                       "(default: priced one prompt after the other)")
    serve.add_argument("--cache-blocks", type=int, default=1 << 20,
                       help="blocks remembered per instance (least recently routed dropped)")
    serve.add_argument("--tokenizer", help="Hugging Face tokenizer of the model, for exact "
                       "prompt lengths (else about 4 bytes a token)")
    _store_args(serve, "prompts whose blocks the store holds (our vLLM store connector's "
                "keys) are priced as loads from it; needs token-id prompts or --tokenizer")
    serve.add_argument("--retries", type=int, default=2,
                       help="other instances tried when one cannot be reached")
    serve.add_argument("--health-interval", type=float, default=2.0)
    serve.add_argument("--health-timeout", type=float, default=2.0,
                       help="an instance whose /health times out 3 times in a row is taken "
                       "out (one that refuses or fails, at once)")
    serve.add_argument("--kv-events-timeout", type=float, default=30.0,
                       help="forget an instance's cache when its KV events stop this long "
                            "while it serves")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=port, default=8000)
    serve.add_argument("--log-level", default="INFO")
    cal = sub.add_parser("calibrate", help="fit the cost model to a running engine and write "
                         "it as JSON (for serve --cost-model)")
    cal.add_argument("--instance", required=True, action="append", type=_instance,
                     metavar="URL[@ROLE]", help="a vLLM OpenAI server; several are measured "
                     "side by side; with a prefill and a decode instance the KV transfer "
                     "of their P/D handoff is measured too (the first of each)")
    cal.add_argument("--model", required=True, help="the model name it serves")
    cal.add_argument("--lengths", default="16,128,256,512,1024,1536",
                     help="prompt lengths to time, comma separated (3 distinct at least)")
    cal.add_argument("--repeats", type=int, default=3)
    cal.add_argument("--decode-tokens", type=int, default=32)
    cal.add_argument("--decode-batch", type=int, default=4, help="streams decoded at once "
                     "to time how a step grows with the batch (the engines' --max-num-seqs "
                     "or fewer; 1: keep the given growth)")
    cal.add_argument("--kv-bytes-per-token", type=int, help="the model's KV bytes per token")
    cal.add_argument("--transfer-gbps", type=float, help="KV transfer rate, GB/s, of what "
                     "is not measured (a P/D handoff, store loads)")
    cal.add_argument("--out", required=True, help="JSON file to write")
    _store_args(cal, "the first two instances (running our store connector, kv_both, on "
                "it) are timed loading what the other saved")
    cal.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def _calibrate(args: argparse.Namespace) -> None:
    import dataclasses

    from mooncake_plugins.conductor.router import calibrate
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        if len(set(lengths)) < 3 or min(lengths) < 1:
            raise ValueError(f"--lengths {args.lengths!r}: 3 distinct positive lengths needed")
        if args.decode_batch < 1 or args.decode_tokens < 3:
            raise ValueError("--decode-batch must be >= 1 and --decode-tokens >= 3")
        base = CostModel()
        if args.kv_bytes_per_token:
            base = dataclasses.replace(base, kv_bytes_per_token=args.kv_bytes_per_token)
        if args.transfer_gbps:
            base = dataclasses.replace(base, transfer_bytes_per_s=args.transfer_gbps * 1e9,
                                       handoff_bytes_per_s=args.transfer_gbps * 1e9)
        for url, _, events in args.instance:
            if events:
                raise ValueError(f"--instance {url}: calibrate reads no KV events")
        prefills = [url for url, role, _ in args.instance if role != "decode"]
        decodes = [url for url, role, _ in args.instance if role == "decode"]
        if not prefills:
            raise ValueError("no instance to prefill on: give one that is not @decode")
        pair = None
        if decodes:
            pair = next(((url, decodes[0]) for url, role, _ in args.instance
                         if role == "prefill"), None)
            if pair is None:
                raise ValueError("a decode instance needs a prefill instance to pair with")
        store = _store_view(args, rediscover_s=0.5)   # layouts appear as blocks are saved
        try:
            model, _ = calibrate.run(prefills, args.model, lengths=lengths,
                                     repeats=args.repeats, decode_tokens=args.decode_tokens,
                                     decode_batch=args.decode_batch, base=base,
                                     progress=lambda line: print(line, flush=True),
                                     pd_pair=pair, store=store)
        finally:
            if store is not None:
                store.close()
    except (OSError, ValueError, RuntimeError) as exc:
        sys.exit(f"mooncake-conductor calibrate: {exc}")
    with open(args.out, "w") as f:
        json.dump(dataclasses.asdict(model), f, indent=1)
    print(f"wrote {args.out}: prefill {model.prefill_fixed_s * 1e3:.1f} ms + "
          f"{model.prefill_s_per_token * 1e6:.2f} us/token + "
          f"{model.prefill_s_per_token_sq * 1e9:.3f} ns/token^2; decode step "
          f"{model.decode_fixed_s * 1e3:.2f} ms + {model.decode_s_per_request * 1e3:.2f} ms "
          f"a request"
          + ("" if model.kv_streamed_during_prefill else
             f"; P/D handoff {model.handoff_latency_s * 1e3:.1f} ms + "
             f"{model.kv_bytes_per_token / model.handoff_bytes_per_s * 1e6:.2f} us/token")
          + ("" if store is None else
             f"; store load {model.transfer_latency_s * 1e3:.1f} ms + "
             f"{model.kv_bytes_per_token / model.transfer_bytes_per_s * 1e6:.2f} us/token"),
          flush=True)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "calibrate":
        try:
            import aiohttp  # noqa: F401
        except ImportError as exc:
            sys.exit(f"mooncake-conductor: {exc}: {install_hint(exc)}")
        _calibrate(args)
        return
    try:
        from aiohttp import web

        from mooncake_plugins.conductor.router.instances import Pool
        from mooncake_plugins.conductor.router.prompts import Hasher, hf_tokenizer
        from mooncake_plugins.conductor.router.server import Router, RouterConfig
    except ImportError as exc:
        sys.exit(f"mooncake-conductor: {exc}: {install_hint(exc)}")
    instances = list(args.instance)
    try:
        if args.config:
            with open(args.config) as f:
                conf = json.load(f)
            instances += [(i["url"], i.get("role", "both"), i.get("kv_events"))
                          for i in conf.get("instances", [])]
        cost = CostModel()
        if args.cost_model:
            with open(args.cost_model) as f:
                cost = CostModel(**json.load(f))
        slo = Slo(args.slo_ttft, args.slo_tbt)
        # engines pass KV to each other only through the store (priced as loads from it)
        policy = make_policy(args.policy, cost, slo, early_reject=not args.no_early_reject,
                             migrate=False)
        pool = Pool(args.cache_blocks)
        for url, role, events in instances:
            pool.add(url, role, events)
        tokenize = hf_tokenizer(args.tokenizer) if args.tokenizer else None
        store = _store_view(args)
    except (OSError, ValueError, KeyError, TypeError, InvalidArgument) as exc:
        sys.exit(f"mooncake-conductor: {exc}")
    if not len(pool):
        logging.warning("no instance yet: add some with POST /instances")
    try:
        router = Router(RouterConfig(policy, slo, cost, args.block_tokens,
                                     args.decode_max_batch, args.retries, args.health_interval,
                                     health_timeout_s=args.health_timeout,
                                     kv_events_timeout_s=args.kv_events_timeout, store=store,
                                     correct_ttft=not args.no_ttft_correction,
                                     slo_quantile=args.slo_quantile,
                                     decision_headers=args.decision_headers,
                                     prefill_step_tokens=args.max_num_batched_tokens),
                        Hasher(args.block_tokens, tokenize), pool)
    except ValueError as exc:
        sys.exit(f"mooncake-conductor: {exc}")
    web.run_app(router.app(), host=args.host, port=args.port, print=lambda *a: None)


if __name__ == "__main__":
    main()
