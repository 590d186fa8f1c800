"""Backend settings from SGLang's ``--hicache-storage-backend-extra-config``.

The keys SGLang's ``dynamic`` loader itself reads (``backend_name``, ``module_path``,
``class_name``, ``interface_v1``) stay in that dict and are skipped here; any other key
must be one of :class:`BackendSettings`' fields, and errors name the key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from mooncake_plugins.config import parse_size

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})


@dataclasses.dataclass(frozen=True)
class BackendSettings:
    """Where the store is and how this SGLang rank uses it."""

    master_server_address: str = "127.0.0.1:50051"
    """``host:port`` of ``mooncake-master``, or ``etcd://host:port`` for an HA group."""
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = dataclasses.field(default=1 << 30, metadata={"size": True})
    """Memory each TP rank lends to the pool (0: none; pages then live in other clients'
    segments, e.g. a ``mooncake_client`` holder, and outlive the server)."""
    key_prefix: str = ""
    """Keeps deployments sharing one store apart, on top of model, TP rank and layout."""
    replica_num: int = 1
    transfer_timeout_s: float = 30.0
    rpc_timeout_s: float = 5.0

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


def from_extra_config(extra: Mapping[str, Any] | None) -> BackendSettings:
    """Settings from the backend's extra config.

    Raises:
        ValueError: an unknown key (the known ones listed) or a bad value, naming the key.
    """
    fields = {f.name: f for f in dataclasses.fields(BackendSettings)}
    values: dict[str, Any] = {}
    for key, value in (extra or {}).items():
        if key in SGLANG_KEYS:
            continue
        field = fields.get(key)
        if field is None:
            raise ValueError(f"unknown hicache-storage-backend-extra-config key {key!r}; "
                             f"known keys: {', '.join(sorted(fields))}")
        try:
            values[key] = _convert(field, value)
        except ValueError as exc:
            raise ValueError(f"hicache-storage-backend-extra-config[{key!r}]: {exc}") from None
    try:
        return BackendSettings(**values)
    except ValueError as exc:
        raise ValueError(f"hicache-storage-backend-extra-config: {exc}") from None
