"""Space inside mounted segments: an offset allocator per segment, and placement strategies.

The master owns all of it (no bytes here, only offsets). Not thread-safe on its own: the
master calls it under its lock.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field

from ..errors import InvalidParams

ALIGN = 64
"""Every allocation starts on a cache line."""


def align(n: int) -> int:
    """Bytes a block of ``n`` takes (rounded up to :data:`ALIGN`)."""
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class OffsetAllocator:
    """First-fit allocator over ``[0, nbytes)`` with coalescing of freed neighbours."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.used = 0
        self._starts: list[int] = [0]   # free blocks, sorted by offset
        self._sizes: list[int] = [nbytes]

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a new block of ``nbytes`` (rounded up to ALIGN), or None when full."""
        need = align(nbytes)
        for i, size in enumerate(self._sizes):
            if size >= need:
                off = self._starts[i]
                if size == need:
                    del self._starts[i]
                    del self._sizes[i]
                else:
                    self._starts[i] += need
                    self._sizes[i] -= need
                self.used += need
                return off
        return None

    def allocate_high(self, nbytes: int) -> int | None:
        """As :meth:`allocate`, from the top of the last free block that fits: space kept
        for a long time (reserved slots) gathers at the end instead of splitting the free
        space that large objects need."""
        need = align(nbytes)
        for i in range(len(self._sizes) - 1, -1, -1):
            size = self._sizes[i]
            if size >= need:
                off = self._starts[i] + size - need
                if size == need:
                    del self._starts[i]
                    del self._sizes[i]
                else:
                    self._sizes[i] -= need
                self.used += need
                return off
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return a block from :meth:`allocate`; neighbours are merged."""
        size = align(nbytes)
        i = bisect.bisect_left(self._starts, offset)
        if (i < len(self._starts) and self._starts[i] < offset + size) or \
                (i and self._starts[i - 1] + self._sizes[i - 1] > offset):
            raise InvalidParams(f"double free of block {offset}+{size}")
        self.used -= size
        if i and self._starts[i - 1] + self._sizes[i - 1] == offset:
            i -= 1
            self._sizes[i] += size
        else:
            self._starts.insert(i, offset)
            self._sizes.insert(i, size)
        if i + 1 < len(self._starts) and self._starts[i] + self._sizes[i] == self._starts[i + 1]:
            self._sizes[i] += self._sizes.pop(i + 1)
            del self._starts[i + 1]

    def rebuild(self, used: list[tuple[int, int]]) -> set[tuple[int, int]]:
        """Reset to exactly the ``(offset, nbytes)`` blocks of ``used`` allocated (a recovered
        index), in O(n log n). Returns the blocks left out: outside the range or overlapping
        an earlier one."""
        self._starts, self._sizes, self.used = [], [], 0
        bad: set[tuple[int, int]] = set()
        end = 0
        for off, n in sorted(used):
            size = align(n)
            if off < end or off % ALIGN or off + size > self.nbytes:
                bad.add((off, n))
                continue
            if off > end:
                self._starts.append(end)
                self._sizes.append(off - end)
            end = off + size
            self.used += size
        if end < self.nbytes:
            self._starts.append(end)
            self._sizes.append(self.nbytes - end)
        return bad

    @property
    def largest_free(self) -> int:
        return max(self._sizes, default=0)


@dataclass(eq=False)
class MountedSegment:
    """A client's contribution to the pool: engine segment name and a registered range."""

    name: str
    client_id: str
    base: int
    nbytes: int
    host_id: str
    allocator: OffsetAllocator = field(init=False)

    def __post_init__(self) -> None:
        self.allocator = OffsetAllocator(self.nbytes)

    @property
    def free_ratio(self) -> float:
        return 1.0 - self.allocator.used / self.nbytes


STRATEGIES = ("random", "free_ratio_first", "local_first")


def order_segments(segments: list[MountedSegment], strategy: str, preferred: list[str],
                   local_host_id: str | None, rng: random.Random) -> list[MountedSegment]:
    """Candidate segments for one object, best first.

    Segments named in ``preferred`` always come first (in the given order); then
    ``random`` shuffles, ``free_ratio_first`` sorts by free space, ``local_first`` puts
    segments on the writer's host first (then by free space).
    """
    if strategy not in STRATEGIES:
        raise InvalidParams(f"unknown allocation strategy {strategy!r}; use one of {STRATEGIES}")
    rest = [s for s in segments if s.name not in preferred]
    if strategy == "random":
        rng.shuffle(rest)
    elif strategy == "free_ratio_first":
        rest.sort(key=lambda s: s.free_ratio, reverse=True)
    else:
        rest.sort(key=lambda s: (s.host_id != local_host_id, -s.free_ratio))
    by_name = {s.name: s for s in segments}
    return [by_name[n] for n in preferred if n in by_name] + rest
