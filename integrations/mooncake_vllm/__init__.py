"""vLLM KV connectors over mooncake_plugins.

``register`` is this distribution's ``vllm.general_plugins`` entry point: vLLM calls it in
its front-end, engine-core and worker processes, and it makes our connectors selectable by
name in ``--kv-transfer-config``. It only records module paths (vLLM imports a connector
when it is used) and tolerates being called more than once. Where NIXL is installed, it
also points NIXL at the plugin directory holding our NIXL backend (``MOONCAKE``) beside
NIXL's own, so vLLM's NixlConnector takes ``"backends": ["MOONCAKE"]`` with no other step.
"""

from __future__ import annotations

import importlib.util
import logging
import os

CONNECTORS = {
    "MooncakePluginsStoreConnector": ("mooncake_vllm.store_connector",
                                      "MooncakePluginsStoreConnector"),
    "MooncakePluginsPDConnector": ("mooncake_vllm.pd_connector", "MooncakePluginsPDConnector"),
}


def register() -> None:
    """Make our connectors known to vLLM's ``KVConnectorFactory`` (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, (module, cls) in CONNECTORS.items():
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, cls)
    _log_like_vllm()
    _point_nixl_at_our_backend()


def _point_nixl_at_our_backend() -> None:
    """Set ``NIXL_PLUGIN_DIR`` to our merged plugin directory (see
    ``mooncake_plugins.nixl.plugin_dir``) where NIXL is installed and the user set none.
    ``MC_NIXL_PLUGIN_DIR=0`` turns this off. Runs before any NIXL agent exists: NIXL reads
    the variable when its first agent starts."""
    from mooncake_plugins.config import nixl_plugin_dir_auto
    if "NIXL_PLUGIN_DIR" in os.environ or not nixl_plugin_dir_auto():
        return
    if importlib.util.find_spec("nixl_meta_utils") is None and \
            importlib.util.find_spec("nixl_cu12") is None and \
            importlib.util.find_spec("nixl_cu13") is None:
        return
    from mooncake_plugins.nixl.plugin_dir import NixlNotFound, plugin_dir
    try:
        os.environ["NIXL_PLUGIN_DIR"] = str(plugin_dir())
    except (NixlNotFound, OSError) as exc:
        logging.getLogger(__name__).warning(
            "NIXL is installed but our NIXL backend cannot be offered to it: %s", exc)


def _log_like_vllm() -> None:
    """Our connectors' log lines go where vLLM's go, at its level: vLLM configures only its
    own logger, so without this their INFO lines (KV layout, load mode, store reached)
    would be dropped. A logging configuration that names our logger is left alone."""
    ours, theirs = logging.getLogger(__name__), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level)
