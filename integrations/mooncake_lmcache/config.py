"""Connector settings from LMCache's ``extra_config``.

Our keys are ``mooncake_plugins.<field>`` so they never collide with LMCache's own keys
or with its in-tree ``mooncakestore`` connector's. Values are converted by the field's
type; every error names the key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from mooncake_plugins.config import parse_size

PREFIX = "mooncake_plugins."


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """Where the store is and how this LMCache worker uses it."""

    master_server_address: str = "127.0.0.1:50051"
    """``host:port`` of ``mooncake-master``, or ``etcd://host:port`` for an HA group."""
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = dataclasses.field(default=1 << 30, metadata={"size": True})
    """Memory this worker lends to the pool (0: none; chunks then live in other clients'
    segments, e.g. a ``mooncake_client`` holder, and outlive this worker)."""
    key_prefix: str = ""
    """Keeps deployments that share one store apart (LMCache's key already names model,
    world size, worker, chunk hash and dtype)."""
    replica_num: int = 1
    transfer_timeout_s: float = 5.0
    """Longest one batched put or get may take before LMCache gets a miss (or a failed
    put); the transfer itself is bounded by the store client with the same value."""
    rpc_timeout_s: float = 5.0
    io_threads: int = 4
    """Threads running the blocking store calls off LMCache's event loop."""

    def __post_init__(self) -> None:
        if ":" not in self.master_server_address:
            raise ValueError(f"master_server_address {self.master_server_address!r} is not "
                             "host:port or etcd://host:port")
        if self.protocol not in ("tcp", "shm"):
            raise ValueError(f"protocol {self.protocol!r}: this build moves bytes over 'tcp' "
                             "(shared memory between processes of one host is used "
                             "automatically) or 'shm'")
        if self.replica_num < 1:
            raise ValueError(f"replica_num must be >= 1, got {self.replica_num}")
        for name in ("transfer_timeout_s", "rpc_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 1 <= self.io_threads <= 64:
            raise ValueError(f"io_threads must be in 1..64, got {self.io_threads}")


def _convert(field: dataclasses.Field, value: Any) -> Any:
    if field.metadata.get("size"):
        return parse_size(value)
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    if isinstance(value, bool) and kind != "str":
        raise ValueError(f"expected a {kind}, got {value!r}")
    if kind == "int":
        if not isinstance(value, (int, str)):
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)
    if kind == "float":
        if not isinstance(value, (int, float, str)):
            raise ValueError(f"expected a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def from_extra_config(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    """The ``mooncake_plugins.*`` keys of LMCache's ``extra_config`` as settings.

    Raises:
        ValueError: an unknown ``mooncake_plugins.*`` key (the known ones listed) or a
            bad value, naming the key.
    """
    fields = {f.name: f for f in dataclasses.fields(ConnectorSettings)}
    values: dict[str, Any] = {}
    for key, value in (extra or {}).items():
        if not key.startswith(PREFIX):
            continue
        name = key[len(PREFIX):]
        field = fields.get(name)
        if field is None:
            raise ValueError(f"unknown LMCache extra_config key {key!r}; known keys: "
                             + ", ".join(PREFIX + n for n in sorted(fields)))
        try:
            values[name] = _convert(field, value)
        except ValueError as exc:
            raise ValueError(f"LMCache extra_config[{key!r}]: {exc}") from None
    try:
        return ConnectorSettings(**values)
    except ValueError as exc:
        raise ValueError(f"LMCache extra_config: {exc}") from None
