"""GPU tests (marker ``cuda``): they run where CUDA works and skip, with the reason,
everywhere else, under ``MOONCAKE_CI=1`` too (CI has no GPU). ``tests/gpu/run.sh`` runs them
on a GPU machine, with the copy ceilings of ``ceilings.py``.
"""

from __future__ import annotations

import pytest

from mooncake_plugins.transfer import cuda


@pytest.fixture(autouse=True)
def _needs_cuda(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("cuda") is not None and not cuda.available():
        pytest.skip(f"needs a CUDA GPU: {cuda.why_unavailable()}")
