"""mooncake_plugins: a Python + Cython re-creation of the Mooncake KVCache data plane.

Subpackages: ``transfer`` (Transfer Engine), ``conductor`` (scheduler and simulator),
``compat`` (the original's class names and integer return codes).
This module imports neither torch nor the native extensions.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
