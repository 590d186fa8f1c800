"""LMCache integration fixtures: a store, and LMCache's own storage backends (local CPU
plus one remote backend) built by ``CreateStorageBackends`` on CPU, with LMCache's event
loop in a background thread as in a worker.

These tests need LMCache: ``.ci/run`` creates ``.venv-lmcache`` (CPU torch 2.13,
lmcache 0.5.6, this package in editable mode) and runs them there. Elsewhere they are
skipped with that reason.
"""

from __future__ import annotations

from framework_fixtures import require_framework

require_framework("lmcache", "LMCache is not installed here: .ci/run runs "
                                          "these tests in .venv-lmcache (lmcache 0.5.6)")

from framework_fixtures import store  # noqa: E402,F401  (the fixture)
