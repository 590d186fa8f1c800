"""The only module that reads ``MC_*``/``MOONCAKE_*`` environment variables.

Every knob has a documented default; the engine and CLIs take an explicit
:class:`EngineConfig` and never read the environment themselves.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from typing import Any

from .transport_table import transport_names

PURE_PYTHON: bool = os.environ.get("MOONCAKE_PUREPYTHON") == "1"
"""Force the pure-Python fallbacks even where the native extensions are built."""


def libcuda_path(env: Any = None) -> str | None:
    """``MOONCAKE_LIBCUDA``: the CUDA driver library to load instead of looking for
    ``libcuda.so.1`` in the usual places (``env``: a mapping to read instead of the
    process environment)."""
    return (os.environ if env is None else env).get("MOONCAKE_LIBCUDA") or None


def gid_index(env: Any = None) -> int | None:
    """``MC_GID_INDEX``: the GID table entry RDMA queue pairs must use (unset or -1: the
    best one, see ``nic_topology.choose_gid``)."""
    raw = (os.environ if env is None else env).get("MC_GID_INDEX", "")
    if raw in ("", "-1"):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable MC_GID_INDEX={raw!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"MC_GID_INDEX={value}: an index >= 0, or -1 for automatic")
    return value


def libibverbs_path(env: Any = None) -> str | None:
    """``MOONCAKE_LIBIBVERBS``: the libibverbs library to load instead of
    ``libibverbs.so.1`` from the usual places."""
    return (os.environ if env is None else env).get("MOONCAKE_LIBIBVERBS") or None


def nixl_plugin_dir_auto() -> bool:
    """Whether our vLLM plugin points NIXL at our plugin directory where NIXL is
    installed and ``NIXL_PLUGIN_DIR`` is unset (``MC_NIXL_PLUGIN_DIR=0``: it does not)."""
    return os.environ.get("MC_NIXL_PLUGIN_DIR") != "0"


DEFAULT_TRANSPORTS: tuple[str, ...] = ("cuda_ipc", "shm", "rdma", "tcp")


def apply_protocol(cfg: "EngineConfig", protocol: str) -> None:
    """Fit ``cfg.transports`` to the original API's ``protocol``: ``"tcp"`` (and ``"shm"``)
    mean no rdma, as in the original; ``"rdma"`` keeps the list. An explicit
    ``MC_TRANSPORTS`` is kept as given."""
    if protocol in ("tcp", "shm") and not os.environ.get("MC_TRANSPORTS"):
        cfg.transports = [t for t in cfg.transports if t != "rdma"]
"""Transports of an engine not told otherwise. ``cuda_ipc`` among them is used only in a
process that already loaded a CUDA driver (a framework using the GPU), and is silently off
elsewhere; named in MC_TRANSPORTS, it loads the driver, with a warning where it cannot."""


MAX_TCP_PATHS = 16
"""Addresses one engine may publish for tcp (a descriptor with more is refused)."""


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from None


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as "4GB", "512MiB", "64 kb" or "1073741824".

    Raises:
        ValueError: text that is no size, or a negative one.
    """
    if isinstance(value, bool):
        raise ValueError(f"bad size {value!r}: bytes, or e.g. '16MB', '4 GiB'")
    if isinstance(value, int):
        n = value
    else:
        text = str(value).strip().upper().replace("IB", "B")
        mult = 1
        for suffix, scale in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10),
                              ("B", 1)):
            if text.endswith(suffix):
                text, mult = text[:-len(suffix)].strip(), scale
                break
        try:
            n = int(float(text) * mult)
        except ValueError:
            raise ValueError(f"bad size {value!r}: bytes, or e.g. '16MB', '4 GiB'") from None
    if n < 0:
        raise ValueError(f"bad size {value!r}: negative")
    return n


def spin_us() -> int:
    """How long a socket peer busy-polls for the next frame before sleeping (MC_SPIN_US).

    Used by the store RPC and the tcp transport, on both sides of a call. Spinning saves
    the scheduler wakeup that dominates a loopback round trip on small VMs (measured
    here: an RPC went from about 120 us to 25 us), at the price of up to that much CPU
    per frame; 0 turns it off.
    """
    value = _int_env("MC_SPIN_US", 100)
    if not 0 <= value <= 100_000:
        raise ValueError(f"MC_SPIN_US={value} must be in [0, 100000]")
    return value


def _cpu_default() -> int:
    """One worker and one connection per core (2..16): more only contend for the cores
    (measured on 2 cores: 4 connections read 3.2-3.4 GB/s over loopback, 2 read 4.1-4.2)."""
    return min(16, max(2, os.cpu_count() or 2))


@dataclass
class EngineConfig:
    """Tunables of one :class:`~mooncake_plugins.transfer.engine.TransferEngine`.

    Attributes:
        slice_nbytes: large requests are cut into slices of this size (MC_SLICE_SIZE).
        workers: initiator threads executing slices (MC_WORKERS; default: one per core).
        connections_per_peer: tcp connections opened to one peer at most
            (MC_TCP_CONNECTIONS; default: one per core).
        transfer_timeout_s: socket deadline for one slice (MC_TRANSFER_TIMEOUT).
        connect_timeout_s: deadline for connecting to a peer (MC_CONNECT_TIMEOUT).
        transports: transports the engine may use (MC_TRANSPORTS, comma separated; names
            from the transport registry: "shm", "tcp", ...). Per peer and memory kind the
            engine uses those that qualify best first, by each transport's declared rank
            (cuda_ipc before shm before rdma before tcp; "shm" and "cuda_ipc" reach only
            same-host peers, "cuda_ipc" moves GPU memory only, "rdma" needs an RDMA
            device on both sides), not by this list's order. Default:
            :data:`DEFAULT_TRANSPORTS`.
        retries: extra attempts of a failed slice on another path (MC_RETRIES).
        inline_nbytes: batches up to this size run in the submitting thread, without a
            worker handoff (MC_INLINE_SIZE); ``submit`` then returns a finished batch.
        tcp_paths: more addresses of this host on which peers reach its rpc port, one per
            NIC or network to stripe over (MC_TCP_PATHS, comma separated); the engine
            listens on each and publishes them, and peers spread one transfer's slices
            over every address, weighted by what each delivers.
        path_pause_s: how long a tcp path that failed is left alone before it is tried
            again (MC_PATH_PAUSE); its slices go to the other paths meanwhile.
        rdma_devices: the RDMA devices the rdma transport may use (MC_RDMA_DEVICES,
            comma separated, the original's ``device_name``; empty: every device with an
            ACTIVE port).
    """

    slice_nbytes: int = 1 << 20
    workers: int = field(default_factory=lambda: _cpu_default())
    connections_per_peer: int = field(default_factory=lambda: _cpu_default())
    transfer_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    transports: list[str] = field(default_factory=lambda: list(DEFAULT_TRANSPORTS))
    retries: int = 1
    inline_nbytes: int = 256 << 10
    tcp_paths: list[str] = field(default_factory=list)
    path_pause_s: float = 5.0
    rdma_devices: list[str] = field(default_factory=list)

    @classmethod
    def from_env(cls) -> "EngineConfig":
        """Defaults overridden by the MC_* environment variables named above."""
        cfg = cls()
        cfg.slice_nbytes = _int_env("MC_SLICE_SIZE", cfg.slice_nbytes)
        cfg.workers = _int_env("MC_WORKERS", cfg.workers)
        cfg.connections_per_peer = _int_env("MC_TCP_CONNECTIONS", cfg.connections_per_peer)
        cfg.transfer_timeout_s = _float_env("MC_TRANSFER_TIMEOUT", cfg.transfer_timeout_s)
        cfg.connect_timeout_s = _float_env("MC_CONNECT_TIMEOUT", cfg.connect_timeout_s)
        cfg.retries = _int_env("MC_RETRIES", cfg.retries)
        cfg.inline_nbytes = _int_env("MC_INLINE_SIZE", cfg.inline_nbytes)
        raw = os.environ.get("MC_TRANSPORTS")
        if raw:
            cfg.transports = [t.strip() for t in raw.split(",") if t.strip()]
        cfg.tcp_paths = [a.strip() for a in os.environ.get("MC_TCP_PATHS", "").split(",")
                         if a.strip()]
        cfg.path_pause_s = _float_env("MC_PATH_PAUSE", cfg.path_pause_s)
        cfg.rdma_devices = [d.strip() for d in os.environ.get("MC_RDMA_DEVICES", "").split(",")
                            if d.strip()]
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not 4096 <= self.slice_nbytes <= 64 << 20:
            raise ValueError(f"slice_nbytes={self.slice_nbytes} must be in [4 KiB, 64 MiB]")
        if not 1 <= self.workers <= 256:
            raise ValueError(f"workers={self.workers} must be in [1, 256]")
        if not 1 <= self.connections_per_peer <= 64:
            raise ValueError(f"connections_per_peer={self.connections_per_peer} must be in [1, 64]")
        if self.transfer_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        if self.retries < 0 or self.inline_nbytes < 0:
            raise ValueError("retries and inline_nbytes must be >= 0")
        if self.path_pause_s < 0:
            raise ValueError(f"path_pause_s={self.path_pause_s} must be >= 0")
        if len(self.tcp_paths) > MAX_TCP_PATHS:
            raise ValueError(f"tcp_paths: at most {MAX_TCP_PATHS} addresses")
        for address in self.tcp_paths:
            try:
                ipaddress.ip_address(address)
            except ValueError:
                raise ValueError(f"tcp_paths: {address!r} is not an IP address") from None
        known = transport_names()
        unknown = set(self.transports) - set(known)
        if unknown or not self.transports:
            raise ValueError(f"transports={self.transports}: choose from "
                             + ", ".join(repr(n) for n in sorted(known)))
