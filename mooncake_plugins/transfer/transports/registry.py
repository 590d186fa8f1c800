"""The transport registry: name -> (module, class), imported only when first built.

The engine builds the transports named in ``EngineConfig.transports`` (``MC_TRANSPORTS``)
through :func:`build_transport` and ranks them with :func:`rank`; it imports no transport
class itself. Adding a transport (rdma, cuda_ipc, a NIXL backend) is one
:func:`register_transport` call (or one line in ``_REGISTRY``) and a
:class:`~.base.Transport` subclass declaring ``name``, ``priority``, ``memory_kinds`` and
``supports``. An entry whose module or system library cannot load is
``TransportUnavailable`` when built, never an import error.
"""

from __future__ import annotations

import importlib
import threading
from typing import TYPE_CHECKING, Any, Iterable

from ...errors import TransportUnavailable
from .base import Transport

if TYPE_CHECKING:
    from ...config import EngineConfig

_REGISTRY: dict[str, tuple[str, str]] = {
    "tcp": ("mooncake_plugins.transfer.transports.tcp", "TcpTransport"),
    "shm": ("mooncake_plugins.transfer.transports.shm", "ShmTransport"),
    "cuda_ipc": ("mooncake_plugins.transfer.transports.cuda_ipc", "CudaIpcTransport"),
    "rdma": ("mooncake_plugins.transfer.transports.rdma", "RdmaTransport"),
}
OPT_IN = frozenset({"cuda_ipc"})
"""Transports of the default list that an engine builds only where their device is already
in use (CUDA: a driver loaded in the process), silently skipped elsewhere."""
QUIET = frozenset({"cuda_ipc", "rdma"})
"""Transports of the default list whose absence (no device here) is logged at debug level:
most machines have neither."""
_LOCK = threading.Lock()

CONTROL = "tcp"
"""The transport whose client also carries control messages (describe, notify) to a
peer's rpc port: every engine builds it, whether or not it moves data."""


def register_transport(name: str, module: str, class_name: str, *, replace: bool = False) -> None:
    """Register transport ``name`` as ``module.class_name`` (imported when first built).

    Raises:
        ValueError: ``name`` is taken (unless ``replace``) or not a plain name.
    """
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"transport name {name!r} must be letters, digits, '_' and '-'")
    with _LOCK:
        if name in _REGISTRY and not replace and _REGISTRY[name] != (module, class_name):
            raise ValueError(f"transport {name!r} is already registered as "
                             f"{'.'.join(_REGISTRY[name])}")
        _REGISTRY[name] = (module, class_name)


def unregister_transport(name: str) -> None:
    """Remove transport ``name`` from the registry (engines built already keep theirs)."""
    with _LOCK:
        _REGISTRY.pop(name, None)


def transport_names() -> list[str]:
    """Registered transport names, in registration order (loadable here or not)."""
    with _LOCK:
        return list(_REGISTRY)


def entries() -> list[tuple[str, str, str]]:
    """``(name, module, class name)`` of every registered transport."""
    with _LOCK:
        return [(name, module, cls) for name, (module, cls) in _REGISTRY.items()]


def transport_class(name: str) -> type[Transport]:
    """Import and return the class registered as ``name``.

    Raises:
        TransportUnavailable: unknown name, or its module or class cannot be loaded here.
    """
    with _LOCK:
        entry = _REGISTRY.get(name)
        known = sorted(_REGISTRY)
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


def build_transport(name: str, config: "EngineConfig | None" = None) -> Transport:
    """Build transport ``name`` for an engine with ``config`` (``cls.from_config``).

    Raises:
        TransportUnavailable: unknown, or unusable here (module, library or device missing).
    """
    cls = transport_class(name)
    if config is None:
        from ...config import EngineConfig
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
