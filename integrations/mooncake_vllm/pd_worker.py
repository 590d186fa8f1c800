"""The P/D connector's worker side: prefill workers write KV blocks into decode workers'
KV caches with the transfer engine.

Both sides register their KV cache tensors with a :class:`TransferEngine`. A decode
worker, told by its scheduler which blocks a request waits for, asks the prefill worker
of its own TP rank over the side channel (:mod:`.pd_channel`) to write them to the
addresses of those blocks (its segment name plus each block's ``(address, nbytes)``
pieces from :class:`KVLayout`). The prefill worker waits, if need be, until its
scheduler has handed it the finished request's blocks, writes them (one batch, adjacent
pieces merged), replies, and reports the request finished sending so vLLM frees the
blocks. A decode whose transfer fails reports the request in ``failed_recving``: vLLM
then computes the prompt itself. Blocks no decode asks for are let go after
``abort_timeout_s``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from mooncake_plugins.config import EngineConfig, apply_protocol
from mooncake_plugins.errors import MooncakeError
from mooncake_plugins.transfer import OpCode, TransferEngine, TransferRequest

from .config import PDSettings
from .cuda_fence import Fence, fence
from .kv_layout import KVLayout
from .pd_channel import ProtocolError, Pull, SideChannelServer, ask, reply
from .pd_scheduler import PDHandshake, PDMetadata, RecvJob, SendJob
from .stats import TransferStats

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_ENDED_KEPT = 4096
"""Ended transfers remembered, so a late or repeated pull is answered at once."""


class _Send:
    def __init__(self, job: SendJob, deadline: float, after: Fence | None) -> None:
        self.job = job
        self.deadline = deadline
        self.after = after    # on a GPU: the compute stream's work that wrote the KV
        self.busy = False


def _merge(items: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``(src, dst, nbytes)`` items with runs adjacent on both sides joined."""
    out: list[tuple[int, int, int]] = []
    for src, dst, n in items:
        if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((src, dst, n))
    return out


class PDWorker:
    """Worker-side state of the P/D connector (one per worker process)."""

    def __init__(self, settings: PDSettings, engine_id: str, producer: bool, consumer: bool,
                 num_blocks: int, tp_rank: int, tp_size: int) -> None:
        self._settings = settings
        self._engine_id = engine_id
        self._producer = producer
        self._consumer = consumer
        self._num_blocks = num_blocks
        self._rank = tp_rank
        self._tp = tp_size
        self._who = f"P/D connector (worker {tp_rank})"
        self._layout: KVLayout | None = None
        self._engine: TransferEngine | None = None
        self._server: SideChannelServer | None = None
        self._puller = ThreadPoolExecutor(settings.pull_threads, thread_name_prefix="mc-pd-pull") \
            if consumer else None
        self._cond = threading.Condition()
        self._closing = False
        self._sends: dict[str, _Send] = {}                       # transfer id -> held blocks
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._sent: set[str] = set()                             # req ids: blocks let go
        self._received: set[str] = set()                         # req ids: pulls ended
        self._failed: set[str] = set()                           # req ids: pulls that failed
        self._stats = TransferStats()
        # tcp: shared memory to a peer on this host, tcp to others (as the store does);
        # rdma: the same with rdma before tcp where both hosts have RDMA devices;
        # shm: shared memory only, for a host KV cache (a GPU one is the engine's choice)
        self._transport: str | None = None

    # -- setup ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        s = self._settings
        self._layout = KVLayout(kv_caches, self._num_blocks)
        if s.protocol == "shm" and not self._layout.cuda_devices:
            self._transport = "shm"
        cfg = EngineConfig.from_env()
        apply_protocol(cfg, s.protocol)
        cfg.transfer_timeout_s = s.transfer_timeout_s
        cfg.connect_timeout_s = s.connect_timeout_s
        self._engine = TransferEngine(s.local_hostname, s.metadata_server, config=cfg)
        try:
            for address, nbytes, location in self._layout.regions:
                # only a decode's KV is written by peers; a prefill's is a local source
                self._engine.register_address(address, nbytes, location,
                                              private=not self._consumer)
            if self._producer:
                port = s.side_channel_port + self._rank if s.side_channel_port else 0
                self._server = SideChannelServer(s.local_hostname, port, self._on_pull,
                                                 idle_timeout_s=s.abort_timeout_s)
        except BaseException:
            self._engine.close()
            raise
        log.info("%s: KV cache %s; segment %s%s", self._who, self._layout.describe(),
                 self._engine.segment_name,
                 f", side channel {self._server.host}:{self._server.port}" if self._server else "")

    def get_handshake_metadata(self) -> PDHandshake | None:
        if self._server is None:
            return None
        return PDHandshake(self._server.host, self._server.port)

    # -- each step ------------------------------------------------------------------------
    def start_load_kv(self, meta: PDMetadata) -> None:
        devices = self._layout.cuda_devices if self._layout is not None else []
        if meta.sends or meta.aborted:
            deadline = time.monotonic() + self._settings.abort_timeout_s
            # the prefill that wrote these blocks may still run on the GPU: one fence
            after = fence(devices) if meta.sends else None
            with self._cond:
                for job in meta.sends:
                    self._sends[job.transfer_id] = _Send(job, deadline, after)
                for tid in meta.aborted:
                    self._end(tid, "was aborted on the prefill")
                self._cond.notify_all()
        # blocks given to these requests may still be read by kernels of earlier steps
        after = fence(devices) if meta.recvs else None
        for job in meta.recvs:
            self._puller.submit(self._pull, job, after)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None, set[str]]:
        """(requests done sending, done receiving, of those the failed receives)."""
        now = time.monotonic()
        with self._cond:
            for tid, send in list(self._sends.items()):
                if not send.busy and now > send.deadline:
                    log.warning("%s: no decode asked for transfer %s (request %s) within "
                                "%.0f s; freeing its %d blocks", self._who, tid, send.job.req_id,
                                self._settings.abort_timeout_s, len(send.job.block_ids))
                    self._stats.add(sends_expired=1)
                    self._drop(tid, "expired: no decode asked in time")
            sent, self._sent = self._sent, set()
            received, self._received = self._received, set()
            failed, self._failed = self._failed, set()
        return sent or None, received or None, failed

    def _end(self, tid: str, reason: str) -> None:
        self._ended[tid] = reason
        self._ended.move_to_end(tid)
        while len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)

    def _drop(self, tid: str, reason: str) -> None:
        """Let a transfer's blocks go (under the lock)."""
        send = self._sends.pop(tid)   # its fence's events go with the last send holding it
        self._sent.add(send.job.req_id)
        self._end(tid, reason)

    # -- prefill: serving pulls -------------------------------------------------------------
    def _on_pull(self, pull: Pull) -> dict[str, Any]:
        if pull.engine_id != self._engine_id:
            return reply(False, f"this side channel serves engine {self._engine_id}, "
                                f"not {pull.engine_id}")
        if (pull.tp_rank, pull.tp_size) != (self._rank, self._tp):
            return reply(False, f"TP rank {pull.tp_rank} of {pull.tp_size} asked rank "
                                f"{self._rank} of {self._tp}: P/D needs equal TP sizes, "
                                "rank r to rank r")
        tid = pull.transfer_id
        deadline = time.monotonic() + self._settings.pull_wait_s
        with self._cond:
            while True:   # the decode may ask before our scheduler handed us the blocks
                send = self._sends.get(tid)
                if self._closing:
                    return reply(False, "the prefill worker is shutting down")
                if send is not None and send.busy:
                    return reply(False, f"transfer {tid} is already being written")
                if send is not None:
                    send.busy = True
                    break
                if tid in self._ended:
                    return reply(False, f"transfer {tid}: {self._ended[tid]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    return reply(False, f"transfer {tid} is unknown here (no finished "
                                        f"prefill within {self._settings.pull_wait_s} s)")
                self._cond.wait(left)
        outcome = "released"
        try:
            if not pull.blocks:
                return reply(True)
            result = self._write(send.job, pull, send.after)
            outcome = "already written" if result["ok"] else f"failed: {result['error']}"
            return result
        finally:
            with self._cond:
                self._drop(tid, outcome)

    def _write(self, job: SendJob, pull: Pull, after: Fence | None) -> dict[str, Any]:
        layout, engine = self._layout, self._engine
        if layout is None or engine is None:
            return reply(False, "the prefill worker has no KV cache registered")
        own = tuple(n for _, n in layout.block_pieces(job.block_ids[0]))
        if pull.piece_sizes != own:
            return reply(False, f"KV layouts differ: a block is {len(own)} pieces of "
                                f"{sum(own)} bytes here, {len(pull.piece_sizes)} of "
                                f"{sum(pull.piece_sizes)} bytes there")
        if pull.first_block + len(pull.blocks) > len(job.block_ids):
            return reply(False, f"blocks {pull.first_block}..{pull.first_block + len(pull.blocks)} "
                                f"asked, the request has {len(job.block_ids)}")
        items = []
        for i, dst in enumerate(pull.blocks):
            src = layout.block_pieces(job.block_ids[pull.first_block + i])
            items += [(s, d, n) for (s, n), d in zip(src, dst)]
        items = _merge(items)
        nbytes = sum(n for _, _, n in items)
        t0 = time.perf_counter()
        try:
            if after is not None:
                after.wait()
            batch = engine.submit(pull.segment, [TransferRequest(OpCode.WRITE, *it)
                                                 for it in items], self._transport)
            if not batch.wait_done(self._settings.transfer_timeout_s):
                log.warning("%s: transfer %s is past %.0f s; waiting for its last slices "
                            "before answering", self._who, job.transfer_id,
                            self._settings.transfer_timeout_s)
                batch.wait_done()   # nothing may land after the decode hears back
            error = next((e for e in batch.errors() if e is not None), None)
        except MooncakeError as exc:
            error = exc
        seconds = time.perf_counter() - t0
        if error is not None:
            self._count(send_errors=1)
            log.warning("%s: writing transfer %s to %s failed: %s", self._who, job.transfer_id,
                        pull.segment, error)
            return reply(False, f"write failed: {error}")
        self._count(blocks_sent=len(pull.blocks), bytes_sent=nbytes, send_seconds=seconds)
        log.info("%s: wrote %d blocks (%d bytes) of transfer %s to %s in %.1f ms", self._who,
                 len(pull.blocks), nbytes, job.transfer_id, pull.segment, seconds * 1e3)
        return reply(True, nbytes=nbytes)

    # -- decode: asking for blocks ----------------------------------------------------------
    def _pull(self, job: RecvJob, after: Fence | None) -> None:
        s = self._settings
        if self._rank >= len(job.ports):
            return   # a release to a prefill of fewer ranks (block pulls need equal TP)
        port = job.ports[self._rank]
        pull = Pull(job.transfer_id, job.engine_id, self._rank, self._tp)
        if not job.block_ids:
            try:
                ask(job.host, port, pull.to_wire(), s.connect_timeout_s, s.pull_wait_s)
            except (OSError, ProtocolError) as exc:
                log.warning("%s: telling %s:%d to release transfer %s failed: %s", self._who,
                            job.host, port, job.transfer_id, exc)
            return
        t0 = time.perf_counter()
        try:
            if after is not None:
                after.wait()
            ok, error, nbytes = self._ask_write(job, pull, port)
        except Exception as exc:   # whatever happens, the request must not wait forever
            log.exception("%s: pull of transfer %s failed unexpectedly", self._who,
                          job.transfer_id)
            ok, error, nbytes = False, repr(exc), 0
        seconds = time.perf_counter() - t0
        with self._cond:
            self._received.add(job.req_id)
            if ok:
                self._stats.add(blocks_loaded=len(job.block_ids), bytes_loaded=nbytes,
                                load_seconds=seconds)
            else:
                self._failed.add(job.req_id)
                self._stats.add(load_errors=len(job.block_ids))
        if ok:
            log.info("%s: received %d blocks (%d bytes) of request %s from %s:%d in %.1f ms",
                     self._who, len(job.block_ids), nbytes, job.req_id, job.host, port,
                     seconds * 1e3)
        else:
            log.warning("%s: KV of request %s not received from %s:%d (%s); vLLM computes "
                        "its prompt instead", self._who, job.req_id, job.host, port, error)

    def _ask_write(self, job: RecvJob, pull: Pull, port: int) -> tuple[bool, str, int]:
        s = self._settings
        layout, engine = self._layout, self._engine
        if layout is None or engine is None:
            return False, "no KV cache registered", 0
        pieces = [layout.block_pieces(b) for b in job.block_ids]
        msg = Pull(pull.transfer_id, pull.engine_id, pull.tp_rank, pull.tp_size,
                   segment=engine.segment_name, first_block=job.first_block,
                   piece_sizes=tuple(n for _, n in pieces[0]),
                   blocks=tuple(tuple(a for a, _ in p) for p in pieces)).to_wire()
        try:
            ok, error, nbytes = ask(job.host, port, msg, s.connect_timeout_s,
                                    s.pull_wait_s + 2 * s.transfer_timeout_s)
        except (OSError, ProtocolError) as exc:
            return False, f"side channel: {exc}", 0
        expected = len(job.block_ids) * layout.block_nbytes
        if ok and nbytes != expected:
            return False, f"{nbytes} bytes written, {expected} expected", 0
        return ok, error, nbytes

    # -- stats, shutdown ----------------------------------------------------------------------
    def _count(self, **counts: float) -> None:
        with self._cond:
            self._stats.add(**counts)

    def get_kv_connector_stats(self) -> TransferStats | None:
        with self._cond:
            return self._stats.take()

    def shutdown(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._server is not None:
            self._server.close()
        if self._puller is not None:
            self._puller.shutdown(wait=True, cancel_futures=True)
        if self._engine is not None:
            self._engine.close()
