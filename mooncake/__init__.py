"""The original Mooncake's Python package (``mooncake``), served by mooncake_plugins.

A drop-in, the way Pillow stands in for PIL: ``mooncake.engine``, ``mooncake.store`` and
the other public modules of ``mooncake-transfer-engine`` 0.3.13.post1 keep their names,
argument order, defaults, return codes and exception types, and run on our engine and
store. ``mooncake-plugins doctor`` says which implementation ``import mooncake`` resolves
to when the original wheel is installed as well.
"""

from __future__ import annotations

from typing import Any

IMPLEMENTATION = "mooncake_plugins"
API_VERSION = "0.3.13.post1"  # the original release whose Python surface this follows

__all__ = ["BufferPool", "RegisteredBufferPool", "IMPLEMENTATION", "API_VERSION"]


def __getattr__(name: str) -> Any:
    # imported on first use, as the original's eager import would pull in the store
    if name in ("BufferPool", "RegisteredBufferPool"):
        from mooncake import buffer_pool
        return getattr(buffer_pool, name)
    raise AttributeError(f"module 'mooncake' has no attribute {name!r}")
