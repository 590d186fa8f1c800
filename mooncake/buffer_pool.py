"""``mooncake.buffer_pool``: the original's ``BufferPool``, from
:mod:`mooncake_plugins.compat.buffer_pool`."""

from mooncake_plugins.compat.buffer_pool import (BufferLease, BufferPool, RegisteredBufferLease,
                                                 RegisteredBufferPool)

__all__ = ["BufferLease", "BufferPool", "RegisteredBufferLease", "RegisteredBufferPool"]
