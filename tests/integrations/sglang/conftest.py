"""SGLang integration fixtures: a store, and SGLang's host KV pool on CPU tensors.

These tests need SGLang: ``.ci/run`` creates ``.venv-sglang`` (the lean CPU recipe:
CPU torch 2.13, sglang 0.5.23 without its GPU dependencies, its import-time
dependencies, this package in editable mode) and runs them there. Elsewhere they are
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
    import sglang  # noqa: F401  (CI's framework step: a broken install fails the run)
else:
    pytest.importorskip("sglang", reason="SGLang is not installed here: .ci/run runs these "
                                         "tests in .venv-sglang (sglang 0.5.23, CPU)")

# The shared module is loaded by path: putting tests/integrations on sys.path would make
# tests/integrations/vllm importable as "vllm".
_spec = importlib.util.spec_from_file_location(
    "store_procs", Path(__file__).resolve().parents[1] / "store_procs.py")
store_procs = sys.modules["store_procs"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(store_procs)
Store, running_store = store_procs.Store, store_procs.running_store


@pytest.fixture
def store() -> Iterator[Store]:
    with running_store() as s:
        yield s
