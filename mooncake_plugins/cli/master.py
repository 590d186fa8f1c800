"""``mooncake-master`` / ``mooncake_master``: the Mooncake Store master.

Takes every flag of the original (gflags spellings: ``-flag=v``, ``--flag=v``, ``--flag v``,
booleans as ``--flag``, ``--flag=true`` or ``--noflag``; ``--flagfile``, ``--fromenv``,
``--tryfromenv``, ``--undefok`` and ``--config_path`` (JSON) as gflags/the original). A
flag that has no effect here says so on stderr, with the reason (``--helpfull`` lists
them). Prints ``READY <rpc port>`` once serving (after winning the election with
--enable_ha), then serves until SIGTERM/SIGINT. The metrics/admin HTTP (``/metrics``,
``/health``, drain jobs) always listens on --metrics_host:--metrics_port (default:
--rpc_address, 9003; 0 picks a free port): a second master on one host needs a
--metrics_port of its own, as well as an --rpc_port.

``--root_fs_dir`` alone turns on the SSD tier as the original's persistence does: every
client keeps the objects it puts in files under that directory (or its own
ssd_offload_path), and evicted objects stay readable from them. The master deletes only
the files it named there itself.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import signal
import sys
import threading
from typing import Any, Callable

from .. import __version__
from ..errors import InvalidParams, MooncakeError
from ..store.kv_events import KvEventConfig
from ..store.master import MasterConfig
from ..store.server import MasterServer, ServerOptions
from ._args import ArgumentParser, install_hint, os_reason, port

# Flags of the original without an effect here, by reason: "type:name" words.
_INERT_GROUPS = {
    "CXL memory is not supported here":
        "bool:enable_cxl str:cxl_path int:cxl_size",
    "no snapshots: with --enable_ha every committed change is written to etcd "
    "(--replicate_metadata), a single master writes them under --metadata_dir":
        "bool:enable_snapshot bool:enable_snapshot_restore str:snapshot_backup_dir "
        "str:snapshot_catalog_backend_connstring str:snapshot_catalog_backend_type "
        "str:snapshot_catalog_store_connstring str:snapshot_catalog_store_type "
        "int:snapshot_child_timeout_seconds int:snapshot_interval_seconds "
        "str:snapshot_object_store_type str:snapshot_payload_backend_type "
        "str:snapshot_payload_store_type int:snapshot_retention_count",
    "committed metadata is always replicated through etcd with --enable_ha "
    "(--replicate_metadata=false turns it off), in group commits of their own":
        "bool:enable_oplog int:oplog_batch_max_entries int:oplog_poll_interval_ms "
        "int:batch_oplog_retry_timeout_sec",
    "deprecated in the original too: KV events carry no model fields (a subscriber's "
    "registration supplies them)":
        "str:kv_events_additional_salt int:kv_events_block_size int:kv_events_dp_rank "
        "str:kv_events_lora_name str:kv_events_model_name str:kv_events_tenant_id",
    "no NVMe-oF tier here":
        "float:nof_eviction_high_watermark_ratio float:nof_eviction_ratio "
        "int:nof_heartbeat_failures_threshold int:nof_heartbeat_interval_sec "
        "int:nof_heartbeat_probe_timeout_ms",
    "no dynamic replication here (copy tasks add replicas on request)":
        "float:dynamic_replication_admission_qps_threshold "
        "int:dynamic_replication_heat_window_seconds int:dynamic_replication_max_memory_replicas "
        "str:dynamic_replication_mode",
    "SSD-tier files are written by clients when objects are put: no promotion, offload "
    "queue, disk eviction or quota":
        "bool:promotion_on_hit int:promotion_admission_threshold int:promotion_max_per_heartbeat "
        "int:promotion_queue_limit float:offload_cap_ratio bool:offload_force_evict "
        "bool:offload_on_evict int:offloading_queue_limit bool:enable_disk_eviction "
        "int:quota_bytes int:global_file_segment_size",
    "one tenant ('default') only":
        "bool:enable_multi_tenants str:tenant_quota_connector_type str:tenant_quota_connector_uri",
    "no Kubernetes label routing here":
        "str:pod_name str:pod_namespace",
    "one allocator here (first-fit offsets within each segment)":
        "str:memory_allocator bool:use_mmap_arena_allocator int:mmap_arena_pool_size",
    "the RPC server runs one thread per client connection":
        "int:max_threads int:rpc_thread_num",
    "RPC connections use TCP_NODELAY and a per-frame timeout of their own":
        "int:rpc_conn_timeout_seconds bool:rpc_enable_tcp_no_delay",
    "bind with --rpc_address (an address, not an interface name)":
        "str:rpc_interface",
    "the space of a discarded put is freed at once":
        "int:put_start_release_timeout_sec",
    "failed copy/move tasks are not retried; processing tasks are bounded by pending ones":
        "int:max_retry_attempts int:max_total_processing_tasks",
    "entries written with a TTL (every engine's segment descriptor) always expire on the "
    "embedded metadata server; their writers renew them":
        "bool:enable_metadata_cleanup_on_timeout",
    "no shell completion":
        "int:tab_completion_columns str:tab_completion_word",
    "logs go to stderr through Python logging (see --log_level, --minloglevel, --v)":
        "str:alsologtoemail bool:alsologtostderr bool:colorlogtostderr bool:drop_log_memory "
        "str:log_backtrace_at str:log_dir str:log_link bool:log_prefix int:logbuflevel "
        "int:logbufsecs int:logemaillevel int:logfile_mode str:logmailer bool:logtostderr "
        "int:max_log_size int:stderrthreshold bool:stop_logging_if_full_disk "
        "bool:symbolize_stacktrace str:vmodule",
}
_INERT: dict[str, tuple[str, str]] = {
    name: (kind, reason) for reason, words in _INERT_GROUPS.items()
    for kind, name in (w.split(":") for w in words.split())
}
_HELP_FLAGS = ("help", "helpfull", "helpshort", "helppackage", "helpxml", "helpmatch", "helpon")


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on", "t", "y"):
        return True
    if low in ("0", "false", "no", "off", "f", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


_DURATION = re.compile(r"(\d+)(ms|s|m|h)?")
_UNIT_MS = {None: 1, "ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}


def _duration_ms(text: str) -> int:
    """Raw milliseconds or a duration with an ms, s, m or h suffix (the original's TTLs)."""
    m = _DURATION.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected milliseconds or e.g. 500ms, 5s, 2m, 1h; got {text!r}")
    return int(m.group(1)) * _UNIT_MS[m.group(2)]


_TYPES: dict[str, Callable[[str], Any]] = {"bool": _bool, "int": int, "float": float, "str": str}


def _within(convert: Callable[[str], Any], ok: Callable[[Any], bool],
            want: str) -> Callable[[str], Any]:
    """``convert``, refusing a value for which ``ok`` is false: "expected <want>"."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value
    return parse


_RATIO = _within(float, lambda v: 0 < v <= 1, "a ratio in (0, 1]")


def build_parser(full: bool = False) -> argparse.ArgumentParser:
    """The flags; the original's flags without effect here are listed only when ``full``
    (``--helpfull``)."""
    ap = ArgumentParser(prog="mooncake-master", description=__doc__, add_help=False,
                        usage="%(prog)s [--flag=value ...]",
                        epilog=None if full else f"--helpfull also lists the {len(_INERT)} "
                        f"flags of the original that are accepted here but have no effect.",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    flag = lambda name, **kw: ap.add_argument(f"--{name}", **kw)  # noqa: E731
    b = dict(type=_bool, nargs="?", const=True)
    flag("rpc_port", type=port, default=None, help="RPC port (default 50051; 0 picks a free one)")
    flag("port", type=port, default=None, help="deprecated alias of --rpc_port")
    flag("rpc_address", default="127.0.0.1", help="address to bind and advertise")
    flag("allocation_strategy", default="random", choices=["random", "free_ratio_first", "local_first"])
    flag("eviction_high_watermark_ratio", type=_RATIO, default=0.95,
         help="eviction starts above this fill, in (0, 1]")
    flag("eviction_ratio", type=_RATIO, default=0.05,
         help="share of a segment an eviction frees, in (0, 1]")
    flag("default_kv_lease_ttl", type=_within(_duration_ms, lambda v: v > 0, "a duration > 0"),
         default=5000, help="read lease (ms, or 5s...)")
    flag("default_kv_soft_pin_ttl", type=_duration_ms, default=30 * 60 * 1000, help="soft pin")
    flag("max_kv_soft_pin_ttl", type=_duration_ms, default=24 * 60 * 60 * 1000,
         help="the longest soft pin a put may ask for")
    flag("allow_evict_soft_pinned_objects", **b, default=True)
    flag("client_ttl", type=_within(float, lambda v: v > 0, "seconds > 0"), default=10.0,
         help="seconds without heartbeat before a client is dropped")
    flag("restored_client_grace", type=_within(float, lambda v: v >= 0, "seconds >= 0"),
         default=0.0,
         help="ours: seconds the owner of a segment restored from the journal has to come back "
         "before it is dropped (0: three --client_ttl)")
    flag("put_start_discard_timeout_sec", type=float, default=30.0)
    flag("stripe_size", type=_within(int, lambda v: v >= 4096, "bytes >= 4096"), default=16 << 20,
         help="objects above this are striped over segments")
    flag("enable_offload", **b, default=False,
         help="keep SSD-tier replicas clients write with enable_ssd_offload (needs --root_fs_dir)")
    flag("root_fs_dir", default="", help="directory of the SSD tier's files (the clients' "
         "ssd_offload_path); alone, it also makes every client keep its puts there")
    flag("enable_ha", **b, default=False)
    flag("etcd_endpoints", default="", help="etcd for HA, e.g. 127.0.0.1:2379;host2:2379")
    flag("ha_backend_type", default="etcd", choices=["etcd"], help="etcd only here")
    flag("ha_backend_connstring", default="", help="alias of --etcd_endpoints")
    flag("cluster_id", default="mooncake")
    flag("replicate_metadata", **b, default=True,
         help="ours: with --enable_ha, write every committed change to etcd before answering, "
         "so a new leader keeps every object (docs/store-durability.md)")
    flag("metadata_dir", default="",
         help="ours: without HA, keep the metadata journal in this directory and replay it at "
         "start, so a restarted master keeps every object (default: none)")
    flag("metadata_fsync", **b, default=False,
         help="ours: fsync the --metadata_dir journal at every group commit (survives power "
         "loss, not only a crash of the master; costs a device flush per commit)")
    flag("enable_http_metadata_server", **b, default=False)
    flag("http_metadata_server_host", default=None, help="default: --rpc_address")
    flag("http_metadata_server_port", type=port, default=8080)
    flag("metrics_host", default=None, help="metrics/admin HTTP address (default: --rpc_address)")
    flag("metrics_port", type=port, default=9003, help="metrics/admin HTTP port (0: a free one)")
    flag("enable_metric_reporting", **b, default=True,
         help="log a stats line every 10 s, when the counters changed")
    flag("enable_kv_events", **b, default=False,
         help="publish the pool's KV events (stored/removed, the original's format) on ZMQ PUB")
    flag("kv_events_bind_endpoint", default="", help="ZMQ PUB address, e.g. tcp://0.0.0.0:5557")
    flag("kv_events_backend_id", default="",
         help="names this pool in every event (default: --rpc_address:--rpc_port)")
    flag("kv_events_emit_legacy_compat", **b, default=True,
         help="also write vLLM's names (type BlockStored/BlockRemoved, block_hashes)")
    flag("kv_events_emit_object_key", **b, default=True,
         help="events carry the object key (else keys that are not block hashes are skipped)")
    flag("kv_events_queue_capacity", type=_within(int, lambda v: v >= 1, "a count >= 1"),
         default=65536, help="events waiting to be sent; when full the oldest is dropped")
    flag("kv_events_replay_endpoint", default="",
         help="ours: ZMQ ROUTER address answering replay requests as vLLM's publisher does "
         "(the last --kv_events_replay_batches batches)")
    flag("kv_events_replay_batches", type=_within(int, lambda v: v >= 1, "a count >= 1"),
         default=10000, help="ours: batches kept for replay")
    flag("pending_task_timeout_sec", type=float, default=300.0, help="0: no timeout")
    flag("processing_task_timeout_sec", type=float, default=300.0, help="0: no timeout")
    flag("max_total_pending_tasks", type=int, default=10000)
    flag("max_total_finished_tasks", type=int, default=10000)
    flag("replica_repair_concurrency", type=_within(int, lambda v: v >= 0, "a count >= 0"),
         default=64,
         help="ours: copy tasks re-creating replicas lost with a dead client at a time (0: off)")
    flag("config_path", default="", help="JSON object of flag names and values (the command line wins)")
    flag("flagfile", default="", help="file of --flag=value lines")
    flag("fromenv", default="", help="comma-separated flags to read from FLAGS_<name>")
    flag("tryfromenv", default="", help="as --fromenv, skipping unset variables")
    flag("undefok", default="", help="comma-separated flag names that may be unknown")
    flag("log_level", default="INFO")
    flag("minloglevel", type=int, default=None, help="0 INFO, 1 WARNING, 2 ERROR, 3 FATAL")
    flag("v", type=int, default=None, help="> 0: debug logs")
    flag("log_format", default="text", choices=["text", "json"],
         help="json: one JSON object per line (time, level, logger, message)")
    flag("version", **b, default=False, help="print the version and exit")
    for name in _HELP_FLAGS:
        flag(name, nargs="?", const=True, default=None, help=argparse.SUPPRESS)
    inert = ap.add_argument_group("flags of the original without effect here (accepted, "
                                  "and reported at start)") if full else ap
    for name, (kind, reason) in sorted(_INERT.items()):
        kw = dict(nargs="?", const=True) if kind == "bool" else {}
        inert.add_argument(f"--{name}", type=_TYPES[kind], default=None,
                           help=f"no effect here: {reason}" if full else argparse.SUPPRESS, **kw)
    return ap


class _JsonFormatter(logging.Formatter):
    """Structured log lines for log collectors."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"), "level": record.levelname,
                 "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _name(arg: str) -> str:
    return arg.lstrip("-").split("=", 1)[0]


def _normalize(argv: list[str], bools: set[str]) -> list[str]:
    """gflags spellings to argparse ones: ``-flag`` -> ``--flag``, ``--noflag`` -> ``--flag=false``."""
    out = []
    for a in argv:
        if a.startswith("-") and not a.startswith("--") and len(a) > 2:
            a = "-" + a
        name = _name(a)
        if a.startswith("--") and "=" not in a and name.startswith("no") and name[2:] in bools:
            a = f"--{name[2:]}=false"
        out.append(a)
    return out


def _value(args: list[str], i: int) -> str:
    """The value of the flag at ``args[i]`` (``--f=v`` or ``--f v``)."""
    if "=" in args[i]:
        return args[i].split("=", 1)[1]
    return args[i + 1] if i + 1 < len(args) else ""


def _expand(argv: list[str], known: set[str], bools: set[str]) -> list[str]:
    """:func:`_normalize`, then ``--flagfile``, ``--fromenv`` and ``--tryfromenv`` expanded in
    front (the command line wins), and unknown flags named by ``--undefok`` dropped."""
    args = _normalize(argv, bools)
    extra: list[str] = []
    for i, a in enumerate(args):
        name = _name(a) if a.startswith("--") else ""
        if name == "flagfile" and _value(args, i):
            try:
                with open(_value(args, i), encoding="utf-8") as f:
                    lines = [ln.strip() for ln in f if ln.strip().startswith("-")]
            except OSError as exc:
                raise SystemExit(f"mooncake-master: --flagfile {_value(args, i)}: "
                                 f"{exc.strerror or exc}") from None
            extra += _normalize(lines, bools)
        elif name in ("fromenv", "tryfromenv"):
            for flag_name in filter(None, _value(args, i).split(",")):
                env = os.environ.get(f"FLAGS_{flag_name}")
                if env is None and name == "fromenv":
                    raise SystemExit(f"mooncake-master: --fromenv: FLAGS_{flag_name} is not set")
                if env is not None:
                    extra.append(f"--{flag_name}={env}")
    args = extra + args
    undefok = {n for i, a in enumerate(args) if _name(a) == "undefok" for n in _value(args, i).split(",")}
    return [a for a in args if not (a.startswith("--") and _name(a) in undefok - known)]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Flags as gflags takes them; exits after printing help (any of gflags' help flags:
    ``--helpfull`` adds the original's flags without effect here)."""
    ap = build_parser()
    known = {a.dest for a in ap._actions}
    bools = {a.dest for a in ap._actions if a.type is _bool or a.const is True}
    ns = ap.parse_args(_expand(argv, known, bools))
    if any(getattr(ns, h) for h in _HELP_FLAGS):
        (build_parser(full=True) if ns.helpfull else ap).print_help()
        raise SystemExit(0)
    if ns.config_path:
        _apply_config_file(ap, ns.config_path, known)
        ns = ap.parse_args(_expand(argv, known, bools))
    if ns.default_kv_soft_pin_ttl > ns.max_kv_soft_pin_ttl:
        ap.error(f"argument --default_kv_soft_pin_ttl: {ns.default_kv_soft_pin_ttl} ms is longer "
                 f"than --max_kv_soft_pin_ttl ({ns.max_kv_soft_pin_ttl} ms)")
    return ns


def _apply_config_file(ap: argparse.ArgumentParser, path: str, known: set[str]) -> None:
    """Flag values from a JSON object become the defaults (the command line overrides them)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"mooncake-master: --config_path {path}: {exc} (a JSON object of flag "
                         f"values is expected)")
    if not isinstance(doc, dict):
        raise SystemExit(f"mooncake-master: --config_path {path}: a JSON object of flag values "
                         f"is expected")
    if set(doc) - known:
        raise SystemExit(f"mooncake-master: --config_path {path}: unknown keys "
                         f"{sorted(set(doc) - known)}")
    for action in ap._actions:
        if action.dest in doc:
            v = doc[action.dest]
            convert = action.type if action.type is not None and not isinstance(v, bool) else None
            try:
                ap.set_defaults(**{action.dest: convert(str(v)) if convert else v})
            except (argparse.ArgumentTypeError, ValueError) as exc:
                raise SystemExit(f"mooncake-master: --config_path {path}: {action.dest}: "
                                 f"{exc}") from None


def _report_inert(ns: argparse.Namespace) -> None:
    for name, (_, reason) in sorted(_INERT.items()):
        if getattr(ns, name) is not None:
            print(f"mooncake-master: --{name} has no effect here: {reason}", file=sys.stderr)


def _log_level(ns: argparse.Namespace) -> str:
    if ns.v:
        return "DEBUG"
    if ns.minloglevel is not None:
        return ("INFO", "WARNING", "ERROR", "CRITICAL")[max(0, min(ns.minloglevel, 3))]
    return ns.log_level.upper()


def _start_error(server: MasterServer, options: ServerOptions, exc: BaseException) -> str:
    """One line for a failed start, naming the flags of the listener that failed.

    ``MasterServer.start`` opens the embedded metadata server, the metrics HTTP and the RPC
    port in that order; the first of them that is still missing is the one that failed.
    """
    # (attribute set once listening, port, address (None: --rpc_address's), their flags)
    listeners = [("_metadata", options.http_metadata_port, options.http_metadata_host,
                  "--http_metadata_server_host", "--http_metadata_server_port"),
                 ("_metrics", options.metrics_port, options.metrics_host, "--metrics_host",
                  "--metrics_port"),
                 ("_rpc", options.rpc_port, None, "--rpc_address", "--rpc_port")]
    cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
    for attr, port_number, host, host_flag, port_flag in listeners:
        if port_number is None or getattr(server, attr, None) is not None:
            continue
        if not isinstance(cause, OSError):
            break
        if not host:
            host, host_flag = options.host, "--rpc_address"
        reason = os_reason(cause)
        if cause.errno == errno.EADDRINUSE:
            return (f"cannot listen on {host}:{port_number} ({port_flag}): {reason}; "
                    f"pick another {port_flag} (0 picks a free port)")
        return (f"cannot listen on {host}:{port_number} ({port_flag}, address from "
                f"{host_flag}): {reason}")
    return f"cannot start: {exc}"


def _kv_events(args: argparse.Namespace) -> KvEventConfig | None:
    if not args.enable_kv_events:
        return None
    return KvEventConfig(
        bind_endpoint=args.kv_events_bind_endpoint,
        backend_id=args.kv_events_backend_id,
        emit_legacy_compat=args.kv_events_emit_legacy_compat,
        emit_object_key=args.kv_events_emit_object_key,
        queue_capacity=args.kv_events_queue_capacity,
        replay_endpoint=args.kv_events_replay_endpoint,
        replay_batches=args.kv_events_replay_batches)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.version:
        print(f"mooncake-master (mooncake_plugins) version {__version__}")
        return 0
    _report_inert(args)
    handler = logging.StreamHandler()
    handler.setFormatter(_JsonFormatter() if args.log_format == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=_log_level(args), handlers=[handler])
    etcd = args.etcd_endpoints or args.ha_backend_connstring
    if args.enable_ha and not etcd:
        print("--enable_ha needs --etcd_endpoints (or --ha_backend_connstring)", file=sys.stderr)
        return 2
    if args.enable_ha and args.metadata_dir:
        print("--metadata_dir is for a single master; with --enable_ha the metadata is "
              "replicated through etcd (--replicate_metadata)", file=sys.stderr)
        return 2
    if args.enable_kv_events and not args.kv_events_bind_endpoint:
        print("--enable_kv_events needs --kv_events_bind_endpoint (e.g. tcp://0.0.0.0:5557)",
              file=sys.stderr)
        return 2
    if args.enable_offload and not args.root_fs_dir:
        print("--enable_offload needs --root_fs_dir (the directory of the SSD tier's files)",
              file=sys.stderr)
        return 2
    rpc_port = args.rpc_port if args.rpc_port is not None else (args.port if args.port is not None else 50051)
    if args.enable_ha and rpc_port == 0:
        print("--enable_ha needs a fixed --rpc_port: the leader advertises it in etcd",
              file=sys.stderr)
        return 2
    config = MasterConfig(
        allocation_strategy=args.allocation_strategy,
        eviction_high_watermark_ratio=args.eviction_high_watermark_ratio,
        eviction_ratio=args.eviction_ratio, default_kv_lease_ttl_ms=args.default_kv_lease_ttl,
        default_kv_soft_pin_ttl_ms=args.default_kv_soft_pin_ttl,
        max_kv_soft_pin_ttl_ms=args.max_kv_soft_pin_ttl,
        allow_evict_soft_pinned_objects=args.allow_evict_soft_pinned_objects,
        client_ttl_s=args.client_ttl, restored_client_grace_s=args.restored_client_grace,
        put_start_discard_timeout_s=args.put_start_discard_timeout_sec,
        stripe_nbytes=args.stripe_size, enable_offload=args.enable_offload or bool(args.root_fs_dir),
        root_fs_dir=args.root_fs_dir, persist_puts=bool(args.root_fs_dir) and not args.enable_offload,
        task_pending_timeout_s=args.pending_task_timeout_sec,
        task_processing_timeout_s=args.processing_task_timeout_sec,
        max_pending_tasks=args.max_total_pending_tasks,
        max_finished_tasks=args.max_total_finished_tasks,
        replica_repair_concurrency=args.replica_repair_concurrency)
    try:
        config.validate()
    except InvalidParams as exc:
        print(f"mooncake-master: bad configuration: {exc}", file=sys.stderr)
        return 2
    options = ServerOptions(
        host=args.rpc_address, rpc_port=rpc_port, metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        metric_report_interval_s=10.0 if args.enable_metric_reporting else 0.0,
        http_metadata_port=args.http_metadata_server_port if args.enable_http_metadata_server else None,
        http_metadata_host=args.http_metadata_server_host,
        enable_ha=args.enable_ha, etcd_endpoints=etcd, cluster_id=args.cluster_id,
        replicate_metadata=args.replicate_metadata, metadata_dir=args.metadata_dir,
        metadata_fsync=args.metadata_fsync, kv_events=_kv_events(args))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server = MasterServer(config, options)
    try:
        try:
            if not server.start(stop=stop):
                return 0
        except ImportError as exc:  # a broken install: etcd3gw is a dependency
            print(f"mooncake-master: cannot start: {exc}: {install_hint(exc)}", file=sys.stderr)
            return 1
        except (OSError, MooncakeError) as exc:
            print(f"mooncake-master: {_start_error(server, options, exc)}", file=sys.stderr)
            return 1
        print(f"READY {server.port}", flush=True)
        while not stop.wait(0.2):
            if server.lost_leadership.is_set():
                return 1  # a supervisor restarts us as a candidate
        return 0
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
