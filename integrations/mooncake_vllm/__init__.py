"""vLLM KV connectors over mooncake_plugins.

``register`` is this distribution's ``vllm.general_plugins`` entry point: vLLM calls it in
its front-end, engine-core and worker processes, and it makes our connectors selectable by
name in ``--kv-transfer-config``. It only records module paths (vLLM imports a connector
when it is used) and tolerates being called more than once.
"""

from __future__ import annotations

import logging

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


def _log_like_vllm() -> None:
    """Our connectors' log lines go where vLLM's go, at its level: vLLM configures only its
    own logger, so without this their INFO lines (KV layout, load mode, store reached)
    would be dropped. A logging configuration that names our logger is left alone."""
    ours, theirs = logging.getLogger(__name__), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level)
