"""Which data path this process runs: the native (Cython) modules or the Python fallbacks.

``MOONCAKE_PUREPYTHON=1`` picks the fallbacks at import; :func:`use` switches at run time,
for engines and store clients created afterwards (the tests run both in one session).
"""

from __future__ import annotations

from . import memory
from .transports import shm, tcp

NAMES = ("native", "python")


def use(name: str) -> None:
    """Select ``"native"`` or ``"python"``.

    Raises:
        ValueError: another name.
        ImportError: ``"native"`` but the extensions are not built (``pip install -e .``).
    """
    if name not in NAMES:
        raise ValueError(f"implementation must be one of {NAMES}, got {name!r}")
    native = name == "native"
    memory.use(native)
    tcp.use(native)
    shm.use(native)


def current() -> str:
    """The implementation in use (``"native"`` or ``"python"``)."""
    return memory.IMPLEMENTATION
