"""``mooncake.dataproto_catalog``: the original's ``DataProtoCatalog``.

The catalog is :class:`mooncake_plugins.store.catalog.DataProtoCatalog`, pure metadata
with the original's methods, result shapes and ``ValueError`` messages. The original's
``DataProtoCatalogTransfer`` (which writes fragments through
``mooncake.structured_object_store``) is not provided.
"""

from __future__ import annotations

from mooncake_plugins.store.catalog import DataProtoCatalog

__all__ = ["DataProtoCatalog"]
