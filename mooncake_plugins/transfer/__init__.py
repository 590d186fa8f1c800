"""The Transfer Engine: registered memory, segments, batches, transports and metadata.

Public names: :class:`TransferEngine`, :class:`TransferRequest`, :class:`OpCode`,
:class:`TransferStatus`, :class:`Batch`. Transports live in ``transports/`` (chosen
through ``transports/registry.py``), metadata backends in ``metadata/``.

The engine module is imported on first use of its names, so that importing a transport
(``transfer.transports.tcp``) never imports the engine that builds it.
"""

from typing import TYPE_CHECKING, Any

from .batch import Batch, OpCode, TransferRequest, TransferStatus

if TYPE_CHECKING:
    from .engine import ManagedBuffer, TransferEngine

__all__ = ["Batch", "ManagedBuffer", "OpCode", "TransferEngine", "TransferRequest", "TransferStatus"]

_FROM_ENGINE = ("ManagedBuffer", "TransferEngine")


def __getattr__(name: str) -> Any:
    if name in _FROM_ENGINE:
        from . import engine
        value = getattr(engine, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
