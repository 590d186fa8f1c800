"""``mooncake.http_metadata_server``: the original's ``KVBootstrapServer`` on our server.

``KVBootstrapServer(port, host)`` serves the metadata protocol (``/metadata?key=K``:
GET, PUT, DELETE) from a background thread with ``run()``, ``close()`` and ``poll()``, and
answers in-process requests through ``_handle_metadata``. It is our
:class:`~mooncake_plugins.transfer.metadata.http.MetadataServer` with the original Python
server's key rule (keys are stripped of surrounding blanks). ``main`` is the
``mooncake_http_metadata_server`` command (``--port``, ``--host``, ``--log-level``).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import FrameType
from typing import Any

from mooncake_plugins.cli._args import ArgumentParser, port
from mooncake_plugins.errors import InvalidArgument, MetadataError
from mooncake_plugins.transfer.metadata.http import MetadataServer, Refused

log = logging.getLogger(__name__)

_CONTENT_TYPE = "application/json"  # what the original labels every reply with


class KVPoll(Enum):
    """State of a :class:`KVBootstrapServer` (the original's names and values)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


@dataclass(frozen=True)
class MetadataResponse:
    """The reply to one request: HTTP ``status``, ``body`` bytes and ``content_type``."""

    status: int
    body: bytes
    content_type: str = _CONTENT_TYPE

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class KVBootstrapServer:
    """An HTTP metadata server for Mooncake engines (the original's bootstrap server)."""

    def __init__(self, port: int, host: str = "0.0.0.0") -> None:
        """Args: port: TCP port (0 picks a free one, see ``port`` after ``run``);
        host: address to listen on."""
        self.host = host
        self.port = port
        self._server = MetadataServer(host, port, strip_keys=True)
        self.thread: threading.Thread | None = None

    @property
    def store(self) -> Mapping[str, bytes]:
        """The stored keys and values (a read-only snapshot)."""
        return self._server.entries

    def run(self) -> threading.Thread | None:
        """Start serving in a background thread and return it (None if it cannot listen:
        the error is logged and ``poll()`` says Failed, as with the original)."""
        try:
            self._server.start()
        except MetadataError as exc:
            log.error("Server error: %s", exc)
            return None
        self.port = self._server.port
        self.thread = self._server.serving_thread
        log.info("HTTP Metadata Server started on %s:%d", self.host, self.port)
        return self.thread

    def close(self) -> None:
        """Stop serving and join the server's threads (idempotent)."""
        self._server.stop()

    def poll(self) -> KVPoll:
        """Success while serving, else Failed."""
        thread = self._server.serving_thread
        return KVPoll.Success if thread is not None and thread.is_alive() else KVPoll.Failed

    async def _handle_metadata(self, request: Any) -> MetadataResponse:
        """Answer one request: anything with ``method``, ``query`` (a mapping) and an
        awaitable ``read()`` returning the body."""
        key = str(request.query.get("key", "")).strip()
        if not key:
            return MetadataResponse(400, b"metadata key is required")
        server = self._server
        try:
            if request.method == "GET":
                value = server.get(key)
                return (MetadataResponse(404, b"metadata not found") if value is None
                        else MetadataResponse(200, value))
            if request.method == "PUT":
                changed = server.put(key, await request.read())
                return MetadataResponse(200, b"metadata updated" if changed
                                        else b"metadata unchanged")
            if request.method == "DELETE":
                return (MetadataResponse(200, b"metadata deleted") if server.delete(key)
                        else MetadataResponse(404, b"metadata not found"))
        except Refused as exc:
            return MetadataResponse(exc.status, str(exc).encode())
        except InvalidArgument as exc:
            return MetadataResponse(400, str(exc).encode())
        return MetadataResponse(405, b"Method not allowed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="mooncake_http_metadata_server", description="HTTP Metadata Server for Mooncake",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--port", type=port, default=8080, help="Port to listen on")
    parser.add_argument("--host", default="0.0.0.0", help="Host to bind to")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="Logging level")
    return parser.parse_args(argv)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it is reachable from elsewhere
        return False


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM; exit status 1 if the address cannot be bound."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s - %(name)s - %(levelname)s - %(message)s")
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("Shutting down...")
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _on_signal)
    if not _is_loopback(args.host):
        # the original's default, kept for drop-in use; nothing on this port is authenticated
        log.warning("listening on %s: any host that reaches this port can read and change "
                    "the metadata; keep it on a private network, or pass --host 127.0.0.1",
                    args.host)
    server = KVBootstrapServer(port=args.port, host=args.host)
    if server.run() is None:
        return 1
    try:
        stop.wait()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
