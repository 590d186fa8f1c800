"""Standalone-store mode: one host process owns the store client, local "dummy" clients use it.

(The original's "real client", ``mooncake_client``, and ``setup_dummy`` clients.)

The host (:class:`DummyHost`, run by ``mooncake_client``) holds a :class:`StoreClient`: the
transfer engine, the segment it contributes and the master connection. A dummy
(:class:`DummyClient`) holds none of that, only shared memory: its staging buffer and the
buffers it allocates (``alloc_from_mem_pool``) are memfds that it hands to the host, which
maps them and moves object bytes straight in and out of them: ``put_from``/``get_into``
copy nothing on the way; a value put, or bytes got, is copied once into or out of the
staging buffer.

Two channels per dummy:

* RPC (``rpc.py`` frames over TCP on the host's port): ``hello``, then the data calls.
  Calls that touch a dummy's memory name its session and address that memory with the
  dummy's own pointers; the host translates them through the session's mappings and
  refuses any range outside them.
* Control (a ``SOCK_SEQPACKET`` unix socket, abstract name from ``hello``): one
  connection per dummy for its lifetime. It carries the session token, and ``map`` /
  ``unmap`` messages, a memfd riding along with ``map`` (SCM_RIGHTS). The host accepts only
  memfds sealed against shrinking, so the dummy cannot pull pages from under a mapping.
  When the connection ends (the dummy closed or died), every mapping of the session is
  released once the calls using it finished. The abstract name has no file permissions:
  the host serves peers of its own uid (and root) only, by ``SO_PEERCRED``.

The RPC port listens on loopback unless ``mooncake_client --rpc_host`` says otherwise: it
is unauthenticated, and anyone reaching it can remove every object.

A malformed frame or control message closes that connection with a logged error.
"""

from .common import DEFAULT_PORT
from .dummy import DummyClient
from .host import DummyHost

__all__ = ["DEFAULT_PORT", "DummyClient", "DummyHost"]
