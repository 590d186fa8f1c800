"""``tests/upstream/run.py`` finds the original's tests beside the clone, and says so when
it cannot (``.ci/run`` then fails). The run of the files themselves is ``.ci/run``'s step."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

from helpers import skip_or_fail

RUN = Path(__file__).resolve().parent / "run.py"
SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "upstream" / "mooncake"


def _load():
    """run.py as a module (a script, not in a package; its dataclasses need it registered)."""
    if "upstream_run" not in sys.modules:
        spec = importlib.util.spec_from_file_location("upstream_run", RUN)
        module = importlib.util.module_from_spec(spec)
        sys.modules["upstream_run"] = module
        spec.loader.exec_module(module)
    return sys.modules["upstream_run"]


def test_default_source_is_shared_beside_the_clone(monkeypatch):
    run = _load()
    monkeypatch.delenv("MOONCAKE_UPSTREAM_SRC", raising=False)
    assert run.find_source(None) == SHARED
    monkeypatch.setenv("MOONCAKE_UPSTREAM_SRC", "/elsewhere")
    assert run.find_source(None) == Path("/elsewhere")
    assert run.find_source("/given") == Path("/given")
    if not SHARED.is_dir():
        skip_or_fail(f"{SHARED} is absent (CI has shared/ beside the clone)")
    assert run.missing(SHARED) == []


def test_staged_copy_is_writable_and_complete(tmp_path):
    run = _load()
    src = tmp_path / "src"
    for folder in run.SOURCE_DIRS:
        (src / folder).mkdir(parents=True)
        (src / folder / "t.py").write_text("x = 1\n")
        (src / folder / "t.py").chmod(0o444)
        (src / folder).chmod(0o555)
    staged = run.stage(src)
    try:
        for folder in run.SOURCE_DIRS:
            assert (staged / folder / "t.py").read_text() == "x = 1\n"
            # the modes, not a write (root writes anyway)
            assert (staged / folder).stat().st_mode & 0o700 == 0o700
            assert (staged / folder / "t.py").stat().st_mode & 0o600 == 0o600
    finally:
        for folder in run.SOURCE_DIRS:
            (src / folder).chmod(0o755)
        shutil.rmtree(staged)


def test_no_source_exits_3_with_the_reason(tmp_path):
    res = subprocess.run([sys.executable, str(RUN), "--src", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 3
    assert "NOT RUN" in res.stderr and "shared/upstream/mooncake" in res.stderr
