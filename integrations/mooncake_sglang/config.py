"""Backend settings from SGLang's ``--hicache-storage-backend-extra-config``.

The keys SGLang's ``dynamic`` loader itself reads (``backend_name``, ``module_path``,
``class_name``, ``interface_v1``) stay in that dict and are skipped here; any other key
must be one of :class:`BackendSettings`' fields, and errors name the key.
"""

from __future__ import annotations

from typing import Any, Mapping

from mooncake_plugins.store.client_settings import ClientSettings, settings_from

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})


class BackendSettings(ClientSettings):
    """Where the store is and how this SGLang rank uses it (the key prefix keeps
    deployments sharing one store apart, on top of model, TP rank and layout)."""


def from_extra_config(extra: Mapping[str, Any] | None) -> BackendSettings:
    """Settings from the backend's extra config.

    Raises:
        ValueError: an unknown key (the known ones listed) or a bad value, naming the key.
    """
    ours = ((k, v) for k, v in (extra or {}).items() if k not in SGLANG_KEYS)
    return settings_from(BackendSettings, ours, "hicache-storage-backend-extra-config")
