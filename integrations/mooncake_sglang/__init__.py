"""SGLang HiCache storage backend over mooncake_plugins' store.

Two ways to select it (SGLang's ``--hicache-storage-backend`` takes a closed list of
names, and its factory hard-codes how each built-in name is constructed, so a brand-new
name cannot be typed on SGLang's command line):

* ``--hicache-storage-backend dynamic --hicache-storage-backend-extra-config
  '{"backend_name": "mooncake_plugins", "module_path": "mooncake_sglang.backend",
  "class_name": "MooncakePluginsHiCache", "interface_v1": 1, ...settings}'``
* ``MOONCAKE_PLUGINS_HICACHE=1`` in SGLang's environment: :func:`register` (this
  distribution's ``sglang.srt.plugins`` entry point, run by SGLang in each of its
  processes) then registers our class under SGLang's ``mooncake`` name, so
  ``--hicache-storage-backend mooncake`` builds it (zero-copy path, as for the in-tree
  backend). Without the variable nothing is registered and ``mooncake`` stays SGLang's.
"""

from __future__ import annotations

import os

BACKEND_NAME = "mooncake_plugins"
MODULE_PATH = "mooncake_sglang.backend"
CLASS_NAME = "MooncakePluginsHiCache"
ENABLE_ENV = "MOONCAKE_PLUGINS_HICACHE"


def register() -> None:
    """Register our backend under SGLang's ``mooncake`` name when ``MOONCAKE_PLUGINS_HICACHE``
    is 1 (idempotent; otherwise a no-op)."""
    if os.environ.get(ENABLE_ENV, "").strip().lower() not in ("1", "true", "yes", "on"):
        return
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    entry = StorageBackendFactory._registry.get("mooncake", {})
    if entry.get("module_path") != MODULE_PATH:
        StorageBackendFactory.register_backend("mooncake", MODULE_PATH, CLASS_NAME)


def dynamic_extra_config(**settings: object) -> dict[str, object]:
    """``--hicache-storage-backend-extra-config`` for ``dynamic``, plus our ``settings``."""
    return {"backend_name": BACKEND_NAME, "module_path": MODULE_PATH,
            "class_name": CLASS_NAME, "interface_v1": 1, **settings}
