"""Connector settings from vLLM's ``kv_connector_extra_config``.

Each connector declares its settings as a frozen dataclass; :func:`from_extra_config`
fills one from the user's JSON, converting values by the field's type and naming the
field in every error, so a typo or a bad value fails at engine start, not at the first
request.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, TypeVar

from mooncake_plugins.config import parse_size

T = TypeVar("T")

SIZE = {"size": True}
"""Field metadata: the value is a byte count that also accepts strings like "4GB"."""


def _convert(field: dataclasses.Field, value: Any) -> Any:
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    if field.metadata.get("size"):
        return parse_size(value)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"expected true or false, got {value!r}")
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"expected a number, got {value!r}")
        return float(value)
    if kind == "str":
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported setting type {kind!r}")


def from_extra_config(cls: type[T], extra: Mapping[str, Any] | None, connector: str) -> T:
    """``cls`` (a dataclass) from ``kv_connector_extra_config``.

    Raises:
        ValueError: an unknown key (with the known ones listed) or a value of the wrong
            kind, naming the key and the connector.
    """
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    values: dict[str, Any] = {}
    for key, value in (extra or {}).items():
        field = fields.get(key)
        if field is None:
            raise ValueError(f"{connector}: unknown kv_connector_extra_config key {key!r}; "
                             f"known keys: {', '.join(sorted(fields))}")
        try:
            values[key] = _convert(field, value)
        except ValueError as exc:
            raise ValueError(f"{connector}: kv_connector_extra_config[{key!r}]: {exc}") from None
    try:
        return cls(**values)
    except ValueError as exc:
        raise ValueError(f"{connector}: {exc}") from None


def default_hostname() -> str:
    """The address peers reach this process at: vLLM's own ``VLLM_HOST_IP`` when set."""
    return os.environ.get("VLLM_HOST_IP") or "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class StoreSettings:
    """Where the store is and how this engine uses it (the store connector's keys)."""

    master_server_address: str = "127.0.0.1:50051"
    """``host:port`` of ``mooncake-master``, or ``etcd://host:port`` for an HA group."""
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    local_hostname: str = dataclasses.field(default_factory=default_hostname)
    global_segment_size: int = dataclasses.field(default=1 << 30, metadata=SIZE)
    """Memory each worker lends to the pool (0: none; the KV then lives in other
    clients' segments, e.g. a ``mooncake_client`` holder, and outlives this engine)."""
    key_prefix: str = ""
    """Keeps deployments that share one store apart, on top of model and layout."""
    replica_num: int = 1
    save_decode_cache: bool = False
    """Also save blocks filled by generated tokens (default: prompt blocks only)."""
    transfer_timeout_s: float = 30.0
    rpc_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if ":" not in self.master_server_address:
            raise ValueError(f"master_server_address {self.master_server_address!r} is not "
                             "host:port or etcd://host:port")
        if self.protocol not in ("tcp", "shm"):
            raise ValueError(f"protocol {self.protocol!r}: this build moves bytes over "
                             "'tcp' (shared memory between processes of one host is used "
                             "automatically) or 'shm'")
        if self.replica_num < 1:
            raise ValueError(f"replica_num must be >= 1, got {self.replica_num}")
        if self.transfer_timeout_s <= 0 or self.rpc_timeout_s <= 0:
            raise ValueError("timeouts must be positive")


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
        if self.protocol not in ("tcp", "shm"):
            raise ValueError(f"protocol {self.protocol!r}: this build moves bytes over "
                             "'tcp' (shared memory between processes of one host is used "
                             "automatically) or 'shm'")
        if not 0 <= self.side_channel_port < 65536:
            raise ValueError(f"side_channel_port {self.side_channel_port} is not a port")
        for name in ("connect_timeout_s", "transfer_timeout_s", "pull_wait_s",
                     "abort_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 1 <= self.pull_threads <= 64:
            raise ValueError(f"pull_threads must be in 1..64, got {self.pull_threads}")
