"""The Transfer Engine's metadata service: where segment descriptors (opaque bytes) live.

``from_url`` opens a :class:`MetadataStore` from a connection string like the original
Mooncake's: ``http://host:port/metadata`` (the embedded :class:`MetadataServer`),
``etcd://host:port`` or a bare ``host:port`` (etcd v3), ``redis://host:port[/db]``, or
``P2PHANDSHAKE`` (returns None: peers exchange descriptors directly). Backends live in
``http.py``, ``etcd.py`` and ``redis.py``; the etcd and Redis client libraries are
imported only when their scheme is used.
"""

from mooncake_plugins.transfer.metadata.base import MetadataStore, from_url
from mooncake_plugins.transfer.metadata.http import MetadataServer

__all__ = ["MetadataServer", "MetadataStore", "from_url"]
