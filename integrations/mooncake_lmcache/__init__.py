"""LMCache remote connector over mooncake_plugins' store.

LMCache loads it through its remote storage plugin framework; in LMCache's config::

    remote_storage_plugins: ["mooncake_plugins"]
    extra_config:
      remote_storage_plugin.mooncake_plugins.module_path: mooncake_lmcache.connector
      remote_storage_plugin.mooncake_plugins.class_name: MooncakePluginsConnector
      mooncake_plugins.master_server_address: "10.0.0.1:50051"

Our settings are the ``mooncake_plugins.*`` keys of ``extra_config``
(:class:`mooncake_lmcache.config.ConnectorSettings`).

LMCache 0.5.6 builds no ``remote_storage_plugins`` backend in its scheduler role
(``enable_scheduler_bypass_lookup``: it asserts a CPU pool first). A deployment using that
role selects the connector with ``remote_url: EXTERNAL_REMOTE_URL`` instead (same
``extra_config``), which LMCache builds in both roles.
"""

from __future__ import annotations

PLUGIN_NAME = "mooncake_plugins"
MODULE_PATH = "mooncake_lmcache.connector"
CLASS_NAME = "MooncakePluginsConnector"
EXTERNAL_REMOTE_URL = f"external://127.0.0.1:0/{MODULE_PATH}/?connector_name={CLASS_NAME}"
"""LMCache ``remote_url`` loading the connector through its external-connector adapter
(host and port are placeholders LMCache's URL parser requires; the store's address is
``mooncake_plugins.master_server_address``)."""


def extra_config(**settings: object) -> dict[str, object]:
    """LMCache ``extra_config`` entries selecting our connector, plus our ``settings``
    (``master_server_address=...`` becomes ``mooncake_plugins.master_server_address``)."""
    out: dict[str, object] = {
        f"remote_storage_plugin.{PLUGIN_NAME}.module_path": MODULE_PATH,
        f"remote_storage_plugin.{PLUGIN_NAME}.class_name": CLASS_NAME,
    }
    out.update({f"{PLUGIN_NAME}.{k}": v for k, v in settings.items()})
    return out
