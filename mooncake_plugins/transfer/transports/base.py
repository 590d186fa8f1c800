"""Transport ABC: what a transport declares (reach, memory kinds, rank) and does.

A transport executes one slice at a time, blocking, on an engine worker thread; the
engine owns slicing, path choice and retries. It chooses among the transports built
from ``EngineConfig.transports`` through the registry (``registry.py``) by what each
class declares:

- ``supports(peer)``: whether it reaches that peer at all (shm and cuda_ipc: same host
  and a verified pid; tcp: everyone);
- ``memory_kinds``: the kinds of memory it moves, on either side of a slice
  (``segment.HOST``, ``segment.CUDA``); ``moves(local_kind, remote_kind)`` refines the pairs;
- ``priority``: its rank among the transports that qualify, highest first
  (:data:`PRIORITY_CUDA_IPC` > :data:`PRIORITY_SHM` > :data:`PRIORITY_RDMA` >
  :data:`PRIORITY_TCP`); a slice failing on one is retried on the next.

Native modules are imported only when a transport is first built, so a missing system
library becomes ``TransportUnavailable`` at use time, never an import error.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import logging
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from ...config import PURE_PYTHON
from ..peer import Peer
from ..segment import HOST

if TYPE_CHECKING:
    from ...config import EngineConfig

log = logging.getLogger(__name__)

OP_READ = 1
OP_WRITE = 2

HOST_KINDS = (HOST, HOST)
"""``(local kind, remote kind)`` of a slice between two host buffers."""

PRIORITY_CUDA_IPC = 40
PRIORITY_SHM = 30
PRIORITY_RDMA = 20
PRIORITY_TCP = 10


def use_default(use: Callable[[bool], None], what: str) -> None:
    """Call ``use(True)`` (native) unless MOONCAKE_PUREPYTHON=1 or it is not built, else
    ``use(False)`` (the Python fallback); a missing build is logged."""
    if not PURE_PYTHON:
        try:
            use(True)
            return
        except ImportError as exc:  # pragma: no cover - depends on the build
            log.warning("native %s unavailable (%s); using the Python fallback", what, exc)
    use(False)


class Transport(ABC):
    """One way of reaching peers.

    Class-level declarations (see the module docstring) are what the engine's path
    choice reads; a new transport is a subclass declaring them plus one registry entry.

    Thread model: ``execute`` is called concurrently from the engine's worker threads.
    """

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0
    """Rank among the transports that reach a peer and move a slice's memory: higher first."""
    memory_kinds: ClassVar[frozenset[str]] = frozenset({HOST})
    """Memory kinds this transport moves, local and remote side alike."""
    task_nbytes: ClassVar[int] = 0
    """Bytes of slices worth handing to one ``execute_many`` (0: the engine's slice size)."""

    @classmethod
    def from_config(cls, config: "EngineConfig") -> "Transport":
        """Build one for an engine with ``config`` (default: no arguments)."""
        return cls()

    @abstractmethod
    def supports(self, peer: Peer) -> bool:
        """Whether this transport can reach ``peer`` at all."""

    def moves(self, local_kind: str, remote_kind: str) -> bool:
        """Whether this transport moves slices between ``local_kind`` memory here and
        ``remote_kind`` memory of the peer (default: both kinds in ``memory_kinds``)."""
        return local_kind in self.memory_kinds and remote_kind in self.memory_kinds

    @abstractmethod
    def execute(self, peer: Peer, op: int, local_address: int, remote_address: int,
                nbytes: int) -> None:
        """Move one slice (blocking). Raises TransferError/AddressError/OSError on failure."""

    def execute_many(self, peer: Peer, slices: list[tuple[int, int, int, int, int]]) -> None:
        """Move several ``(request index, op, local, remote, nbytes)`` slices, all or raise.

        The default runs ``execute`` one by one; a transport overrides it where a batch
        is cheaper than its parts (shm copies them in one native call).
        """
        for _, op, local, remote, n in slices:
            self.execute(peer, op, local, remote, n)

    control_commands: ClassVar[frozenset[str]] = frozenset()
    """Control commands of the rpc port this transport serves (see :meth:`serve_control`)."""

    def attach(self, control: Any, segment: str) -> None:
        """Given once by the engine: its control client (``control(host, port, cmd,
        **fields)``) and its segment name, for transports that handshake with peers."""

    def published(self) -> dict[str, Any]:
        """Fields this transport adds to the engine's segment descriptor (default none)."""
        return {}

    def register_region(self, address: int, nbytes: int, location: str, readonly: bool,
                        private: bool) -> tuple[int, ...]:
        """Called for every region the engine registers, before it is published; returns
        the keys peers need to reach it through this transport (default: none needed)."""
        return ()

    def unregister_region(self, address: int) -> None:
        """Called once the region at ``address`` is unpublished, before its memory is let
        go: afterwards no peer may reach it through this transport."""

    def serve_control(self, msg: dict) -> bytes:
        """Serve a validated control message whose ``cmd`` is in ``control_commands``."""
        raise NotImplementedError(msg["cmd"])

    def forget(self, peer: Peer) -> None:
        """Drop cached connections or mappings of a peer (it went away or changed)."""

    def close(self) -> None:
        """Release every resource; the transport is unusable afterwards."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} priority={self.priority} " \
               f"kinds={sorted(self.memory_kinds)}>"
