"""The transport registry: name -> (module, class), imported only when first built.

The engine builds the transports named in ``EngineConfig.transports`` (``MC_TRANSPORTS``)
through :func:`build_transport` and ranks them with :func:`rank`; it imports no transport
class itself. Adding a transport (rdma, cuda_ipc, a NIXL backend) is one
:func:`~mooncake_plugins.transport_table.register_transport` call (or one line in its
table, ``transport_table.py``, which sits below ``config.py`` so that both read it) and a
:class:`~.base.Transport` subclass declaring ``name``, ``priority``, ``memory_kinds`` and
``supports``. An entry whose module or system library cannot load is
``TransportUnavailable`` when built, never an import error.
"""

from __future__ import annotations

import importlib
from typing import Any, Iterable

from ...config import EngineConfig
from ...errors import TransportUnavailable
from ...transport_table import lookup
from .base import Transport

OPT_IN = frozenset({"cuda_ipc"})
"""Transports of the default list that an engine builds only where their device is already
in use (CUDA: a driver loaded in the process), silently skipped elsewhere."""
QUIET = frozenset({"cuda_ipc", "rdma"})
"""Transports of the default list whose absence (no device here) is logged at debug level:
most machines have neither."""

CONTROL = "tcp"
"""The transport whose client also carries control messages (describe, notify) to a
peer's rpc port: every engine builds it, whether or not it moves data."""


def transport_class(name: str) -> type[Transport]:
    """Import and return the class registered as ``name``.

    Raises:
        TransportUnavailable: unknown name, or its module or class cannot be loaded here.
    """
    entry, known = lookup(name)
    if entry is None:
        raise TransportUnavailable(f"unknown transport {name!r}; known: {known}")
    module_name, class_name = entry
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TransportUnavailable(f"transport {name!r} is unavailable here: its module "
                                   f"{module_name} cannot be imported ({exc})") from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TransportUnavailable(f"transport {name!r} is unavailable here: {module_name} "
                                   f"has no Transport class {class_name!r}")
    return cls


def _construct(name: str, make: Any) -> Transport:
    try:
        return make()
    except (ImportError, OSError) as exc:  # a native module or system library it needs
        raise TransportUnavailable(f"transport {name!r} is unavailable here: {exc}") from exc


def build_transport(name: str, config: EngineConfig | None = None) -> Transport:
    """Build transport ``name`` for an engine with ``config`` (``cls.from_config``).

    Raises:
        TransportUnavailable: unknown, or unusable here (module, library or device missing).
    """
    cls = transport_class(name)
    if config is None:
        config = EngineConfig()
    return _construct(name, lambda: cls.from_config(config))


def get_transport(name: str, **kwargs: Any) -> Transport:
    """Build transport ``name`` with constructor ``kwargs``; TransportUnavailable when
    unknown or unusable here."""
    cls = transport_class(name)
    return _construct(name, lambda: cls(**kwargs))


def rank(transports: Iterable[Transport]) -> list[Transport]:
    """``transports`` best first: by declared ``priority``, highest first; equal
    priorities keep their given order."""
    return sorted(transports, key=lambda t: -t.priority)
