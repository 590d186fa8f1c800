"""The table of registered transports: name -> (module, class name), nothing imported.

It sits below both of its readers, as ``errors.py`` does for exceptions: ``config.py``
checks ``EngineConfig.transports`` (``MC_TRANSPORTS``) against these names, and
``transfer/transports/registry.py`` imports and builds the entries (it takes
``EngineConfig`` from ``config.py``). This module imports nothing of the package.

Any thread may call these functions; ``_LOCK`` guards the table and is a leaf lock.
"""

from __future__ import annotations

import threading

_TABLE: dict[str, tuple[str, str]] = {
    "tcp": ("mooncake_plugins.transfer.transports.tcp", "TcpTransport"),
    "shm": ("mooncake_plugins.transfer.transports.shm", "ShmTransport"),
    "cuda_ipc": ("mooncake_plugins.transfer.transports.cuda_ipc", "CudaIpcTransport"),
    "rdma": ("mooncake_plugins.transfer.transports.rdma", "RdmaTransport"),
}
_LOCK = threading.Lock()


def register_transport(name: str, module: str, class_name: str, *, replace: bool = False) -> None:
    """Register transport ``name`` as ``module.class_name`` (imported when first built).

    Raises:
        ValueError: ``name`` is taken (unless ``replace``) or not a plain name.
    """
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"transport name {name!r} must be letters, digits, '_' and '-'")
    with _LOCK:
        if name in _TABLE and not replace and _TABLE[name] != (module, class_name):
            raise ValueError(f"transport {name!r} is already registered as "
                             f"{'.'.join(_TABLE[name])}")
        _TABLE[name] = (module, class_name)


def unregister_transport(name: str) -> None:
    """Remove transport ``name`` from the registry (engines built already keep theirs)."""
    with _LOCK:
        _TABLE.pop(name, None)


def transport_names() -> list[str]:
    """Registered transport names, in registration order (loadable here or not)."""
    with _LOCK:
        return list(_TABLE)


def entries() -> list[tuple[str, str, str]]:
    """``(name, module, class name)`` of every registered transport."""
    with _LOCK:
        return [(name, module, cls) for name, (module, cls) in _TABLE.items()]


def lookup(name: str) -> tuple[tuple[str, str] | None, list[str]]:
    """``((module, class name) or None, every registered name, sorted)``, read at once."""
    with _LOCK:
        return _TABLE.get(name), sorted(_TABLE)
