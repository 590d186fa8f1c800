"""LMCache integration fixtures: a store, and LMCache's own storage backends (local CPU
plus one remote backend) built by ``CreateStorageBackends`` on CPU, with LMCache's event
loop in a background thread as in a worker.

These tests need LMCache: ``.ci/run`` creates ``.venv-lmcache`` (CPU torch 2.13,
lmcache 0.5.6, this package in editable mode) and runs them there. Elsewhere they are
skipped with that reason.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

if os.environ.get("MOONCAKE_REQUIRE_FRAMEWORKS") == "1":
    import lmcache  # noqa: F401  (CI's framework step: a broken install fails the run)
else:
    pytest.importorskip("lmcache", reason="LMCache is not installed here: .ci/run runs "
                                          "these tests in .venv-lmcache (lmcache 0.5.6)")

# The shared module is loaded by path: putting tests/integrations on sys.path would make
# tests/integrations/vllm importable as "vllm".
_spec = importlib.util.spec_from_file_location(
    "store_procs", Path(__file__).resolve().parents[1] / "store_procs.py")
store_procs = sys.modules["store_procs"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(store_procs)
Store, running_store = store_procs.Store, store_procs.running_store


@pytest.fixture
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """Master flags may come from ``@pytest.mark.master_flags(...)``."""
    marker = request.node.get_closest_marker("master_flags")
    with running_store(list(marker.args) if marker else []) as s:
        yield s
