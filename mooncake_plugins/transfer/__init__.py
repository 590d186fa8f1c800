"""The Transfer Engine: registered memory, segments, batches, transports and metadata.

Public names: :class:`TransferEngine`, :class:`TransferRequest`, :class:`OpCode`,
:class:`TransferStatus`, :class:`Batch`. Transports live in ``transports/``, metadata
backends in ``metadata/``.
"""

from .batch import Batch, OpCode, TransferRequest, TransferStatus
from .engine import ManagedBuffer, TransferEngine

__all__ = ["Batch", "ManagedBuffer", "OpCode", "TransferEngine", "TransferRequest", "TransferStatus"]
