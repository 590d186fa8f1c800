"""Connector settings from vLLM's ``kv_connector_extra_config``: a frozen dataclass per
connector, filled by :func:`from_extra_config` (conversion and errors naming the key:
:mod:`mooncake_plugins.store.client_settings`)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, TypeVar

from mooncake_plugins.store.client_settings import ClientSettings, settings_from

T = TypeVar("T")


def from_extra_config(cls: type[T], extra: Mapping[str, Any] | None, connector: str) -> T:
    """``cls`` from ``kv_connector_extra_config``; ValueError naming the key otherwise."""
    return settings_from(cls, (extra or {}).items(), f"{connector} kv_connector_extra_config")


def default_hostname() -> str:
    """The address peers reach this process at: vLLM's own ``VLLM_HOST_IP`` when set."""
    return os.environ.get("VLLM_HOST_IP") or "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class StoreSettings(ClientSettings):
    """The store connector's keys: where the store is, how this engine uses it."""

    local_hostname: str = dataclasses.field(default_factory=default_hostname)
    save_decode_cache: bool = False
    """Also save blocks filled by generated tokens (default: prompt blocks only)."""
    load_mode: str = "auto"
    """"layerwise": each attention layer waits only for its own layer's reads (they overlap
    the forward pass of the layers before); "whole": every layer of the step's blocks is
    read in one batch before the first layer runs; "auto": layer-wise when vLLM left a
    core free of compute threads for the transfers, whole otherwise (reads on a compute
    core would stall the forward pass's parallel regions)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.load_mode not in ("auto", "layerwise", "whole"):
            raise ValueError(f"load_mode {self.load_mode!r}: expected 'auto', 'layerwise' "
                             "or 'whole'")


@dataclasses.dataclass(frozen=True)
class PDSettings:
    """How prefill and decode workers reach each other (the P/D connector's keys)."""

    local_hostname: str = dataclasses.field(default_factory=default_hostname)
    """Address this worker's transfer engine and side channel listen on (and advertise)."""
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    """"tcp": shared memory to a decode on this host, tcp to others; "shm": this host only."""
    side_channel_port: int = 0
    """Prefill side: TP rank r listens on this port + r (0: a free port each, advertised
    in the request's kv_transfer_params)."""
    connect_timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0
    """Longest a prefill worker may take to write one request's blocks."""
    pull_wait_s: float = 30.0
    """How long a decode's request may wait for the prefill to finish computing."""
    abort_timeout_s: float = 120.0
    """Prefill side: blocks of a request no decode asked for are freed after this."""
    pull_threads: int = 4
    """Decode side: requests asked for at once."""

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "shm", "rdma"):
            raise ValueError(f"protocol {self.protocol!r}: bytes move over 'tcp' (shared "
                             "memory between processes of one host is used automatically), "
                             "'rdma' (where the hosts have RDMA devices; tcp otherwise) or "
                             "'shm'")
        if not 0 <= self.side_channel_port < 65536:
            raise ValueError(f"side_channel_port {self.side_channel_port} is not a port")
        for name in ("connect_timeout_s", "transfer_timeout_s", "pull_wait_s",
                     "abort_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 1 <= self.pull_threads <= 64:
            raise ValueError(f"pull_threads must be in 1..64, got {self.pull_threads}")
