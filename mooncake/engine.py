"""``mooncake.engine``: the original's Transfer Engine API on our engine."""

from mooncake_plugins.compat.engine import TransferEngine, TransferNotify, TransferOpcode

__all__ = ["TransferEngine", "TransferNotify", "TransferOpcode"]
