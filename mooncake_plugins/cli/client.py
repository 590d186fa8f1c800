"""``mooncake_client``: the standalone store client that serves local dummy clients.

Owns the transfer engine and the ``--global_segment_size`` bytes it contributes to the
pool, registers with the master, and serves ``MooncakeDistributedStore.setup_dummy``
clients of this machine on ``--rpc_host:--port``, loopback by default (flags named as the
original's, which binds that port on ``--host``; gflags spellings such as ``-port=50052``
work too). Prints ``READY <port>`` once serving, then serves until
SIGTERM/SIGINT, and unmounts its segment on the way out (a SIGTERM before
READY ends the process at once).
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
import threading

from ..errors import MooncakeError
from ..store.client import StoreClient
from ..store.local import DEFAULT_PORT, DummyHost
from ._args import ArgumentParser, host_port, install_hint, os_reason, port

log = logging.getLogger("mooncake_plugins.cli.client")

_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}


def _bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _gflags(argv: list[str]) -> list[str]:
    """Accept the original's single-dash long flags (``-port=50052``)."""
    return ["-" + a if a.startswith("-") and not a.startswith("--") and len(a) > 2 else a
            for a in argv]


def parse_size(text: str) -> int:
    """``"4 GB"``, ``"512MB"``, ``"16MiB"``, ``"1073741824"`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).replace("I", "")])


def _master_address(text: str) -> str:
    """``host:port`` (port 1..65535), or an ``etcd://`` URL that the client resolves."""
    return text if text.startswith("etcd://") else host_port(text)


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="mooncake_client", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    flag = lambda name, **kw: ap.add_argument(f"--{name}", **kw)  # noqa: E731
    b = dict(type=_bool, nargs="?", const=True, default=False)
    flag("host", default="0.0.0.0", help="the transfer engine's hostname (its data port)")
    flag("port", type=port, default=DEFAULT_PORT, help="port the dummy clients connect to")
    flag("rpc_host", default="127.0.0.1",
         help="address the dummy clients' RPC listens on (default: loopback only; dummies "
              "run on this machine). The RPC is unauthenticated and can remove every object "
              "(docs/trust-model.md): to expose it, pass a private interface's address, or "
              "0.0.0.0 for all interfaces, behind a firewall")
    flag("metadata_server", default="http://127.0.0.1:8080/metadata")
    flag("master_server_address", type=_master_address, default="127.0.0.1:50051",
         help="host:port of the master, or etcd://host:port[;host:port] for an HA cluster")
    flag("protocol", default="tcp", help="tcp (same-host peers use shared memory); rdma falls back to tcp")
    flag("device_names", default="", help="RDMA devices (unused: no RDMA here)")
    flag("global_segment_size", type=parse_size, default=parse_size("4 GB"))
    flag("segment_location", default="cpu",
         help="ours: where the segment lives, cpu or cuda:N (GPU memory, reached over "
              "cuda_ipc on this host and staged tcp from others)")
    flag("local_buffer_size", type=parse_size, default=0,
         help="accepted for compatibility: reads land in the dummies' memory")
    flag("threads", type=int, default=1, help="accepted for compatibility (a thread per connection)")
    flag("tenant_id", default="default")
    flag("enable_offload", **b)
    flag("start_offload_rpc_server", type=_bool, nargs="?", const=True, default=True)
    flag("enable_http_server", **b)
    flag("http_port", type=port, default=9300)
    flag("log_level", default="INFO")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_gflags(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for unsupported, what in ((args.tenant_id != "default", "tenants other than 'default'"),
                              (args.enable_offload, "--enable_offload"),
                              (args.enable_http_server, "--enable_http_server")):
        if unsupported:
            print(f"{what} is not supported by this build", file=sys.stderr)
            return 2
    protocol = args.protocol
    if protocol == "rdma":
        log.warning("rdma is not available on this build: using tcp (and shm on one host)")
        protocol = "tcp"
    # Until serving, SIGTERM keeps its default action. Setup itself is quick (segments are
    # created lazily and prefaulted in the background: READY comes ~30 ms after the
    # imports, 64 MB or 16 GB alike), but it may wait up to the RPC timeout (10 s) on a
    # master that accepts and does not answer, and a stop request must not wait for that.
    # Ending there is a kill -9 to the master: a mounted segment goes with its heartbeats.
    try:
        client = StoreClient(args.master_server_address, local_hostname=args.host,
                             metadata_server=args.metadata_server,
                             global_segment_size=args.global_segment_size, protocol=protocol,
                             segment_location=args.segment_location)
    except (MooncakeError, MemoryError, OSError) as exc:
        print(f"mooncake_client: cannot set up the store client: {exc}", file=sys.stderr)
        return 1
    except ImportError as exc:  # a broken install: the etcd client is a dependency
        print(f"mooncake_client: cannot set up the store client: {exc}: {install_hint(exc)}",
              file=sys.stderr)
        return 1
    try:
        host = DummyHost(client, args.rpc_host, args.port)
    except (MooncakeError, OSError) as exc:
        print(f"mooncake_client: cannot serve dummy clients on {args.rpc_host}:{args.port} "
              f"(--rpc_host, --port): {os_reason(exc)}", file=sys.stderr)
        client.close()
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        log.info("serving dummy clients on %s:%d (segment %s)", args.rpc_host, host.port,
                 client.segment_name)
        print(f"READY {host.port}", flush=True)
        while not stop.wait(0.5):
            pass
        return 0
    finally:
        host.close()
        client.close()


if __name__ == "__main__":
    sys.exit(main())
