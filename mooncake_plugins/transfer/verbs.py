"""RDMA devices through libibverbs, loaded at run time where present, never linked.

``_native.verbs`` is built by every native install (it needs no libibverbs headers); it
dlopens ``libibverbs.so.1`` (or ``MOONCAKE_LIBIBVERBS``) at first use. Every way this can
fail on a machine (a pure-Python install, library missing, a kernel without RDMA, no
device) is one sentence from :func:`why_unavailable`, never a crash. The rdma transport
(``transports/rdma.py``) opens devices, memory regions and queue pairs through
:func:`native`.
"""

from __future__ import annotations

import errno
import ipaddress
import threading
from typing import Any

from ..config import libibverbs_path
from ..errors import TransportUnavailable

LIBRARY = "libibverbs.so.1"

_lock = threading.Lock()
_devices: list[dict[str, Any]] | None = None
_reason = ""


class RdmaUnavailable(TransportUnavailable):
    """No RDMA here; the message says why in one sentence."""


def _load() -> None:
    global _devices, _reason
    with _lock:
        if _devices is not None or _reason:
            return
        try:
            from .._native import verbs as native
        except ImportError:
            _reason = ("the verbs module is not built (a pure-Python install: reinstall "
                       "without MOONCAKE_PUREPYTHON=1)")
            return
        path = libibverbs_path() or LIBRARY
        try:
            native.open_library(path)
        except OSError as exc:
            _reason = (f"{path} cannot be loaded ({exc}): install libibverbs1 (rdma-core) or "
                       f"set MOONCAKE_LIBIBVERBS to the library")
            return
        except LookupError as exc:
            _reason = f"{path} is not a usable libibverbs: {exc}"
            return
        try:
            _devices = native.list_devices()
        except OSError as exc:
            if exc.errno == errno.ENOSYS:
                _reason = "no RDMA device: this kernel has no RDMA support"
            else:
                _reason = f"no RDMA device: {exc.strerror or exc}"
            return
        if not _devices:
            _reason = "no RDMA device: libibverbs lists none"


def available() -> bool:
    """Whether libibverbs loaded and lists at least one device."""
    _load()
    return bool(_devices)


def why_unavailable() -> str:
    """The sentence saying why RDMA is not available here ("" when it is)."""
    _load()
    return _reason


def devices() -> list[dict[str, Any]]:
    """The devices libibverbs lists, with their ports' state, active MTU, LID, link layer
    and non-empty GIDs. Raises RdmaUnavailable with the reason when there is none."""
    _load()
    if not _devices:
        raise RdmaUnavailable(_reason)
    return _devices


def native() -> Any:
    """The loaded ``_native.verbs`` module (RdmaUnavailable when RDMA is not usable)."""
    devices()
    from .._native import verbs as module
    return module


def mtu_bytes(enum: int) -> int:
    """An ``ibv_mtu`` value (1..5) in bytes (256..4096); 0 when unknown."""
    return {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}.get(enum, 0)


def gid_bytes(text: str) -> bytes:
    """A GID's 16 bytes from its text (``fe80:0000:...`` as sysfs and the library print
    it, or any IPv6 form). ValueError when it is not one."""
    return ipaddress.IPv6Address(text).packed
