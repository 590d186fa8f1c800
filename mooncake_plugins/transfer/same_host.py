"""What an engine publishes for peers on its own host, whichever transports reach it.

- Its memfds (:func:`memfd_create`): the memory an engine allocates (``allocate``) and its
  epoch page are memfd-backed, so that same-host peers map them through
  ``/proc/<pid>/fd/<n>``; peers map only files named with :data:`MEMFD_PREFIX`.
- Its epoch page: one memfd page holding :data:`EPOCH`, a counter the engine bumps on
  every (un)registration before it releases any memory. Peers read it before and after a
  copy (a seqlock) to tell whether the regions changed meanwhile.
- Its live region table, for engines of this very process (:func:`publish_local`,
  :func:`local_table`): they copy against it directly, holding the regions as the tcp
  server would.

The engine writes all three (``engine.py``); the shm and cuda_ipc transports read them.
Any thread may call these functions; ``_LOCAL_LOCK`` is a leaf lock.
"""

from __future__ import annotations

import os
import struct
import threading

from .segment import RegionTable

EPOCH = struct.Struct("<Q")
"""The epoch page's layout: the engine's registration epoch at offset 0."""

MEMFD_PREFIX = "/memfd:mooncake-"
"""What an engine's memfds (buffers and the epoch page) are called in /proc/<pid>/fd."""

_LOCAL_TABLES: dict[int, RegionTable] = {}
_LOCAL_LOCK = threading.Lock()


def memfd_create(name: str) -> int:
    """Create an anonymous memory file (close-on-exec) called ``name`` and return its fd.

    Raises:
        OSError: the kernel refused (no memfd support, out of fds).
    """
    return os.memfd_create(name, os.MFD_CLOEXEC)


def publish_local(port: int, table: RegionTable | None) -> None:
    """Make an engine of this process reachable by same-process copies (None: withdraw)."""
    with _LOCAL_LOCK:
        if table is None:
            _LOCAL_TABLES.pop(port, None)
        else:
            _LOCAL_TABLES[port] = table


def local_table(port: int) -> RegionTable | None:
    """The region table of the engine of this process whose rpc port is ``port`` (None:
    none, or it closed)."""
    with _LOCAL_LOCK:
        return _LOCAL_TABLES.get(port)
