"""GPU memory over a host-only transport (tcp, shm), through pinned bounce buffers.

A :class:`Staged` wraps one transport that moves host memory. For a slice whose local side
is GPU memory it copies between the GPU and pinned host memory on a CUDA stream of its own
and lets the wrapped transport move the pinned bytes; never a pageable copy. A task's
slices go in groups of up to ``HALF_NBYTES`` through two halves of a bounce buffer, so the
device copy of one group overlaps the network or shm move of the other:

- WRITE: D2H of group g+1 is queued, then group g is sent from the other half, then the
  queued copy is waited for;
- READ: group g is received into one half, then its H2D is queued and group g+1 received
  into the other half while it runs (a half is reused only after its H2D event).

Each engine worker thread has its own stream, events and bounce buffer per device (made on
first use, freed with the transport). The engine offers a ``Staged`` path only where a
CUDA driver is loaded in the process (a GPU region exists), after the transports that
move GPU memory themselves (cuda_ipc). The peer's side stays host memory here: a remote
GPU region is reached by cuda_ipc on the same host.
"""

from __future__ import annotations

import threading
from typing import Any

from ...errors import AddressError, MooncakeError, TransferError
from .. import cuda
from ..peer import Peer
from .base import CUDA, HOST, OP_WRITE, Transport

HALF_NBYTES = 4 << 20
"""Bytes of slices moved per group (each half of a worker's bounce buffer)."""


class _Lane:
    """One worker thread's staging resources on one device."""

    def __init__(self, device: int, half: int) -> None:
        self.half = half
        self.stream = cuda.Stream(device)
        self.events = [cuda.Event(device), cuda.Event(device)]
        self.used = [False, False]  # whether an H2D from each half may still run
        self.buffer = cuda.pinned_buffer(2 * half, device)

    def close(self) -> None:
        self.stream.synchronize()
        for e in self.events:
            e.close()
        self.stream.close()
        self.buffer.close()


class ServerStaging:
    """One tcp server connection's staging for requests on GPU regions of this engine:
    pinned buffers and streams per device, made on first use, freed by ``close``."""

    def __init__(self) -> None:
        self._lanes: dict[int, _Lane] = {}

    def _lane(self, device: int) -> _Lane:
        lane = self._lanes.get(device)
        if lane is None:
            lane = self._lanes[device] = _Lane(device, HALF_NBYTES)
        return lane

    def receive(self, recv_into_address: Any, fd: int, address: int, nbytes: int,
                device: int) -> None:
        """Receive ``nbytes`` from ``fd`` into GPU memory at ``address`` (returns once
        they are there)."""
        lane = self._lane(device)
        base, stream = lane.buffer.address, lane.stream
        done, k = 0, 0
        while done < nbytes:
            half, n = k % 2, min(lane.half, nbytes - done)
            if lane.used[half]:
                lane.events[half].synchronize()
            pinned = base + half * lane.half
            recv_into_address(fd, pinned, n)
            cuda.copy_async(address + done, pinned, n, stream)
            lane.events[half].record(stream)
            lane.used[half] = True
            done, k = done + n, k + 1
        stream.synchronize()
        lane.used = [False, False]

    def send(self, send_frame: Any, fd: int, header: bytes, address: int, nbytes: int,
             device: int) -> None:
        """Send ``header`` and then ``nbytes`` of GPU memory at ``address`` on ``fd``."""
        lane = self._lane(device)
        base, stream = lane.buffer.address, lane.stream
        first = min(lane.half, nbytes)
        cuda.copy_async(base, address, first, stream)
        lane.events[0].record(stream)
        done, k = 0, 0
        while done < nbytes:
            half, n = k % 2, min(lane.half, nbytes - done)
            lane.events[half].synchronize()
            nxt = min(lane.half, nbytes - done - n)
            if nxt:  # the other half was sent last round: fill it while this one goes out
                other = 1 - half
                cuda.copy_async(base + other * lane.half, address + done + n, nxt, stream)
                lane.events[other].record(stream)
            send_frame(fd, header, base + half * lane.half, n)
            header = b""
            done, k = done + n, k + 1

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()


class Staged(Transport):
    """``inner`` moving slices whose local side is GPU memory, through pinned memory."""

    memory_kinds = frozenset({HOST, CUDA})

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.name = inner.name  # a transport hint ("tcp") selects its staged form too
        self.priority = inner.priority
        self.task_nbytes = inner.task_nbytes
        self._local = threading.local()
        self._lanes: list[_Lane] = []
        self._lock = threading.Lock()
        self._closed = False

    def supports(self, peer: Peer) -> bool:
        return self.inner.supports(peer)

    def moves(self, local_kind: str, remote_kind: str) -> bool:
        return local_kind == CUDA and self.inner.moves(HOST, remote_kind)

    def _lane(self, device: int) -> _Lane:
        lanes = getattr(self._local, "lanes", None)
        if lanes is None:
            lanes = self._local.lanes = {}
        lane = lanes.get(device)
        if lane is None:
            with self._lock:
                if self._closed:
                    raise TransferError("the transfer engine is closed")
                lane = lanes[device] = _Lane(device, HALF_NBYTES)
                self._lanes.append(lane)
        return lane

    def execute(self, peer: Peer, op: int, local_address: int, remote_address: int,
                nbytes: int) -> None:
        self.execute_many(peer, [(0, op, local_address, remote_address, nbytes)])

    def execute_many(self, peer: Peer, slices: list[tuple[int, int, int, int, int]]) -> None:
        if not slices:
            return
        try:
            lane = self._lane(cuda.pointer_info(slices[0][2]).device)
            for op, group in _groups(slices, lane.half):
                (self._write if op == OP_WRITE else self._read)(peer, lane, group)
        except AddressError as exc:  # positions of the inner transport are not ours
            raise AddressError(str(exc)) from exc
        except (MooncakeError, OSError) as exc:
            raise TransferError(f"staged {self.inner.name} transfer failed: {exc}") from exc

    def _write(self, peer: Peer, lane: _Lane, groups: list[list[tuple]]) -> None:
        base, stream = lane.buffer.address, lane.stream
        pending: list[tuple] | None = None
        for g, group in enumerate(groups):
            half = g % 2
            staged, offset = [], base + half * lane.half
            for index, op, local, remote, n in group:
                cuda.copy_async(offset, local, n, stream)
                staged.append((index, op, offset, remote, n))
                offset += n
            lane.events[half].record(stream)
            if pending is not None:  # the other half, filled before: sent while this one fills
                self.inner.execute_many(peer, pending)
            lane.events[half].synchronize()
            pending = staged
        if pending is not None:
            self.inner.execute_many(peer, pending)

    def _read(self, peer: Peer, lane: _Lane, groups: list[list[tuple]]) -> None:
        base, stream = lane.buffer.address, lane.stream
        for g, group in enumerate(groups):
            half = g % 2
            if lane.used[half]:  # its last H2D must be done before it is received into again
                lane.events[half].synchronize()
            staged, offset = [], base + half * lane.half
            for index, op, local, remote, n in group:
                staged.append((index, op, offset, remote, n))
                offset += n
            self.inner.execute_many(peer, staged)
            for (_, _, pinned, _, n), (_, _, local, _, _) in zip(staged, group):
                cuda.copy_async(local, pinned, n, stream)
            lane.events[half].record(stream)
            lane.used[half] = True
        stream.synchronize()
        lane.used = [False, False]

    def forget(self, peer: Peer) -> None:
        self.inner.forget(peer)

    def close(self) -> None:
        """Free every worker's buffers (the wrapped transport is closed by its owner)."""
        with self._lock:
            self._closed = True
            lanes, self._lanes = self._lanes, []
        for lane in lanes:
            lane.close()

    def __repr__(self) -> str:
        return f"<Staged {self.inner!r}>"


def _groups(slices: list[tuple[int, int, int, int, int]], half: int
            ) -> list[tuple[int, list[list[tuple]]]]:
    """``slices`` as runs of one op, each cut into groups of at most ``half`` bytes (a
    slice larger than ``half`` is cut too)."""
    runs: list[tuple[int, list[list[tuple]]]] = []
    used = 0  # bytes in the current group
    for index, op, local, remote, n in slices:
        if not runs or runs[-1][0] != op:
            runs.append((op, [[]]))
            used = 0
        groups = runs[-1][1]
        done = 0
        while done < n:
            if used >= half:
                groups.append([])
                used = 0
            take = min(n - done, half - used)
            groups[-1].append((index, op, local + done, remote + done, take))
            done += take
            used += take
    return runs
