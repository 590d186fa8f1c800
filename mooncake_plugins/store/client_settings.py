"""Store-client settings as the framework integrations take them from a config dict.

Each integration (vLLM, LMCache, SGLang) reads these from its framework's own free-form
config (``kv_connector_extra_config``, LMCache's ``extra_config``, SGLang's
``--hicache-storage-backend-extra-config``). :func:`settings_from` fills a frozen
dataclass from such a dict, converting values by the field's type and naming the key in
every error, so a typo or a bad value fails when the framework starts, not at the first
request.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, TypeVar

from ..config import parse_size

T = TypeVar("T")

SIZE = {"size": True}
"""Field metadata: a byte count that also accepts strings like "4GB"."""


@dataclasses.dataclass(frozen=True)
class ClientSettings:
    """Where the store is and how a framework process uses it."""

    master_server_address: str = "127.0.0.1:50051"
    """``host:port`` of ``mooncake-master``, or ``etcd://host:port`` for an HA group."""
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = dataclasses.field(default=1 << 30, metadata=SIZE)
    """Memory this process lends to the pool (0: none; the data then lives in other
    clients' segments, e.g. a ``mooncake_client`` holder, and outlives this process)."""
    key_prefix: str = ""
    """Keeps deployments that share one store apart, on top of what the keys name."""
    replica_num: int = 1
    transfer_timeout_s: float = 30.0
    rpc_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if ":" not in self.master_server_address:
            raise ValueError(f"master_server_address {self.master_server_address!r} is not "
                             "host:port or etcd://host:port")
        if self.protocol not in ("tcp", "shm", "rdma"):
            raise ValueError(f"protocol {self.protocol!r}: bytes move over 'tcp' (shared "
                             "memory between processes of one host is used automatically), "
                             "'rdma' (where the hosts have RDMA devices; tcp otherwise) or "
                             "'shm'")
        if self.replica_num < 1:
            raise ValueError(f"replica_num must be >= 1, got {self.replica_num}")
        for name in ("transfer_timeout_s", "rpc_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def convert(field: dataclasses.Field, value: Any) -> Any:
    """``value`` as ``field``'s type (str, int, float, bool, or a size).

    Raises:
        ValueError: a value of another kind.
    """
    if field.metadata.get("size"):
        return parse_size(value)
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"expected true or false, got {value!r}")
    if isinstance(value, bool):
        raise ValueError(f"expected a {kind}, got {value!r}")
    if kind == "int":
        if not isinstance(value, (int, str)):
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)
    if kind == "float":
        if not isinstance(value, (int, float, str)):
            raise ValueError(f"expected a number, got {value!r}")
        return float(value)
    if kind == "str":
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported setting type {kind!r}")


def settings_from(cls: type[T], items: Iterable[tuple[str, Any]], where: str,
                  key_of: Callable[[str], str] = str) -> T:
    """``cls`` (a dataclass) from ``(field name, value)`` pairs of a config named ``where``.

    ``key_of`` gives the key a user writes for a field (for messages). Raises ValueError
    naming the key: an unknown one (the known ones listed), a value of the wrong kind,
    or what the dataclass refuses.
    """
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    values: dict[str, Any] = {}
    for name, value in items:
        field = fields.get(name)
        if field is None:
            raise ValueError(f"{where}: unknown key {key_of(name)!r}; known keys: "
                             + ", ".join(key_of(n) for n in sorted(fields)))
        try:
            values[name] = convert(field, value)
        except ValueError as exc:
            raise ValueError(f"{where}[{key_of(name)!r}]: {exc}") from None
    try:
        return cls(**values)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
