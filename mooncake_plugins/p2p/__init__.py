"""P2P Store: decentralised sharing of temporary objects such as checkpoints.

:class:`P2PStore` (``store.py``) registers named objects made of memory parts, lists them,
and fetches replicas from whichever nodes hold them; a node that fetched an object serves it
to later getters, so the original provider's NIC is not the bottleneck. Object records
live in the metadata service (etcd, Redis or the embedded HTTP server); bytes move over the
transfer engine.
"""

from .store import HolderInfo, ObjectInfo, P2PStore, ReadReport

__all__ = ["HolderInfo", "ObjectInfo", "P2PStore", "ReadReport"]
