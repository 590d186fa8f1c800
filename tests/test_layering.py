"""Imports point one way: ``mooncake/`` wraps ``mooncake_plugins/compat/``, and both wrap the
core, never the other way round. Every import in the core (``mooncake_plugins/`` less
``compat/``) and in ``compat/`` (``structured/`` included), including those inside functions
and ``importlib.import_module("...")`` calls, is checked. Nor do modules of
``mooncake_plugins/`` import each other round a circle."""

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


def _dynamic_import(node: ast.AST) -> str | None:
    """The module an ``import_module("...")`` or ``__import__("...")`` call names, if any."""
    if (isinstance(node, ast.Call) and node.args
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
            and (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
                 or isinstance(node.func, ast.Name) and node.func.id in ("import_module",
                                                                         "__import__"))):
        return node.args[0].value
    return None


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
        elif (name := _dynamic_import(node)) is not None:
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


# -- no import circles -----------------------------------------------------------------------
def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _nodes(tree: ast.AST, type_checking: bool) -> Iterator[ast.AST]:
    """Every node of ``tree``; without ``type_checking``, less the bodies of
    ``if TYPE_CHECKING:`` (their ``else:`` runs, so it stays)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _module_of(relpath: str) -> str:
    parts = ["mooncake_plugins", *relpath[:-len(".py")].split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(source: str, relpath: str, modules: dict[str, str], *,
                   type_checking: bool = True) -> Iterator[tuple[int, str]]:
    """``(line, relpath)`` of each module of ``modules`` (module name -> relpath) that
    ``source`` (the file at ``relpath`` under mooncake_plugins/) imports: ``from a import b``
    imports ``a.b`` where that is a module, else ``a``."""
    package = _package_of(relpath)
    for node in _nodes(ast.parse(source, relpath), type_checking):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module, node.level, package)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                     for alias in node.names]
        elif (name := _dynamic_import(node)) is not None:
            level = len(name) - len(name.lstrip("."))
            names = [_resolve(name[level:] or None, level, package)]
        for name in names:
            if name in modules:
                yield node.lineno, modules[name]


def import_graph(sources: dict[str, str], *,
                 type_checking: bool = True) -> dict[str, dict[str, int]]:
    """``{relpath: {imported relpath: first line}}`` of the modules in ``sources``
    (relpath -> source)."""
    modules = {_module_of(relpath): relpath for relpath in sources}
    graph: dict[str, dict[str, int]] = {}
    for relpath, source in sources.items():
        edges = graph[relpath] = {}
        for line, target in module_imports(source, relpath, modules,
                                           type_checking=type_checking):
            edges[target] = min(line, edges.get(target, line))
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """The strongly connected groups of more than one module (or one importing itself),
    by Tarjan's algorithm, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1 or node in graph[node]:
                        found.append(frozenset(group))
    return found


def _shortest_way_round(graph: dict[str, dict[str, int]], group: frozenset[str],
                        start: str) -> list[str]:
    """The modules of a shortest circle from ``start`` back to it inside ``group``."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier and start not in came_from:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target in group and target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    path = [start]
    while len(path) == 1 or path[-1] != start:
        path.append(came_from[path[-1]])
    return path[::-1]


def describe(graph: dict[str, dict[str, int]], group: frozenset[str]) -> list[str]:
    """A shortest way round through each module of ``group`` (each once), every step with
    the line of its import: ``a.py:12 -> b.py:3 -> a.py``."""
    seen: set[tuple[str, ...]] = set()
    found = []
    for start in sorted(group):
        path = _shortest_way_round(graph, group, start)
        first = path.index(min(path))
        key = tuple(path[first:-1] + path[:first])
        if key in seen:
            continue
        seen.add(key)
        found.append(" -> ".join([f"{a}:{graph[a][b]}" for a, b in zip(path, path[1:])]
                                 + [start]))
    return found


def test_no_import_circles() -> None:
    """No group of modules of mooncake_plugins/ imports each other round a circle (a
    strongly connected group of the import graph).

    Every import counts: at module level, inside functions (one that dodges a circle at
    load time is still the circle), ``importlib.import_module("...")`` with a literal name,
    and those under ``if TYPE_CHECKING:``. The last create no circle at run time, but they
    are the same dependence of a lower module on a higher one (STYLE.md section 7 counts
    tasks.py's type-only ``StoreClient`` as closing the store circle), and turning an
    upward import into a type-only one would otherwise get round this check
    (``import_graph(..., type_checking=False)`` leaves them out). Importing ``a.b.c`` also
    runs ``a/__init__.py`` and ``a/b/__init__.py``; those implicit edges are left out
    (each package would otherwise form a circle with every submodule that imports a sibling).
    """
    sources = {path.relative_to(PACKAGE).as_posix(): path.read_text()
               for path in sorted(PACKAGE.rglob("*.py"))}
    assert len(sources) > 50, f"only {len(sources)} modules found under {PACKAGE}"
    graph = import_graph(sources)
    found = [f"{' '.join(sorted(group))}:\n  " + "\n  ".join(describe(graph, group))
             for group in circles(graph)]
    assert not found, ("import circles (move what both sides need into a module below both, "
                       "as errors.py does for exceptions):\n" + "\n".join(found))


@pytest.mark.parametrize("sources, expected", [
    ({"a.py": "from . import b", "b.py": "from .a import x"}, [{"a.py", "b.py"}]),
    ({"a.py": "def f():\n    from .b import x\n", "b.py": "import mooncake_plugins.a"},
     [{"a.py", "b.py"}]),  # inside a function
    ({"a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
      "b.py": "from .a import x"}, [{"a.py", "b.py"}]),
    ({"p/__init__.py": "from .q import x", "p/q.py": "from ..r import y",
      "r.py": "import importlib\nimportlib.import_module('mooncake_plugins.p')"},
     [{"p/__init__.py", "p/q.py", "r.py"}]),
    ({"p/__init__.py": "from . import q", "p/q.py": "from . import r",
      "p/r.py": "from .q import x"}, [{"p/q.py", "p/r.py"}]),
    ({"a.py": "from .b import c", "b.py": "from mooncake_plugins import a as elsewhere"},
     [{"a.py", "b.py"}]),
    ({"a.py": "from . import a"}, [{"a.py"}]),
    # no circle: a one-way chain; a package run only as the parent of what is imported;
    # a name of a package that is not a module
    ({"a.py": "from . import b", "b.py": "from . import c", "c.py": "import os"}, []),
    ({"p/__init__.py": "from .q import x", "p/q.py": "from .r import y", "p/r.py": ""}, []),
    ({"p/__init__.py": "x = 1", "p/q.py": "from . import x", "a.py": "from .p.q import z"}, []),
])
def test_circle_checker(sources: dict[str, str], expected: list[set[str]]) -> None:
    assert sorted(map(sorted, circles(import_graph(sources)))) == sorted(map(sorted, expected))


def test_circle_checker_can_leave_type_checking_out() -> None:
    type_only = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
                 "else:\n    B = None\n")
    sources = {"a.py": type_only, "b.py": "from .a import x"}
    assert circles(import_graph(sources)) == [frozenset(sources)]
    assert circles(import_graph(sources, type_checking=False)) == []
    sources["a.py"] = type_only.replace("B = None", "from .b import B")  # else: runs
    assert circles(import_graph(sources, type_checking=False)) == [frozenset(sources)]


def test_circle_report_names_each_step() -> None:
    graph = import_graph({"a.py": "import os\nfrom . import b", "b.py": "from .c import x",
                          "c.py": "\n\nfrom .a import y", "d.py": "from . import a"})
    (group,) = circles(graph)
    assert describe(graph, group) == ["a.py:2 -> b.py:1 -> c.py:3 -> a.py"]
    graph = import_graph({"a.py": "from . import b\nfrom . import c", "b.py": "from . import a",
                          "c.py": "from . import b"})
    (group,) = circles(graph)
    assert describe(graph, group) == ["a.py:1 -> b.py:1 -> a.py",
                                      "c.py:1 -> b.py:1 -> a.py:2 -> c.py"]
