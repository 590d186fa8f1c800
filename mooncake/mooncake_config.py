"""``mooncake.mooncake_config``: the original's ``MooncakeConfig``, loaded from JSON or env.

A config names the local host, the metadata server, the master and the sizes and protocol
handed to ``MooncakeDistributedStore.setup``. ``MooncakeConfig.from_file(path)`` reads a
JSON object; ``MooncakeConfig.load_from_env()`` reads the file named by
``MOONCAKE_CONFIG_PATH`` or, without it, the ``MOONCAKE_*`` variables (``MOONCAKE_MASTER``
is then required). Sizes may be ints or strings such as ``"4gb"``, ``"512 MB"``, ``"1e9"``;
booleans may be strings such as ``"true"``, ``"off"``, ``"enable"``. The protocol is
lower-cased; one not in :data:`KNOWN_PROTOCOLS` is logged and passed through (the store
decides what it supports).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200  # 3.125 GiB
DEFAULT_LOCAL_BUFFER_SIZE = 1073741824  # 1 GiB
DEFAULT_CLIENT_HTTP_PORT = 9300

KNOWN_PROTOCOLS = frozenset({
    # transfer engine transports
    "tcp", "rdma", "efa", "nvmeof", "nvlink", "nvlink_intra", "musa", "hip", "barex", "cxl",
    "ascend", "ub", "ubshmem", "maca", "sunrise_link",
    # store without a transfer engine
    "rpc_only",
})

REQUIRED_FIELDS = ("local_hostname", "metadata_server", "master_server_address")

# Longest suffixes first, so "kb" is not read as "b".
_UNITS = (("kb", 1 << 10), ("mb", 1 << 20), ("gb", 1 << 30), ("tb", 1 << 40),
          ("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40), ("b", 1))
_TRUE = frozenset({"true", "1", "yes", "on", "enable"})
_FALSE = frozenset({"false", "0", "no", "off", "disable"})


def _parse_segment_size(value: Any) -> int:
    """Bytes from an int, a float (truncated) or a string with an optional unit suffix.

    Raises:
        ValueError: an empty string, a unit without a number, or text that is no number.
    """
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        return int(value)
    text = value.strip().lower()
    if not text:
        raise ValueError("Invalid segment size: empty string")
    for suffix, scale in _UNITS:
        if text.endswith(suffix):
            number = text[:-len(suffix)].strip()
            if not number:
                raise ValueError(f"Invalid segment size: missing number before '{suffix}'")
            return int(float(number) * scale)
    return int(float(text))


def _parse_bool(value: Any) -> bool:
    """A bool from a bool, a number, None (False) or a word such as "yes"/"off".

    Raises:
        ValueError: a string that is none of the known words.
    """
    if isinstance(value, (bool, int, float)):
        return bool(value)
    if value is None:
        return False
    text = str(value).strip().lower()
    if not text or text in _FALSE:
        return False
    if text in _TRUE:
        return True
    raise ValueError(f"Invalid boolean value: {value!r}")


@dataclass
class MooncakeConfig:
    """What ``MooncakeDistributedStore.setup`` needs, checked on construction.

    Raises (from the constructor):
        ValueError: an empty or non-str protocol, a negative size, or an empty
            local_hostname, metadata_server or master_server_address.
    """

    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: Optional[str]
    master_server_address: str
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"
    enable_client_http_server: bool = False
    client_http_port: int = DEFAULT_CLIENT_HTTP_PORT

    def __post_init__(self) -> None:
        if not isinstance(self.protocol, str) or not self.protocol.strip():
            raise ValueError(f"Invalid protocol: {self.protocol!r}. Protocol must be a "
                             "non-empty string, e.g. 'tcp' or 'rdma'.")
        self.protocol = self.protocol.strip().lower()
        if self.protocol not in KNOWN_PROTOCOLS:
            logger.warning("Unrecognised protocol %r, passed on unchanged (known: %s)",
                           self.protocol, ", ".join(sorted(KNOWN_PROTOCOLS)))
        for name in ("global_segment_size", "local_buffer_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"Invalid {name}: {getattr(self, name)}. "
                                 "Size must be non-negative.")
        for name in REQUIRED_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"Config field {name!r} must be a non-empty string, "
                                 f"got {value!r}.")

    @staticmethod
    def from_file(file_path: str) -> MooncakeConfig:
        """Load a config from a JSON file; absent optional fields take their defaults.

        Raises:
            ValueError: a required field is missing, or a value is malformed.
            OSError, json.JSONDecodeError: the file cannot be read or parsed.
        """
        with open(file_path) as f:
            raw = json.load(f)
        for name in REQUIRED_FIELDS:
            if name not in raw:
                raise ValueError(f"Missing required config field: {name}")
        offload_path = raw.get("ssd_offload_path")
        tenant = raw.get("tenant_id")
        return MooncakeConfig(
            local_hostname=raw["local_hostname"],
            metadata_server=raw["metadata_server"],
            global_segment_size=_parse_segment_size(
                raw.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=_parse_segment_size(
                raw.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=raw.get("protocol", "tcp"),
            device_name=raw.get("device_name", ""),
            master_server_address=raw["master_server_address"],
            enable_ssd_offload=_parse_bool(raw.get("enable_ssd_offload", False)),
            ssd_offload_path="" if offload_path is None else str(offload_path),
            tenant_id="default" if tenant is None else str(tenant),
            enable_client_http_server=_parse_bool(raw.get("enable_client_http_server", False)),
            client_http_port=int(raw.get("client_http_port", DEFAULT_CLIENT_HTTP_PORT)),
        )

    @staticmethod
    def load_from_env() -> MooncakeConfig:
        """Load the file named by ``MOONCAKE_CONFIG_PATH``, else read ``MOONCAKE_*`` variables.

        Variables: MOONCAKE_MASTER (required), MOONCAKE_LOCAL_HOSTNAME (localhost),
        MOONCAKE_TE_META_DATA_SERVER (P2PHANDSHAKE), MOONCAKE_GLOBAL_SEGMENT_SIZE,
        MOONCAKE_LOCAL_BUFFER_SIZE, MOONCAKE_PROTOCOL (tcp), MOONCAKE_DEVICE,
        MOONCAKE_OFFLOAD_ENABLED, MOONCAKE_OFFLOAD_FILE_STORAGE_PATH, MOONCAKE_TENANT_ID,
        MOONCAKE_ENABLE_CLIENT_HTTP_SERVER, MOONCAKE_CLIENT_HTTP_PORT.

        Raises:
            ValueError: neither MOONCAKE_CONFIG_PATH nor MOONCAKE_MASTER is set, or a
                value is malformed.
        """
        path = os.getenv("MOONCAKE_CONFIG_PATH")
        if path is not None:
            return MooncakeConfig.from_file(path)
        master = os.getenv("MOONCAKE_MASTER")
        if not master:
            raise ValueError("Neither the environment variable 'MOONCAKE_CONFIG_PATH' nor "
                             "'MOONCAKE_MASTER' is set.")
        env = os.environ.get
        return MooncakeConfig(
            local_hostname=env("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
            metadata_server=env("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
            global_segment_size=_parse_segment_size(
                env("MOONCAKE_GLOBAL_SEGMENT_SIZE", DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=_parse_segment_size(
                env("MOONCAKE_LOCAL_BUFFER_SIZE", DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=env("MOONCAKE_PROTOCOL", "tcp"),
            device_name=env("MOONCAKE_DEVICE", ""),
            master_server_address=master,
            enable_ssd_offload=_parse_bool(env("MOONCAKE_OFFLOAD_ENABLED", "false")),
            ssd_offload_path=env("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", ""),
            tenant_id=env("MOONCAKE_TENANT_ID", "default"),
            enable_client_http_server=_parse_bool(
                env("MOONCAKE_ENABLE_CLIENT_HTTP_SERVER", "false")),
            client_http_port=int(env("MOONCAKE_CLIENT_HTTP_PORT", DEFAULT_CLIENT_HTTP_PORT)),
        )
