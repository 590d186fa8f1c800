"""A NIXL plugin directory holding our backend beside NIXL's bundled plugins.

NIXL loads backend plugins (``libplugin_<NAME>.so``) from one directory: its bundled one,
or ``NIXL_PLUGIN_DIR`` instead of it. A directory of plain symlinks to the bundled plugins
lists them but cannot load UCX: the bundled plugins find their libraries through
``$ORIGIN/..`` and ``$ORIGIN/../../nixl_cuXX.libs`` (their RPATH), and ``$ORIGIN`` is the
directory of the path a plugin was opened by, the symlink's. So the directory made here
mirrors the wheel's layout around its plugin directory, with symlinks::

    <root>/.nixl_cuXX.mesonpy.libs/plugins/libplugin_*.so   -> the bundled plugins, and ours
    <root>/.nixl_cuXX.mesonpy.libs/<every other entry>      -> the wheel's
    <root>/nixl_cuXX*                                       -> the wheel's

and every bundled plugin resolves its libraries as it does from the wheel. The directory is
made once per NIXL installation (and plugin set) and reused, under ``~/.cache``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

PLUGIN_FILE = Path(__file__).with_name("libplugin_MOONCAKE.so")
NAMES = ("MOONCAKE", "Mooncake")
"""Backend names we install: ``MOONCAKE`` (what NIXL's own Mooncake plugin calls itself)
and ``Mooncake`` (the file name of that plugin, so the name NIXL lists for it, and the one
nixlbench uses) unless the NIXL installation has a plugin of that name: a user's own build
of NIXL's Mooncake backend keeps its name."""


class NixlNotFound(RuntimeError):
    """No NIXL wheel (``nixl-cu12``/``nixl-cu13``) is installed in this environment."""


def nixl_package() -> str:
    """The ``nixl_cuXX`` package that ``import nixl`` loads here, found without importing
    it (NIXL's own rule: the CUDA major of the process's CUDA stack, else cu13, cu12, rocm).

    Raises:
        NixlNotFound: no NIXL wheel is installed.
    """
    major = None
    if importlib.util.find_spec("nixl_meta_utils") is not None:
        from nixl_meta_utils import detect_cuda_major  # part of the nixl meta package
        major = detect_cuda_major()
    candidates = [f"nixl_cu{major}"] if major else ["nixl_cu13", "nixl_cu12", "nixl_rocm"]
    for name in candidates:
        if importlib.util.find_spec(name) is not None:
            return name
    raise NixlNotFound(f"NIXL is not installed here (no {' or '.join(candidates)} package): "
                       f"pip install nixl")


def bundled_dir(package: str | None = None) -> Path:
    """NIXL's own plugin directory (``<site>/.<package>.mesonpy.libs/plugins``)."""
    package = package or nixl_package()
    spec = importlib.util.find_spec(package)
    site = Path(spec.origin).parent.parent  # type: ignore[union-attr, arg-type]
    plugins = site / f".{package}.mesonpy.libs" / "plugins"
    if not plugins.is_dir():
        raise NixlNotFound(f"{package} has no bundled plugin directory at {plugins}")
    return plugins


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mooncake_plugins" / "nixl"


def plugin_dir(cache: Path | None = None) -> Path:
    """The plugin directory for this environment's NIXL (made on first use): point
    ``NIXL_PLUGIN_DIR`` at it.

    Raises:
        NixlNotFound: no NIXL wheel is installed.
        FileNotFoundError: our plugin was not built (``pip install -e .`` says why).
    """
    if not PLUGIN_FILE.exists():
        raise FileNotFoundError(f"the NIXL plugin was not built ({PLUGIN_FILE} is missing): "
                                f"reinstall mooncake_plugins with a C++20 compiler (g++ >= 10)")
    package = nixl_package()
    bundled = bundled_dir(package)
    libs, site = bundled.parent, bundled.parent.parent
    # named for exactly what it links (a NIXL upgrade or another plugin set gets a
    # directory of its own): one that exists is whole, as it is made under a temporary
    # name and renamed, so processes starting at once (vLLM's) never remove each other's
    state = [str(bundled.resolve()), str(PLUGIN_FILE.resolve())]
    state += [f"{e.name}:{e.stat().st_size}:{e.stat().st_mtime_ns}" for e in sorted(bundled.iterdir())]
    key = hashlib.sha256("\0".join(state).encode()).hexdigest()[:12]
    root = (cache or _cache_root()) / f"{package}-{key}"
    target = root / libs.name / bundled.name
    if _complete(target, bundled):
        return target
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        (tmp / libs.name / bundled.name).mkdir(parents=True)
        for entry in libs.iterdir():  # $ORIGIN/..
            if entry.name != bundled.name:
                (tmp / libs.name / entry.name).symlink_to(entry)
        for entry in site.iterdir():  # $ORIGIN/../../nixl_cuXX.libs and the like
            if entry.name.startswith(package):
                (tmp / entry.name).symlink_to(entry)
        names = _link_plugins(tmp / libs.name / bundled.name, bundled)
        (tmp / "README").write_text(
            f"NIXL plugin directory made by mooncake_plugins for {bundled}\n"
            f"ours: {', '.join(names)} -> {PLUGIN_FILE}\n")
        try:
            tmp.rename(root)
        except OSError:  # made meanwhile by another process: use that one
            if not _complete(target, bundled):
                raise
        else:
            tmp = None  # type: ignore[assignment]
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _link_plugins(into: Path, bundled: Path) -> list[str]:
    for plugin in bundled.iterdir():
        (into / plugin.name).symlink_to(plugin)
    names = []
    for name in NAMES:
        link = into / f"libplugin_{name}.so"
        if not link.exists() and not link.is_symlink():
            link.symlink_to(PLUGIN_FILE)
            names.append(name)
    return names


def _complete(target: Path, bundled: Path) -> bool:
    """Whether ``target`` was made for these bundled plugins and ours, and is whole."""
    if not target.is_dir():
        return False
    ours = target / f"libplugin_{NAMES[0]}.so"
    if not ours.is_symlink() or Path(os.readlink(ours)) != PLUGIN_FILE:
        return False
    for plugin in bundled.iterdir():
        link = target / plugin.name
        if not link.is_symlink() or Path(os.readlink(link)) != plugin:
            return False
    return True
