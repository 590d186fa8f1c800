"""Transport ABC and the lazy name -> module registry.

A transport executes one slice at a time, blocking, on an engine worker thread; the
engine owns slicing, path choice and retries. Native modules are imported only when a
transport is first built, so a missing system library becomes ``TransportUnavailable``
at use time, never an import error.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
import logging
from typing import TYPE_CHECKING, Any, Callable

from ...config import PURE_PYTHON
from ...errors import TransportUnavailable

if TYPE_CHECKING:
    from ..engine import Peer

log = logging.getLogger(__name__)

OP_READ = 1
OP_WRITE = 2


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

    Thread model: ``execute`` is called concurrently from the engine's worker threads.
    """

    name: str = ""

    @abstractmethod
    def supports(self, peer: "Peer") -> bool:
        """Whether this transport can reach ``peer`` at all."""

    @abstractmethod
    def execute(self, peer: "Peer", op: int, local_address: int, remote_address: int,
                nbytes: int) -> None:
        """Move one slice (blocking). Raises TransferError/AddressError/OSError on failure."""

    def execute_many(self, peer: "Peer", slices: list[tuple[int, int, int, int, int]]) -> None:
        """Move several ``(request index, op, local, remote, nbytes)`` slices, all or raise.

        The default runs ``execute`` one by one; a transport overrides it where a batch
        is cheaper than its parts (shm copies them in one native call).
        """
        for _, op, local, remote, n in slices:
            self.execute(peer, op, local, remote, n)

    def forget(self, peer: "Peer") -> None:
        """Drop cached connections or mappings of a peer (it went away or changed)."""

    def close(self) -> None:
        """Release every resource; the transport is unusable afterwards."""


_REGISTRY: dict[str, tuple[str, str]] = {
    "tcp": ("mooncake_plugins.transfer.transports.tcp", "TcpTransport"),
    "shm": ("mooncake_plugins.transfer.transports.shm", "ShmTransport"),
}


def transport_names() -> list[str]:
    return list(_REGISTRY)


def get_transport(name: str, **kwargs: Any) -> Transport:
    """Build transport ``name``; TransportUnavailable when unknown or unusable here."""
    try:
        module_name, class_name = _REGISTRY[name]
    except KeyError:
        raise TransportUnavailable(f"unknown transport {name!r}; known: {sorted(_REGISTRY)}") from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TransportUnavailable(f"{name}: {exc}") from exc
    return getattr(module, class_name)(**kwargs)
