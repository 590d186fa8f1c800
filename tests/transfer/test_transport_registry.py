"""The transport registry and the engine's path choice by what transports declare.

Reach (``supports``), memory kinds (``memory_kinds``/``moves``, from the regions'
``location``) and rank (``priority``), best first. Memory kinds other than host are
exercised with test doubles registered for one test: host bytes registered under a
``cuda:N`` location, moved by ``memmove`` between two engines of this process.
"""

from __future__ import annotations

import ast
import ctypes
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.errors import TransferError, TransportUnavailable
from mooncake_plugins.transfer import OpCode, TransferEngine, TransferRequest
from mooncake_plugins.transfer.transports.base import Transport

TRANSFER = Path(__file__).resolve().parents[2] / "mooncake_plugins" / "transfer"
N = 4096


# -- test doubles (registered by fixtures, never by the package) --------------------------
def _registry():
    from mooncake_plugins.transfer.transports import registry
    return registry


def _table():
    from mooncake_plugins import transport_table
    return transport_table


class _CudaOnlyDoubleTransport(Transport):
    """Test double: moves only cuda-kind memory (host bytes registered as ``cuda:N``), in
    this process, and records every slice it moved as ``(segment, op, nbytes)``."""

    name = "cuda_double"
    priority = 50
    memory_kinds = frozenset({"cuda"})
    moved: list[tuple[str, int, int]] = []

    def supports(self, peer) -> bool:
        return True

    def execute(self, peer, op, local_address, remote_address, nbytes) -> None:
        src, dst = (local_address, remote_address) if op == 2 else (remote_address, local_address)
        ctypes.memmove(dst, src, nbytes)
        type(self).moved.append((peer.name, op, nbytes))


class _FailingCudaDoubleTransport(_CudaOnlyDoubleTransport):
    """Test double: ranked above ``_CudaOnlyDoubleTransport``, fails every slice."""

    name = "cuda_failing_double"
    priority = 60
    failed: list[int] = []

    def execute(self, peer, op, local_address, remote_address, nbytes) -> None:
        type(self).failed.append(nbytes)
        raise TransferError("the failing double refuses every slice")


class _NoLibraryDoubleTransport(_CudaOnlyDoubleTransport):
    """Test double: its system library is missing (as rdma's libibverbs may be)."""

    name = "nolib_double"

    def __init__(self) -> None:
        raise OSError("libnotthere.so.1: cannot open shared object file")


@pytest.fixture
def doubles():
    """Register the doubles under their names for one test, then remove them."""
    table = _table()
    names = []
    for cls in (_CudaOnlyDoubleTransport, _FailingCudaDoubleTransport, _NoLibraryDoubleTransport):
        table.register_transport(cls.name, __name__, cls.__name__)
        names.append(cls.name)
    _CudaOnlyDoubleTransport.moved = []
    _FailingCudaDoubleTransport.failed = []
    yield
    for name in names:
        table.unregister_transport(name)


@pytest.fixture
def ghost():
    """A registry entry whose module does not exist."""
    table = _table()
    table.register_transport("ghost", "mooncake_plugins.transfer.transports._no_such_module",
                             "GhostTransport")
    yield "ghost"
    table.unregister_transport("ghost")


def engines(*transports: str) -> tuple[TransferEngine, TransferEngine]:
    cfg = lambda: EngineConfig(transports=list(transports), slice_nbytes=N)  # noqa: E731
    return TransferEngine(config=cfg()), TransferEngine(config=cfg())


# -- ranking --------------------------------------------------------------------------------
def test_transports_declare_their_rank_and_kinds():
    registry = _registry()
    tcp, shm = registry.transport_class("tcp"), registry.transport_class("shm")
    assert shm.priority > tcp.priority
    assert tcp.memory_kinds == shm.memory_kinds == frozenset({"host"})
    assert [t.name for t in registry.rank([tcp(), shm()])] == ["shm", "tcp"]


def test_the_rank_not_the_config_order_decides():
    a, b = engines("tcp", "shm")
    try:
        peer = a.open_segment(b.segment_name)
        assert [t.name for t in a._paths(peer, None)] == ["shm", "tcp"]
    finally:
        a.close()
        b.close()


def test_engine_ranks_transports_best_first_whatever_the_config_order(doubles):
    a, b = engines("tcp", "cuda_double", "shm")
    try:
        assert [t.name for t in a._transports] == ["cuda_double", "shm", "tcp"]
        peer = a.open_segment(b.segment_name)
        assert [t.name for t in a._paths(peer, None)] == ["shm", "tcp"]  # same host: shm first
        assert [t.name for t in a._paths(peer, "tcp")] == ["tcp"]
    finally:
        a.close()
        b.close()


# -- choice by memory kind -------------------------------------------------------------------
def test_memory_kind_chooses_the_transport(doubles):
    a, b = engines("shm", "tcp", "cuda_double")
    try:
        host_src, host_dst = a.register(bytearray(b"h" * N)), b.register(bytearray(N))
        gpu_src = a.register(bytearray(b"g" * N), location="cuda:0")
        gpu_dst = b.register(bytearray(N), location="cuda:1")
        peer = a.open_segment(b.segment_name)
        assert [t.name for t in a._paths(peer, None, ("cuda", "cuda"))] == ["cuda_double"]

        a.write(b.segment_name, host_src.address, host_dst.address, N)
        assert _CudaOnlyDoubleTransport.moved == []  # host memory never goes to it
        assert bytes(b.local_view(host_dst.address, N)) == b"h" * N

        a.write(b.segment_name, gpu_src.address, gpu_dst.address, N)
        assert _CudaOnlyDoubleTransport.moved == [(b.segment_name, 2, N)]
        assert bytes(b.local_view(gpu_dst.address, N)) == b"g" * N

        # one batch of both kinds: each request on its own kind's path
        _CudaOnlyDoubleTransport.moved.clear()
        back_host, back_gpu = a.register(bytearray(N)), a.register(bytearray(N), location="cuda:0")
        batch = a.submit(b.segment_name, [
            TransferRequest(OpCode.READ, back_host.address, host_dst.address, N),
            TransferRequest(OpCode.READ, back_gpu.address, gpu_dst.address, N)])
        batch.wait(10)
        assert _CudaOnlyDoubleTransport.moved == [(b.segment_name, 1, N)]
        assert bytes(a.local_view(back_host.address, N)) == b"h" * N
        assert bytes(a.local_view(back_gpu.address, N)) == b"g" * N

        # the same through transfer_many's small path (the store's), kinds interleaved
        _CudaOnlyDoubleTransport.moved.clear()
        a.local_view(back_host.address, N)[:] = bytes(N)
        a.local_view(back_gpu.address, N)[:] = bytes(N)
        half = N // 2
        errors = a.transfer_many(OpCode.READ, {b.segment_name: [
            (back_gpu.address, gpu_dst.address, half),
            (back_host.address, host_dst.address, half),
            (back_gpu.address + half, gpu_dst.address + half, half),
            (back_host.address + half, host_dst.address + half, half)]})
        assert errors == {b.segment_name: [None] * 4}
        assert _CudaOnlyDoubleTransport.moved == [(b.segment_name, 1, half)] * 2
        assert bytes(a.local_view(back_host.address, N)) == b"h" * N
        assert bytes(a.local_view(back_gpu.address, N)) == b"g" * N
    finally:
        a.close()
        b.close()


def test_a_failed_slice_goes_to_the_next_transport_of_its_kind(doubles):
    a, b = engines("shm", "tcp", "cuda_double", "cuda_failing_double")
    try:
        src = a.register(bytearray(b"f" * N), location="cuda:0")
        dst = b.register(bytearray(N), location="cuda:0")
        peer = a.open_segment(b.segment_name)
        assert [t.name for t in a._paths(peer, None, ("cuda", "cuda"))] == \
            ["cuda_failing_double", "cuda_double"]
        a.write(b.segment_name, src.address, dst.address, N)
        assert _FailingCudaDoubleTransport.failed  # tried first
        assert _CudaOnlyDoubleTransport.moved == [(b.segment_name, 2, N)]  # then the next
        assert bytes(b.local_view(dst.address, N)) == b"f" * N
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "batch"])
def test_a_kind_no_transport_moves_is_a_clear_error(doubles, inline):
    a, b = engines("shm", "tcp", "cuda_double")
    try:
        gpu_src = a.register(bytearray(b"g" * N), location="cuda:0")
        host_dst = b.register(bytearray(N))
        with pytest.raises(TransportUnavailable) as info:
            if inline:  # transfer_many's small path (the store's)
                raise a.transfer_many(OpCode.WRITE, {b.segment_name: [
                    (gpu_src.address, host_dst.address, N)]})[b.segment_name][0]
            a.write(b.segment_name, gpu_src.address, host_dst.address, N)
        text = str(info.value)
        assert "no transport moves cuda memory here to or from host memory" in text
        assert text.endswith("; tried cuda_double (moves cuda), shm (moves host), tcp (moves host)")
        assert bytes(b.local_view(host_dst.address, N)) == bytes(N)  # nothing moved
        a.unregister(gpu_src, wait_s=0)  # and nothing stayed held
        assert _CudaOnlyDoubleTransport.moved == []
    finally:
        a.close()
        b.close()


def test_cuda_memory_without_a_cuda_transport_names_the_kinds_and_transports():
    a, b = engines("shm", "tcp")
    try:
        src = a.register(bytearray(N), location="cuda:0")
        dst = b.register(bytearray(N), location="cuda:0")
        with pytest.raises(TransportUnavailable,
                           match=r"no transport moves cuda memory here to or from cuda memory "
                                 r"of segment .*; tried shm \(moves host\), tcp \(moves host\)"):
            a.write(b.segment_name, src.address, dst.address, N)
        with pytest.raises(TransportUnavailable, match=r"with hint 'tcp'; tried tcp \(moves host\)"):
            a.transfer(b.segment_name, OpCode.READ, src.address, dst.address, N, transport="tcp")
    finally:
        a.close()
        b.close()


def test_memory_kind_of_a_location():
    from mooncake_plugins.transfer.segment import kind_of_location
    for location in ("*", "cpu", "cpu:0", "", None, "cudax"):
        assert kind_of_location(location) == "host", location
    for location in ("cuda", "cuda:0", "cuda:7"):
        assert kind_of_location(location) == "cuda", location


# -- the registry ----------------------------------------------------------------------------
def test_an_unloadable_entry_is_unavailable_when_built_not_when_imported(ghost, caplog):
    registry = _registry()
    assert ghost in _table().transport_names()  # registering imported nothing
    with pytest.raises(TransportUnavailable, match="transport 'ghost' is unavailable here") as info:
        registry.build_transport(ghost)
    assert "\n" not in str(info.value) and "_no_such_module" in str(info.value)
    assert isinstance(info.value.__cause__, ImportError)
    with caplog.at_level(logging.WARNING, logger="mooncake_plugins.transfer.engine"), \
            TransferEngine(config=EngineConfig(transports=[ghost, "tcp"])) as e:
        assert [t.name for t in e._transports] == ["tcp"]
    assert "transport ghost disabled" in caplog.text


def test_a_missing_class_or_library_is_unavailable(doubles):
    registry, table = _registry(), _table()
    table.register_transport("ghost_class", "mooncake_plugins.transfer.transports.tcp",
                             "NoSuchTransport")
    try:
        with pytest.raises(TransportUnavailable, match="has no Transport class 'NoSuchTransport'"):
            registry.build_transport("ghost_class")
    finally:
        table.unregister_transport("ghost_class")
    with pytest.raises(TransportUnavailable, match="'nolib_double' is unavailable here: "
                                                   "libnotthere.so.1"):
        registry.build_transport("nolib_double")


def test_unknown_transport_names_are_refused(monkeypatch, doubles):
    with pytest.raises(ValueError, match="choose from 'cuda_double', .*'shm', 'tcp'"):
        EngineConfig(transports=["nope"]).validate()
    monkeypatch.setenv("MC_TRANSPORTS", "tcp,nope")
    with pytest.raises(ValueError, match="transports=\\['tcp', 'nope'\\]"):
        EngineConfig.from_env()
    monkeypatch.setenv("MC_TRANSPORTS", "tcp,cuda_double")  # a registered one is a name
    assert EngineConfig.from_env().transports == ["tcp", "cuda_double"]
    with pytest.raises(TransportUnavailable, match="unknown transport 'nope'"):
        _registry().build_transport("nope")


def test_registering_a_taken_name_needs_replace():
    table = _table()
    with pytest.raises(ValueError, match="already registered"):
        table.register_transport("tcp", "somewhere.else", "Other")
    assert dict((n, (m, c)) for n, m, c in table.entries())["tcp"] == \
        ("mooncake_plugins.transfer.transports.tcp", "TcpTransport")


# -- no import circle ------------------------------------------------------------------------
def test_importing_the_transports_does_not_import_the_engine():
    code = ("import sys\n"
            "import mooncake_plugins.transfer.transports.tcp\n"
            "import mooncake_plugins.transfer.transports.shm\n"
            "loaded = 'mooncake_plugins.transfer.engine' in sys.modules\n"
            "print('engine imported' if loaded else 'ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module as written, names)`` of every import statement of a file, TYPE_CHECKING
    blocks included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found.append(("." * node.level + (node.module or ""), [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return found


def test_transports_never_import_the_engine_and_the_engine_no_transport_class():
    for path in sorted((TRANSFER / "transports").glob("*.py")):
        for module, names in _imports(path):
            assert not module.endswith("engine") and "engine" not in names, (path.name, module)
    for module, names in _imports(TRANSFER / "engine.py"):
        if "transports" in module:
            assert not {"TcpTransport", "ShmTransport", "get_transport"} & set(names), names
    from mooncake_plugins.transfer.peer import Peer
    with TransferEngine(config=EngineConfig(transports=["tcp"])) as a, \
            TransferEngine(config=EngineConfig(transports=["tcp"])) as b:
        assert isinstance(a.open_segment(b.segment_name), Peer)
