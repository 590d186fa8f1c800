"""Imports point one way: ``mooncake/`` wraps ``mooncake_plugins/compat/``, and both wrap the
core, never the other way round. Every import in the core (``mooncake_plugins/`` less
``compat/``) and in ``compat/`` (``structured/`` included), including those inside functions
and ``importlib.import_module("...")`` calls, is checked."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mooncake_plugins"
WRAPPERS = ("mooncake", "mooncake_plugins.compat")
DROP_IN = ("mooncake",)
ALLOWED = {
    # `mooncake-plugins doctor` reports which package a plain `import mooncake` gives (the
    # original's or our drop-in), so it imports it by that name on purpose
    ("cli/doctor.py", "mooncake"),
}


def _package_of(relpath: str) -> list[str]:
    parts = ["mooncake_plugins", *relpath.split("/")]
    return parts[:-1]


def _resolve(module: str | None, level: int, package: list[str]) -> str:
    if not level:
        return module or ""
    base = package[:len(package) - level + 1]
    return ".".join(base + ([module] if module else []))


def imports(source: str, relpath: str) -> Iterator[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in ``source`` (a file at
    ``relpath`` under mooncake_plugins/); ``from a import b`` gives ``a`` and ``a.b``."""
    package = _package_of(relpath)
    for node in ast.walk(ast.parse(source, relpath)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module, node.level, package)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
                   or isinstance(node.func, ast.Name) and node.func.id in ("import_module",
                                                                           "__import__"))):
            name = node.args[0].value
            level = len(name) - len(name.lstrip("."))
            yield node.lineno, _resolve(name[level:] or None, level, package)


def _wraps(name: str, wrappers: tuple[str, ...]) -> bool:
    return any(name == w or name.startswith(w + ".") for w in wrappers)


def violations(source: str, relpath: str,
               wrappers: tuple[str, ...] = WRAPPERS) -> list[str]:
    """``"<relpath>:<line>: <module>"`` for each line that imports one of ``wrappers``."""
    flagged: dict[int, str] = {}
    for line, name in imports(source, relpath):
        if _wraps(name, wrappers) and (relpath, name) not in ALLOWED:
            flagged.setdefault(line, name)
    return [f"{relpath}:{line}: {name}" for line, name in sorted(flagged.items())]


def test_core_does_not_import_its_wrappers() -> None:
    found, checked = [], 0
    for path in sorted(PACKAGE.rglob("*.py")):
        relpath = path.relative_to(PACKAGE).as_posix()
        if relpath.startswith("compat/"):
            continue
        found += violations(path.read_text(), relpath)
        checked += 1
    assert checked > 50, f"only {checked} core modules found under {PACKAGE}"
    assert not found, ("the core imports mooncake/ or compat/ (move the shared piece into the "
                       "core and re-export it there):\n" + "\n".join(found))


def test_compat_does_not_import_the_drop_in() -> None:
    found, checked = [], 0
    for path in sorted((PACKAGE / "compat").rglob("*.py")):
        relpath = path.relative_to(PACKAGE).as_posix()
        found += violations(path.read_text(), relpath, DROP_IN)
        checked += 1
    assert checked > 15, f"only {checked} compat modules found under {PACKAGE / 'compat'}"
    assert not found, ("compat/ imports mooncake/ (the drop-in wraps compat/, not the other "
                       "way round):\n" + "\n".join(found))


@pytest.mark.parametrize("source", [
    "import mooncake",
    "import mooncake.store as s",
    "from mooncake._fast_copy import concat_arrays_into",
    "from mooncake_plugins.compat.store import ReplicateConfig",
    "from ... import compat",
    "from ...compat import store",
    "def f():\n    from ...compat.store import ReplicateConfig\n",
    "import importlib\nimportlib.import_module('mooncake.buffer_pool')",
    "from importlib import import_module\nimport_module('...compat.store', __package__)",
])
def test_checker_sees(source: str) -> None:
    assert violations(source, "store/local/x.py")


@pytest.mark.parametrize("source", [
    "from ..client import ReplicateConfig",
    "from mooncake_plugins.store import compat_notes",
    "import mooncake_plugins.config",
    "from .. import compat",  # mooncake_plugins.store.compat, not the wrapper
])
def test_checker_passes(source: str) -> None:
    assert not violations(source, "store/local/x.py")


@pytest.mark.parametrize("source, flagged", [
    ("import mooncake.store", True),
    ("from mooncake.structured_object_store import MooncakeBundleTransfer", True),
    ("from ...store.replicate_config import ReplicateConfig", False),
    ("from .. import store", False),  # mooncake_plugins.compat.store
    ("import mooncake_plugins.compat.store", False),
])
def test_compat_checker(source: str, flagged: bool) -> None:
    assert bool(violations(source, "compat/structured/x.py", DROP_IN)) is flagged
