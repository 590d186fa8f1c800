"""``mooncake._fast_copy``: the original wheel's gather copy (and which implementation it
is), from :mod:`mooncake_plugins.transfer.fast_copy`."""

from mooncake_plugins.transfer.fast_copy import IMPLEMENTATION, concat_arrays_into

__all__ = ["concat_arrays_into"]
