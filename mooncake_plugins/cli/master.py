"""``mooncake-master``: the Mooncake Store master (flags named as the original's).

Prints ``READY <rpc port>`` once serving (after winning the election with --enable_ha),
then serves until SIGTERM/SIGINT. gflags spellings work too: ``-rpc_port=50051``,
``--enable_ha=true``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading

from ..errors import InvalidParams
from ..store.master import MasterConfig
from ..store.server import MasterServer, ServerOptions


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mooncake-master", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    flag = lambda name, **kw: ap.add_argument(f"--{name}", **kw)  # noqa: E731
    b = dict(type=_bool, nargs="?", const=True, default=False)
    flag("rpc_port", type=int, default=None, help="RPC port (default 50051; 0 picks a free one)")
    flag("port", type=int, default=None, help="deprecated alias of --rpc_port")
    flag("rpc_address", default="127.0.0.1", help="address to bind and advertise")
    flag("allocation_strategy", default="random", choices=["random", "free_ratio_first", "local_first"])
    flag("eviction_high_watermark_ratio", type=float, default=0.95)
    flag("eviction_ratio", type=float, default=0.05)
    flag("default_kv_lease_ttl", type=int, default=5000, help="read lease in ms")
    flag("default_kv_soft_pin_ttl", type=int, default=30 * 60 * 1000, help="soft pin in ms")
    flag("allow_evict_soft_pinned_objects", type=_bool, nargs="?", const=True, default=True)
    flag("client_ttl", type=float, default=10.0, help="seconds without heartbeat before a client is dropped")
    flag("put_start_discard_timeout_sec", type=float, default=30.0)
    flag("stripe_size", type=int, default=16 << 20, help="objects above this are striped over segments")
    flag("enable_offload", **b, help="keep SSD-tier replicas reported by clients (needs --root_fs_dir)")
    flag("root_fs_dir", default="", help="directory the SSD tier's files live under (the clients' "
         "ssd_offload_path); the master deletes nothing outside it")
    flag("enable_ha", **b)
    flag("etcd_endpoints", default="", help="etcd for HA, e.g. 127.0.0.1:2379;host2:2379")
    flag("cluster_id", default="mooncake")
    flag("enable_http_metadata_server", **b)
    flag("http_metadata_server_host", default=None, help="default: --rpc_address")
    flag("http_metadata_server_port", type=int, default=8080)
    flag("enable_metric_reporting", **b, help="serve Prometheus /metrics on --metrics_port")
    flag("metrics_port", type=int, default=9003)
    flag("log_level", default="INFO")
    flag("log_format", default="text", choices=["text", "json"],
         help="json: one JSON object per line (time, level, logger, message)")
    return ap


class _JsonFormatter(logging.Formatter):
    """Structured log lines for log collectors."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"), "level": record.levelname,
                 "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _gflags(argv: list[str]) -> list[str]:
    """Accept the original's single-dash long flags (``-rpc_port=1``)."""
    return ["-" + a if a.startswith("-") and not a.startswith("--") and len(a) > 2 else a for a in argv]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_gflags(sys.argv[1:] if argv is None else argv))
    handler = logging.StreamHandler()
    handler.setFormatter(_JsonFormatter() if args.log_format == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    if args.enable_ha and not args.etcd_endpoints:
        print("--enable_ha needs --etcd_endpoints", file=sys.stderr)
        return 2
    if args.enable_offload and not args.root_fs_dir:
        print("--enable_offload needs --root_fs_dir (the directory of the SSD tier's files)",
              file=sys.stderr)
        return 2
    rpc_port = args.rpc_port if args.rpc_port is not None else (args.port if args.port is not None else 50051)
    config = MasterConfig(
        allocation_strategy=args.allocation_strategy,
        eviction_high_watermark_ratio=args.eviction_high_watermark_ratio,
        eviction_ratio=args.eviction_ratio, default_kv_lease_ttl_ms=args.default_kv_lease_ttl,
        default_kv_soft_pin_ttl_ms=args.default_kv_soft_pin_ttl,
        allow_evict_soft_pinned_objects=args.allow_evict_soft_pinned_objects,
        client_ttl_s=args.client_ttl, put_start_discard_timeout_s=args.put_start_discard_timeout_sec,
        stripe_nbytes=args.stripe_size, enable_offload=args.enable_offload,
        root_fs_dir=args.root_fs_dir)
    try:
        config.validate()
    except InvalidParams as exc:
        print(f"bad configuration: {exc}", file=sys.stderr)
        return 2
    options = ServerOptions(
        host=args.rpc_address, rpc_port=rpc_port,
        metrics_port=args.metrics_port if args.enable_metric_reporting else 0,
        http_metadata_port=args.http_metadata_server_port if args.enable_http_metadata_server else None,
        http_metadata_host=args.http_metadata_server_host,
        enable_ha=args.enable_ha, etcd_endpoints=args.etcd_endpoints, cluster_id=args.cluster_id)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server = MasterServer(config, options)
    try:
        if not server.start(stop=stop):
            return 0
        print(f"READY {server.port}", flush=True)
        while not stop.wait(0.2):
            if server.lost_leadership.is_set():
                return 1  # a supervisor restarts us as a candidate
        return 0
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
