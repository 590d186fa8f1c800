"""``mooncake-metadata-server``: the standalone HTTP metadata server.

Prints ``READY <port>`` on stdout once listening, serves until SIGTERM or SIGINT, then
stops cleanly and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from types import FrameType

from mooncake_plugins.cli._args import ArgumentParser, port
from mooncake_plugins.errors import InvalidArgument, MetadataError
from mooncake_plugins.transfer.metadata import MetadataServer
from mooncake_plugins.transfer.metadata.http import (DEFAULT_MAX_CONNECTIONS,
                                                     DEFAULT_MAX_STORE_NBYTES)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="mooncake-metadata-server",
        description="HTTP metadata server for the Mooncake Transfer Engine "
                    "(use http://HOST:PORT/metadata as the metadata URL).")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=port, default=8080,
                        help="TCP port, 0 picks a free one (default: %(default)s)")
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_STORE_NBYTES,
                        help="room for keys and values; writes past it get 507 "
                             "(default: %(default)s)")
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        help="connections served at once; more get 503 (default: %(default)s)")
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging level on stderr (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGTERM/SIGINT; return the exit status."""
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _on_signal)
    if args.max_bytes <= 0 or args.max_connections <= 0:
        print("error: --max-bytes and --max-connections must be positive", file=sys.stderr)
        return 2
    try:
        server = MetadataServer(args.host, args.port, max_nbytes=args.max_bytes,
                                max_connections=args.max_connections).start()
    except (InvalidArgument, MetadataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"READY {server.port}", flush=True)
        print(f"metadata server: {server.url}", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
