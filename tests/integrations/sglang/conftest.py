"""SGLang integration fixtures: a store, and SGLang's host KV pool on CPU tensors.

These tests need SGLang: ``.ci/run`` creates ``.venv-sglang`` (the lean CPU recipe:
CPU torch 2.13, sglang 0.5.23 without its GPU dependencies, its import-time
dependencies, this package in editable mode) and runs them there. Elsewhere they are
skipped with that reason.
"""

from __future__ import annotations

from framework_fixtures import require_framework

require_framework("sglang", "SGLang is not installed here: .ci/run runs these "
                                         "tests in .venv-sglang (sglang 0.5.23, CPU)")

from framework_fixtures import store  # noqa: E402,F401  (the fixture)
