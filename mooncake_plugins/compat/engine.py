"""``mooncake.engine.TransferEngine`` of the original, over our :class:`TransferEngine`.

Same method names, argument order and return codes: 0 on success and a negative code on
failure for status calls; batch ids are positive and 0 means "failed to submit". Errors
are logged with their reason, since an int cannot carry it.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from typing import Any, Callable

from ..config import EngineConfig, apply_protocol
from ..errors import InvalidArgument, MooncakeError, TransportUnavailable, to_code
from ..transfer.batch import Batch, OpCode, TransferRequest
from ..transfer.engine import P2P, ManagedBuffer, TransferEngine as _Engine
from ..transfer import verbs
from ..transfer.nic_topology import NicTopology

log = logging.getLogger(__name__)

SYSFS = "/sys"
"""Where ``get_local_topology`` reads the host's devices (tests point it at a tree)."""


class TransferOpcode(enum.IntEnum):
    """``mooncake.engine.TransferOpcode``."""

    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


class TransferNotify:
    """``mooncake.engine.TransferNotify``: a (name, msg) pair delivered after a transfer."""

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


_PROTOCOLS = ("tcp", "shm")
FORCE_TCP_ENV = "MC_FORCE_TCP"


def _codes(default: int) -> Callable:
    """Turn our exceptions into the original's return codes (logged with the reason)."""
    def wrap(fn: Callable) -> Callable:
        def inner(self: "TransferEngine", *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except MooncakeError as exc:
                log.error("%s failed: %s", fn.__name__, exc)
                return default if default == 0 else to_code(exc)
        inner.__name__ = fn.__name__
        inner.__doc__ = fn.__doc__
        return inner
    return wrap


class TransferEngine:
    """Drop-in for the original ``mooncake.engine.TransferEngine``; call ``initialize`` first."""

    def __init__(self) -> None:
        self._engine: _Engine | None = None
        self._managed: dict[int, ManagedBuffer] = {}
        self._batches: dict[int, Batch] = {}
        self._lock = threading.Lock()

    @property
    def engine(self) -> _Engine:
        if self._engine is None:
            raise InvalidArgument("TransferEngine.initialize() has not been called")
        return self._engine

    def get_engine(self) -> _Engine:
        """The underlying Pythonic engine."""
        return self.engine

    @_codes(-1)
    def initialize(self, local_hostname: str, metadata_server: str, protocol: str,
                   device_name: str) -> int:
        """Start serving; ``protocol`` is tcp or rdma (same-host peers use shm
        automatically; tcp remains rdma's fallback).

        As in the original, ``rdma`` on a host without RDMA devices runs over tcp, and
        with ``MC_FORCE_TCP`` set (to any value) any protocol does ("MC_FORCE_TCP is set,
        using TCP transport only"): SGLang PD asks for rdma by default, and its
        ``mooncake_tcp`` backend sets MC_FORCE_TCP. Other protocols are an error code.
        """
        if protocol == "rdma" and FORCE_TCP_ENV not in os.environ and not verbs.available():
            log.warning("protocol 'rdma': %s here, using tcp (shm between processes of one "
                        "host)", verbs.why_unavailable())
            protocol = "tcp"
        elif protocol not in _PROTOCOLS and (protocol == "rdma" or FORCE_TCP_ENV in os.environ):
            log.warning("protocol %r: %s is set, using tcp (shm between processes of one "
                        "host)", protocol, FORCE_TCP_ENV)
            protocol = "tcp"
        if protocol not in _PROTOCOLS and protocol != "rdma":
            raise TransportUnavailable(f"protocol {protocol!r} is not available here "
                                       f"(available: {sorted(_PROTOCOLS) + ['rdma']})")
        cfg = EngineConfig.from_env()
        apply_protocol(cfg, protocol)
        try:
            self._engine = _Engine(local_hostname, metadata_server or P2P, config=cfg)
        except OSError as exc:  # e.g. the port is in use: a code, as the original returns
            log.error("initialize(%r, %r) failed: %s", local_hostname, metadata_server, exc)
            return -1
        return 0

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str,
                       device_name: str, metadata_type: str) -> int:
        """``initialize`` with the metadata type given apart ("etcd", "redis", "http", "p2p")."""
        if metadata_type in ("p2p", P2P) or metadata_server == P2P:
            url = P2P
        elif "://" in metadata_server:
            url = metadata_server
        else:
            url = f"{metadata_type}://{metadata_server}"
        return self.initialize(local_hostname, url, protocol, device_name)

    def get_rpc_port(self) -> int:
        return self.engine.rpc_port

    # -- memory ----------------------------------------------------------------------
    @_codes(0)
    def allocate_managed_buffer(self, length: int) -> int:
        """Allocate and register ``length`` bytes; returns the address, 0 on failure."""
        buf = self.engine.allocate(length)
        with self._lock:
            self._managed[buf.address] = buf
        return buf.address

    @_codes(-1)
    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        with self._lock:
            buf = self._managed.get(buffer_addr)
        if buf is None or buf.nbytes != length:
            raise InvalidArgument(f"0x{buffer_addr:x}+{length} is not a managed buffer")
        self.engine.free(buf)
        with self._lock:
            del self._managed[buffer_addr]
        return 0

    @_codes(-1)
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        self.engine.register_address(buffer_addr, capacity, location)
        return 0

    @_codes(-1)
    def unregister_memory(self, buffer_addr: int) -> int:
        self.engine.unregister(buffer_addr)
        return 0

    def batch_register_memory(self, buffer_addresses: list[int], capacities: list[int],
                              location: str = "*") -> int:
        if len(buffer_addresses) != len(capacities):
            log.error("batch_register_memory: %d addresses but %d capacities",
                      len(buffer_addresses), len(capacities))
            return -1
        for i, (a, c) in enumerate(zip(buffer_addresses, capacities)):
            rc = self.register_memory(a, c, location)
            if rc:
                for done in buffer_addresses[:i]:
                    self.unregister_memory(done)
                return rc
        return 0

    def batch_unregister_memory(self, buffer_addresses: list[int]) -> int:
        rcs = [self.unregister_memory(a) for a in buffer_addresses]
        return next((rc for rc in rcs if rc), 0)

    def read_bytes_from_buffer(self, buffer: int, length: int) -> bytes:
        """Bytes of local registered memory (b"" and a logged error when out of bounds)."""
        try:
            return bytes(self.engine.local_view(buffer, length))
        except MooncakeError as exc:
            log.error("read_bytes_from_buffer: %s", exc)
            return b""

    @_codes(-1)
    def write_bytes_to_buffer(self, buffer: int, src: bytes, length: int) -> int:
        if len(src) < length:
            raise InvalidArgument(f"src has {len(src)} bytes, fewer than length={length}")
        self.engine.local_view(buffer, length)[:] = memoryview(src)[:length]
        return 0

    @_codes(0)
    def get_first_buffer_address(self, segment_name: str) -> int:
        regions = self.engine.open_segment(segment_name).refresh().regions
        return regions[0].address if regions else 0

    def get_local_topology(self, device_name: str | None = None) -> str:
        """The original's JSON of this host's RDMA NICs per memory location,
        ``{"cpu:0": [[preferred], [fallback]], "cuda:0": ...}`` (empty lists without RDMA
        NICs: ``{"cpu:0": [[], []]}``);
        ``device_name``: only these devices (comma or space separated)."""
        devices = [d for d in (device_name or "").replace(",", " ").split() if d]
        return NicTopology.discover(SYSFS, devices=devices or None).to_json()

    # -- transfers -------------------------------------------------------------------
    def _submit(self, target: str, buffers: list[int], peers: list[int], lengths: list[int],
                op: OpCode, hint: str) -> Batch:
        if not len(buffers) == len(peers) == len(lengths):
            raise InvalidArgument("buffers, peer_buffer_addresses and lengths differ in length")
        reqs = [TransferRequest(op, b, p, n) for b, p, n in zip(buffers, peers, lengths)]
        return self.engine.submit(target, reqs, hint or None)

    @_codes(-1)
    def batch_transfer_sync(self, target_hostname: str, buffers: list[int],
                            peer_buffer_addresses: list[int], lengths: list[int],
                            opcode: TransferOpcode, notify: TransferNotify | None = None,
                            transport_hint: str = "") -> int:
        batch = self._submit(target_hostname, buffers, peer_buffer_addresses, lengths,
                             OpCode(int(opcode)), transport_hint)
        batch.wait(self.engine.config.transfer_timeout_s + batch.nbytes / 1e9)
        if notify is not None:
            self.engine.notify(target_hostname, notify.name, notify.msg)
        return 0

    def batch_transfer_sync_write(self, target_hostname: str, buffers: list[int],
                                  peer_buffer_addresses: list[int], lengths: list[int],
                                  transport_hint: str = "") -> int:
        return self.batch_transfer_sync(target_hostname, buffers, peer_buffer_addresses, lengths,
                                        TransferOpcode.WRITE, None, transport_hint)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: list[int],
                                 peer_buffer_addresses: list[int], lengths: list[int],
                                 transport_hint: str = "") -> int:
        return self.batch_transfer_sync(target_hostname, buffers, peer_buffer_addresses, lengths,
                                        TransferOpcode.READ, None, transport_hint)

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                      length: int, opcode: TransferOpcode, notify: TransferNotify | None = None,
                      transport_hint: str = "") -> int:
        return self.batch_transfer_sync(target_hostname, [buffer], [peer_buffer_address], [length],
                                        opcode, notify, transport_hint)

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                            length: int, transport_hint: str = "") -> int:
        return self.transfer_sync(target_hostname, buffer, peer_buffer_address, length,
                                  TransferOpcode.WRITE, None, transport_hint)

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                           length: int, transport_hint: str = "") -> int:
        return self.transfer_sync(target_hostname, buffer, peer_buffer_address, length,
                                  TransferOpcode.READ, None, transport_hint)

    @_codes(0)
    def batch_transfer_async(self, target_hostname: str, buffers: list[int],
                             peer_buffer_addresses: list[int], lengths: list[int],
                             opcode: TransferOpcode, transport_hint: str = "") -> int:
        """Submit and return a batch id (> 0), or 0 when submission failed."""
        batch = self._submit(target_hostname, buffers, peer_buffer_addresses, lengths,
                             OpCode(int(opcode)), transport_hint)
        with self._lock:
            self._batches[batch.id] = batch
        return batch.id

    def batch_transfer_async_write(self, target_hostname: str, buffers: list[int],
                                   peer_buffer_addresses: list[int], lengths: list[int],
                                   transport_hint: str = "") -> int:
        return self.batch_transfer_async(target_hostname, buffers, peer_buffer_addresses, lengths,
                                         TransferOpcode.WRITE, transport_hint)

    def batch_transfer_async_read(self, target_hostname: str, buffers: list[int],
                                  peer_buffer_addresses: list[int], lengths: list[int],
                                  transport_hint: str = "") -> int:
        return self.batch_transfer_async(target_hostname, buffers, peer_buffer_addresses, lengths,
                                         TransferOpcode.READ, transport_hint)

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                              length: int, transport_hint: str = "") -> int:
        return self.batch_transfer_async(target_hostname, [buffer], [peer_buffer_address],
                                         [length], TransferOpcode.WRITE, transport_hint)

    def get_batch_transfer_status(self, batch_ids: list[int]) -> int:
        """Block until every batch ended; 0 if all succeeded, -1 otherwise (ids are freed)."""
        with self._lock:
            batches = [self._batches.pop(i, None) for i in batch_ids]
        rc = 0
        for bid, batch in zip(batch_ids, batches):
            if batch is None:
                log.error("get_batch_transfer_status: unknown batch id %d", bid)
                rc = -1
                continue
            try:
                batch.wait(self.engine.config.transfer_timeout_s + batch.nbytes / 1e9)
            except MooncakeError as exc:
                log.error("batch %d failed: %s", bid, exc)
                rc = -1
        return rc

    def transfer_check_status(self, batch_id: int) -> int:
        """1 completed, 0 still running, -1 failed (ids are freed once ended)."""
        with self._lock:
            batch = self._batches.get(batch_id)
        if batch is None:
            log.error("transfer_check_status: unknown batch id %d", batch_id)
            return -1
        if not batch.done():
            return 0
        with self._lock:
            self._batches.pop(batch_id, None)
        err = batch.error()
        if err is not None:
            log.error("batch %d failed: %s", batch_id, err)
            return -1
        return 1

    # -- notifications and probes ----------------------------------------------------
    def get_notifies(self) -> list[TransferNotify]:
        return [TransferNotify(n, m) for n, m in self.engine.take_notifies()]

    @_codes(-1)
    def send_probe(self, peer_server_name: str) -> int:
        """0 when the peer answers on its rpc port."""
        self.engine.probe(peer_server_name)
        return 0

    def close(self) -> None:
        """Not in the original (it relies on process exit); releases everything here."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None
