"""``mooncake-plugins doctor``: what ``import mooncake`` resolves to, and what this host can do.

Prints the implementation and version behind the ``mooncake`` package (ours, or the
original ``mooncake-transfer-engine`` wheel, which installs a package of the same name),
warns when both are installed, then lists the transports (native or Python data path) and
whether each metadata backend is reachable. Exits 0, or 1 when ``mooncake`` cannot be
imported at all.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import shlex
import socket
import sys
from typing import Any
from urllib.parse import urlsplit

from ._args import ArgumentParser

ORIGINAL_DISTS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda",
                  "mooncake-transfer-engine-cuda13")
DEFAULT_PROBES = ("http://127.0.0.1:8080/metadata", "etcd://127.0.0.1:2379",
                  "redis://127.0.0.1:6379", "master://127.0.0.1:50051")


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def resolution() -> dict[str, Any]:
    """Which ``mooncake`` package a plain import gives, and which distributions provide one."""
    originals = {d: v for d in ORIGINAL_DISTS if (v := _installed(d))}
    info: dict[str, Any] = {"originals_installed": originals,
                            "ours_installed": _installed("mooncake_plugins")}
    try:
        module = importlib.import_module("mooncake")
    except ImportError as exc:
        info.update(implementation=None, error=str(exc))
        return info
    ours = getattr(module, "IMPLEMENTATION", None) == "mooncake_plugins"
    info.update(path=getattr(module, "__file__", None) or list(getattr(module, "__path__", [])),
                implementation="mooncake_plugins" if ours else "original")
    if ours:
        import mooncake_plugins
        info["version"] = f"mooncake_plugins {mooncake_plugins.__version__} " \
                          f"(API of mooncake {module.API_VERSION})"
    else:
        info["version"] = ", ".join(f"{d} {v}" for d, v in originals.items()) or "unknown"
    return info


def transports() -> list[tuple[str, str]]:
    """(name, state) of each transport in the engine's registry on this host, then the
    NIXL backend plugin."""
    from mooncake_plugins.transfer import cuda, implementation
    from mooncake_plugins.transfer.transports import transport_names
    path = implementation.current()
    rows = []
    for name in transport_names():
        if name == "cuda_ipc" and not cuda.available():
            rows.append((name, f"unavailable: {cuda.why_unavailable()}"))
        elif name == "rdma":
            rows.append((name, f"{rdma_devices()}; {rdma_nics()}"))
        else:
            rows.append((name, f"available ({path} data path)"))
    rows.append(("NIXL backend", nixl_state()))
    return rows


def rdma_devices() -> str:
    """What libibverbs lists here, or why it lists nothing, in a few words."""
    from mooncake_plugins.transfer import verbs
    if not verbs.available():
        return f"libibverbs: {verbs.why_unavailable()}"
    return "libibverbs devices " + ", ".join(d["name"] for d in verbs.devices())


def rdma_nics() -> str:
    """The RDMA NICs with an ACTIVE port and their NUMA nodes, in a few words."""
    from mooncake_plugins.transfer.nic_topology import NicTopology
    nics = NicTopology.discover().nics
    if not nics:
        return "no RDMA device with an active port in /sys/class/infiniband"
    return "NICs " + ", ".join(f"{n.name} (NUMA {n.numa_node})" for n in nics)


def nixl_state() -> str:
    """Whether NIXL can use our backend here, in one line."""
    from mooncake_plugins.nixl.plugin_dir import PLUGIN_FILE, NixlNotFound, nixl_package
    if not PLUGIN_FILE.exists():
        return "plugin not built (reinstall with a C++20 compiler)"
    try:
        package = nixl_package()
    except NixlNotFound:
        return f"plugin built ({PLUGIN_FILE.name}); NIXL not installed here"
    return (f"plugin built; {package} installed: "
            f"eval \"$(mooncake-plugins nixl-plugin-dir --export)\", backends=[\"MOONCAKE\"]")


def _reachable(host: str, port: int, timeout_s: float) -> str:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return "reachable"
    except OSError as exc:
        return f"not reachable ({exc.strerror or exc})"


def probe(url: str, timeout_s: float) -> tuple[str, str]:
    """(backend, state) for a metadata URL or ``master://host:port``."""
    if url == "P2PHANDSHAKE":
        return "P2PHANDSHAKE", "built in (no server needed)"
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    defaults = {"http": 80, "etcd": 2379, "redis": 6379, "master": 50051}
    if scheme not in defaults or not parts.hostname:
        return url, "not a metadata URL (http://, etcd://, redis://, master://, P2PHANDSHAKE)"
    try:
        port = parts.port or defaults[scheme]
    except ValueError as exc:  # urlsplit checks the port only when asked for it
        return url, f"bad port: {exc}"
    client_lib = {"etcd": "etcd3gw", "redis": "redis"}.get(scheme)
    if client_lib and importlib.util.find_spec(client_lib) is None:
        return url, f"client library missing: pip install 'mooncake_plugins[{scheme}]'"
    return url, _reachable(parts.hostname, port, timeout_s)


def doctor(urls: list[str], timeout_s: float) -> int:
    info = resolution()
    print("import mooncake")
    if info["implementation"] is None:
        print(f"  cannot be imported: {info['error']}")
    else:
        print(f"  implementation: {info['implementation']}")
        print(f"  version:        {info['version']}")
        print(f"  location:       {info['path']}")
    if info["originals_installed"] and info["ours_installed"]:
        names = ", ".join(info["originals_installed"])
        print(f"  WARNING: both mooncake_plugins and {names} install a 'mooncake' package in "
              f"this environment; the one above wins. Use one per environment: "
              f"pip uninstall {names} (ours), or a separate venv for the original.")
    print("transports")
    for name, state in transports():
        print(f"  {name:13} {state}")
    print("metadata backends and master")
    for url in urls:
        name, state = probe(url, timeout_s)
        print(f"  {name:34} {state}")
    return 0 if info["implementation"] is not None else 1


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="mooncake-plugins", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="what `import mooncake` gives and what this host can do")
    doc.add_argument("urls", nargs="*", default=list(DEFAULT_PROBES),
                     help="metadata URLs / master://host:port to probe (default: the local "
                          "defaults: %(default)s)")
    doc.add_argument("--timeout", type=float, default=0.5, help="seconds per probe")
    nixl = sub.add_parser("nixl-plugin-dir",
                          help="print a NIXL plugin directory holding our backend (MOONCAKE) "
                               "and NIXL's bundled ones: export NIXL_PLUGIN_DIR=<it>")
    nixl.add_argument("--export", action="store_true",
                      help="print it as a shell line: export NIXL_PLUGIN_DIR=...")
    args = ap.parse_args(argv)
    if args.command == "nixl-plugin-dir":
        return nixl_plugin_dir(args.export)
    return doctor(args.urls, args.timeout)


def nixl_plugin_dir(export: bool) -> int:
    """Print the NIXL plugin directory of this environment (made on first use)."""
    from mooncake_plugins.nixl.plugin_dir import NixlNotFound, plugin_dir
    try:
        path = plugin_dir()
    except (NixlNotFound, FileNotFoundError) as exc:
        # with --export, stdout goes to an eval that then does nothing: say so
        unset = "NIXL_PLUGIN_DIR is left unset, as " if export else ""
        print(f"mooncake-plugins: {unset}{exc}", file=sys.stderr)
        return 1
    print(f"export NIXL_PLUGIN_DIR={shlex.quote(str(path))}" if export else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
