"""LMCache remote connector over mooncake_plugins' store.

LMCache loads it through its remote storage plugin framework; in LMCache's config::

    remote_storage_plugins: ["mooncake_plugins"]
    extra_config:
      remote_storage_plugin.mooncake_plugins.module_path: mooncake_lmcache.connector
      remote_storage_plugin.mooncake_plugins.class_name: MooncakePluginsConnector
      mooncake_plugins.master_server_address: "10.0.0.1:50051"

Our settings are the ``mooncake_plugins.*`` keys of ``extra_config``
(:class:`mooncake_lmcache.config.ConnectorSettings`).
"""

from __future__ import annotations

PLUGIN_NAME = "mooncake_plugins"
MODULE_PATH = "mooncake_lmcache.connector"
CLASS_NAME = "MooncakePluginsConnector"


def extra_config(**settings: object) -> dict[str, object]:
    """LMCache ``extra_config`` entries selecting our connector, plus our ``settings``
    (``master_server_address=...`` becomes ``mooncake_plugins.master_server_address``)."""
    out: dict[str, object] = {
        f"remote_storage_plugin.{PLUGIN_NAME}.module_path": MODULE_PATH,
        f"remote_storage_plugin.{PLUGIN_NAME}.class_name": CLASS_NAME,
    }
    out.update({f"{PLUGIN_NAME}.{k}": v for k, v in settings.items()})
    return out
