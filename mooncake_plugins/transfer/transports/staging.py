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
first use, freed with the transport). The engine offers a ``Staged`` path for slices from
GPU memory where a CUDA driver is loaded, after the transports that move GPU memory
themselves (cuda_ipc).

The target's side of tcp is :class:`ServerStaging`: a tcp server connection receives a
WRITE into a GPU region, and answers a READ from one, in ``HALF_NBYTES`` chunks through
the same two-half pipelines (``_Lane.to_device``, ``_Lane.from_device``). shm cannot reach
a peer's GPU memory (the CPU copies it); cuda_ipc does, on one host.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ...errors import AddressError, MooncakeError, TransferError
from .. import cuda
from ..peer import Peer
from ..segment import CUDA, HOST
from .base import OP_WRITE, Transport

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

    def _pinned(self, half: int, group: list[tuple]) -> list[int]:
        """Where each slice of ``group`` sits in ``half`` of the bounce buffer."""
        out, offset = [], self.buffer.address + half * self.half
        for s in group:
            out.append(offset)
            offset += s[4]
        return out

    def to_device(self, groups: list[list[tuple]], receive: Callable[[list[int], list[tuple]], None]
                  ) -> None:
        """Into GPU memory: for each group of ``(index, op, device address, remote, nbytes)``
        slices, ``receive(pinned addresses, group)`` fills its half of the bounce buffer,
        then its H2D copies are queued while the next group is received into the other half
        (a half is refilled only after its copies ended). Returns once every byte landed."""
        for g, group in enumerate(groups):
            half = g % 2
            if self.used[half]:
                self.events[half].synchronize()
            pinned = self._pinned(half, group)
            receive(pinned, group)
            for at, s in zip(pinned, group):
                cuda.copy_async(s[2], at, s[4], self.stream)
            self.events[half].record(self.stream)
            self.used[half] = True
        self.stream.synchronize()
        self.used = [False, False]

    def from_device(self, groups: list[list[tuple]], send: Callable[[list[int], list[tuple]], None]
                    ) -> None:
        """Out of GPU memory: each group's D2H copies into its half are queued, then the
        group before (in the other half) goes out with ``send(pinned addresses, group)``,
        then this group's copies are waited for."""
        pending: tuple[list[int], list[tuple]] | None = None
        for g, group in enumerate(groups):
            half = g % 2
            pinned = self._pinned(half, group)
            for at, s in zip(pinned, group):
                cuda.copy_async(at, s[2], s[4], self.stream)
            self.events[half].record(self.stream)
            if pending is not None:
                send(*pending)
            self.events[half].synchronize()
            pending = (pinned, group)
        if pending is not None:
            send(*pending)

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
        lane.to_device(_chunks(address, nbytes, lane.half),
                       lambda pinned, group: recv_into_address(fd, pinned[0], group[0][4]))

    def send(self, send_frame: Any, fd: int, header: bytes, address: int, nbytes: int,
             device: int) -> None:
        """Send ``header`` and then ``nbytes`` of GPU memory at ``address`` on ``fd``."""
        lane = self._lane(device)
        headers = [header]  # the first chunk goes out with it

        def out(pinned: list[int], group: list[tuple]) -> None:
            send_frame(fd, headers.pop() if headers else b"", pinned[0], group[0][4])

        lane.from_device(_chunks(address, nbytes, lane.half), out)

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

        def over_inner(pinned: list[int], group: list[tuple]) -> None:
            """The wrapped transport moves the group from or into its pinned places."""
            self.inner.execute_many(peer, [(index, op, at, remote, n) for at, (index, op, _, remote, n)
                                           in zip(pinned, group)])

        try:
            lane = self._lane(cuda.pointer_info(slices[0][2]).device)
            for op, groups in _groups(slices, lane.half):
                (lane.from_device if op == OP_WRITE else lane.to_device)(groups, over_inner)
        except AddressError as exc:  # positions of the inner transport are not ours
            raise AddressError(str(exc)) from exc
        except (MooncakeError, OSError) as exc:
            raise TransferError(f"staged {self.inner.name} transfer failed: {exc}") from exc

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


def _chunks(address: int, nbytes: int, half: int) -> list[list[tuple]]:
    """``[address, address + nbytes)`` as one-slice groups of at most ``half`` bytes (the
    tcp server's requests: only the device address and the length are used)."""
    return [[(0, 0, address + off, 0, min(half, nbytes - off))] for off in range(0, nbytes, half)]


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
