"""``mooncake.dataproto_catalog``: the original's ``DataProtoCatalog`` and
``DataProtoCatalogTransfer``.

The catalog is :class:`mooncake_plugins.store.catalog.DataProtoCatalog`, pure metadata
with the original's methods, result shapes and ``ValueError`` messages.
``DataProtoCatalogTransfer`` (:mod:`mooncake_plugins.compat.structured.catalog_transfer`)
writes fragments through a ``mooncake.structured_object_store.MooncakeBundleTransfer`` and
publishes them in a catalog reached through a ``catalog_call(method, *args, **kwargs)``.
"""

from __future__ import annotations

from mooncake_plugins.store.catalog import DataProtoCatalog
from mooncake_plugins.compat.structured.catalog_transfer import DataProtoCatalogTransfer

__all__ = ["DataProtoCatalog", "DataProtoCatalogTransfer"]
