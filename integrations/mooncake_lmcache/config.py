"""Connector settings from LMCache's ``extra_config``.

Our keys are ``mooncake_plugins.<field>`` so they never collide with LMCache's own keys
or with its in-tree ``mooncakestore`` connector's. Values are converted by the field's
type; every error names the key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from mooncake_plugins.store.client_settings import ClientSettings, settings_from

PREFIX = "mooncake_plugins."


@dataclasses.dataclass(frozen=True)
class ConnectorSettings(ClientSettings):
    """Where the store is and how this LMCache worker uses it."""

    transfer_timeout_s: float = 5.0
    """Longest one batched put or get may take before LMCache gets a miss (or a failed
    put); the transfer itself is bounded by the store client with the same value."""
    io_threads: int = 4
    """Threads running the blocking store calls off LMCache's event loop."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.io_threads <= 64:
            raise ValueError(f"io_threads must be in 1..64, got {self.io_threads}")


def from_extra_config(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    """The ``mooncake_plugins.*`` keys of LMCache's ``extra_config`` as settings.

    Raises:
        ValueError: an unknown ``mooncake_plugins.*`` key (the known ones listed) or a
            bad value, naming the key.
    """
    ours = ((k[len(PREFIX):], v) for k, v in (extra or {}).items() if k.startswith(PREFIX))
    return settings_from(ConnectorSettings, ours, "LMCache extra_config",
                         key_of=lambda name: PREFIX + name)
