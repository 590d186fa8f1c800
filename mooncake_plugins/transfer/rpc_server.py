"""The engine's rpc port: READ/WRITE of registered memory, and control messages.

Every engine serves one, whatever its transports: tcp peers move data through it, and
every peer sends its control messages there (describe, notify; ``TransferEngine._on_control``
answers them). The initiator's side is the tcp transport (``transports/tcp.py``), whose
byte loops (``tcp.io``, native or Python) and socket tuning this server shares.

Thread model: one accept thread, one thread per connection, which answers the frames of
its connection in order. Every frame is validated (protocol.py) and every address checked
against the RegionTable before use; a malformed frame closes that connection with a
logged error, never the process.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any, Callable

from ..config import spin_us
from ..errors import AddressError, MooncakeError, ProtocolError
from . import protocol
from .listener import (DEFAULT_FRAME_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, ConnectionServer,
                       idle_waiter, set_deadline)
from .segment import RegionTable, device_of
from .transports.staging import ServerStaging
from .transports.tcp import SPIN_MAX_NBYTES, io, tune

log = logging.getLogger(__name__)


class TcpServer(ConnectionServer):
    """The engine's rpc port: serves READ/WRITE of registered memory and control commands.

    Args:
        host, port: where to listen (port 0 picks a free one; see ``.port``).
        regions: the local RegionTable every request is checked against.
        on_control: called with a validated control message, returns the reply bytes.
        max_connections, frame_timeout_s: see :class:`ConnectionServer`; a WRITE that
            stalls mid-payload lets go of its region after ``frame_timeout_s``.
    """

    def __init__(self, host: str, port: int, regions: RegionTable,
                 on_control: Callable[[dict], bytes], *,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S) -> None:
        super().__init__(host, port, "mc-tcp", max_connections=max_connections,
                         frame_timeout_s=frame_timeout_s)
        self._regions = regions
        self._on_control = on_control
        self._spin_us = spin_us()
        self.bytes_in = 0   # written to us by peers; updated under _count_lock
        self.bytes_out = 0  # read from us by peers
        self._count_lock = threading.Lock()
        self.start()

    def _setup(self, conn: socket.socket) -> None:
        tune(conn)
        set_deadline(conn, self.frame_timeout_s)

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        fd = conn.fileno()
        wait_idle = idle_waiter(fd)
        last_nbytes = 0
        staging: ServerStaging | None = None  # made on the first request on GPU memory
        try:
            while True:
                # after a small frame the initiator's next one usually follows at once;
                # after a large one, spinning would only take the CPU from the copies
                if not (self._spin_us and last_nbytes <= SPIN_MAX_NBYTES
                        and io.spin_until_readable(fd, self._spin_us)):
                    wait_idle()
                req = protocol.decode_request(io.recv_exact(fd, protocol.REQUEST.size))
                last_nbytes = req.nbytes
                if req.op == protocol.OP_CONTROL:
                    msg = protocol.decode_control(io.recv_exact(fd, req.aux_len))
                    try:
                        reply = self._on_control(msg)
                    except MooncakeError as exc:  # refused (e.g. a full notify queue)
                        self._reply(fd, req.req_id, exc.code, str(exc).encode())
                        continue
                    self._reply(fd, req.req_id, 0, reply)
                    continue
                writing = req.op == protocol.OP_WRITE
                try:
                    region = self._regions.acquire(req.address, req.nbytes, remote=True,
                                                   device=True)
                except AddressError as exc:
                    log.warning("refused %s from %s: %s", "WRITE" if writing else "READ", addr, exc)
                    if writing:
                        io.discard(fd, req.nbytes)
                    self._reply(fd, req.req_id, exc.code, str(exc).encode())
                    continue
                try:
                    if writing and region.readonly:
                        log.warning("refused WRITE from %s: 0x%x is registered read-only", addr,
                                    region.address)
                        io.discard(fd, req.nbytes)
                        status, body = AddressError.code, b"region is registered read-only"
                    elif writing:
                        if region.device:  # GPU memory: through pinned memory
                            staging = staging or ServerStaging()
                            staging.receive(io.recv_into_address, fd, req.address, req.nbytes,
                                            device_of(region.info.location))
                        else:
                            io.recv_into_address(fd, req.address, req.nbytes)
                        with self._count_lock:
                            self.bytes_in += req.nbytes
                        status, body = 0, b""
                    else:
                        header = protocol.encode_response(0, req.req_id, req.nbytes)
                        if region.device:
                            staging = staging or ServerStaging()
                            staging.send(io.send_frame, fd, header, req.address, req.nbytes,
                                         device_of(region.info.location))
                        else:
                            io.send_frame(fd, header, req.address, req.nbytes)
                        with self._count_lock:
                            self.bytes_out += req.nbytes
                        continue
                finally:
                    self._regions.release(region)
                self._reply(fd, req.req_id, status, body)  # after the release: see RegionTable.remove
        except ProtocolError as exc:
            log.error("closing connection from %s: malformed frame: %s", addr, exc)
        except TimeoutError:
            log.warning("closing connection from %s: a frame made no progress for %.1f s",
                        addr, self.frame_timeout_s)
        except ConnectionError as exc:
            log.debug("connection from %s ended: %s", addr, exc)
        except OSError as exc:
            if not self.closed:
                log.warning("connection from %s failed: %s", addr, exc)
        except Exception:  # never let one connection take the process down
            log.exception("closing connection from %s after an unexpected error", addr)
        finally:
            if staging is not None:
                try:
                    staging.close()
                except Exception:  # a CUDA error at teardown: the buffers go with the process
                    log.exception("freeing the GPU staging buffers of %s failed", addr)

    @staticmethod
    def _reply(fd: int, req_id: int, status: int, body: bytes) -> None:
        body = body[:protocol.MAX_ERROR_NBYTES] if status else body
        io.send_frame(fd, protocol.encode_response(status, req_id, len(body)) + body, 0, 0)
