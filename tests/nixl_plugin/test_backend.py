"""The Python side of our NIXL backend, driven as the C++ plugin drives it (no NIXL
needed): two backends in this process, the plugin's entry points through ctypes, and the
plugin directory over a stand-in NIXL wheel layout. NIXL itself drives them in
tests/integrations/nixl_backend (its own venv)."""

from __future__ import annotations

import ctypes
import struct
import time
from pathlib import Path

import pytest
from cuda_double import double  # noqa: F401  (the CUDA driver test double fixture)

from mooncake_plugins.nixl import backend as nb
from mooncake_plugins.nixl import plugin_dir as pd

KIB = 1 << 10


@pytest.fixture
def pair():
    a = nb.NixlBackend("a", {"ip_addr": "127.0.0.1"})
    b = nb.NixlBackend("b", {"ip_addr": "127.0.0.1", "transports": "tcp"})
    assert a.load_remote_conn_info("b", b.conn_info()) == nb.SUCCESS
    assert b.load_remote_conn_info("a", a.conn_info()) == nb.SUCCESS
    yield a, b
    a.close()
    b.close()


def descs(*triples: tuple[int, int, int]) -> bytes:
    return b"".join(struct.pack("=QQQ", *t) for t in triples)


def finish(backend: nb.NixlBackend, xfer: nb.Transfer, status: int) -> int:
    deadline = time.monotonic() + 30
    while status == nb.IN_PROG and time.monotonic() < deadline:
        time.sleep(0.001)
        status = backend.check(xfer)
    return status


def test_write_read_and_notifications(pair):
    a, b = pair
    src = bytearray(range(256)) * 64  # 16 KiB
    dst = bytearray(len(src))
    ca, cb = (ctypes.c_char * len(src)).from_buffer(src), (ctypes.c_char * len(dst)).from_buffer(dst)
    sa, sb = ctypes.addressof(ca), ctypes.addressof(cb)
    ta = a.register(sa, len(src), 0, nb.DRAM_SEG)
    tb = b.register(sb, len(dst), 0, nb.DRAM_SEG)
    assert ta > 0 and tb > 0
    # four 4 KiB blocks, written in reverse order, then a notification after them
    xfer = a.prepare(nb.NIXL_WRITE, "b", descs(*[(sa + i * 4 * KIB, sb + (3 - i) * 4 * KIB, 4 * KIB)
                                                 for i in range(4)]))
    assert isinstance(xfer, nb.Transfer)
    assert finish(a, xfer, a.post(xfer, b"\x00done\xff")) == nb.SUCCESS
    for i in range(4):
        assert dst[(3 - i) * 4 * KIB:(4 - i) * 4 * KIB] == src[i * 4 * KIB:(i + 1) * 4 * KIB]
    assert b.notifs() == [(b"a", b"\x00done\xff")]
    # reposting the same prepared request, now without a notification
    dst[:] = bytes(len(dst))
    assert finish(a, xfer, a.post(xfer, None)) == nb.SUCCESS
    assert dst[12 * KIB:] == src[:4 * KIB] and b.notifs() == []
    assert a.release(xfer) == nb.SUCCESS
    # a READ by the other side, and a notification on its own
    src[:] = bytes(len(src))
    back = b.prepare(nb.NIXL_READ, "a", descs((sb, sa, len(dst))))
    assert finish(b, back, b.post(back, None)) == nb.SUCCESS and dst == src
    assert b.gen_notif("a", b"hi") == nb.SUCCESS and a.notifs() == [(b"b", b"hi")]
    assert a.deregister(ta) == nb.SUCCESS and b.deregister(tb) == nb.SUCCESS
    del ca, cb


def test_refusals(pair):
    a, b = pair
    buf = bytearray(8 * KIB)
    cbuf = (ctypes.c_char * len(buf)).from_buffer(buf)
    addr = ctypes.addressof(cbuf)
    token = a.register(addr, len(buf), 0, nb.DRAM_SEG)
    # the same range again is one registration, counted; another memory type is refused
    assert a.register(addr, len(buf), 0, nb.DRAM_SEG) == token
    assert a.register(addr, len(buf), 0, 4) == nb.ERR_NOT_SUPPORTED  # FILE_SEG
    assert a.deregister(token) == nb.SUCCESS and a.engine.is_registered(addr, len(buf))
    assert a.deregister(token) == nb.SUCCESS and not a.engine.is_registered(addr, len(buf))
    assert a.deregister(token) == nb.ERR_NOT_FOUND
    # connection info that is not an engine's segment name
    for bad in (b"", b"\xff\xfe", b"no-port", b"host:0", b"host:70000", b"h:" + b"1" * 600):
        assert a.load_remote_conn_info("x", bad) == nb.ERR_INVALID_PARAM
    assert a.knows("x") == nb.ERR_NOT_FOUND and a.knows("b") == nb.SUCCESS
    assert a.knows("a") == nb.SUCCESS  # local transfers
    # unknown agents, bad ops, oversized notifications
    assert a.prepare(nb.NIXL_READ, "nobody", descs((addr, 0, 8))) == nb.ERR_NOT_FOUND
    assert a.prepare(7, "b", descs((addr, 0, 8))) == nb.ERR_INVALID_PARAM
    assert a.gen_notif("nobody", b"x") == nb.ERR_NOT_FOUND
    assert a.gen_notif("b", b"x" * (nb.MAX_NOTIF_NBYTES + 1)) == nb.ERR_INVALID_PARAM
    # local memory that is not registered: refused at post
    a.register(addr, len(buf), 0, nb.DRAM_SEG)
    theirs = bytearray(4 * KIB)
    ctheirs = (ctypes.c_char * len(theirs)).from_buffer(theirs)
    b.register(ctypes.addressof(ctheirs), len(theirs), 0, nb.DRAM_SEG)
    xfer = a.prepare(nb.NIXL_READ, "b", descs((addr + 8 * KIB, ctypes.addressof(ctheirs), 16)))
    assert a.post(xfer, None) == nb.ERR_INVALID_PARAM
    # a remote range outside what the peer registered: the peer's own check refuses it
    xfer = a.prepare(nb.NIXL_READ, "b", descs((addr, ctypes.addressof(ctheirs) + 2 * KIB, 4 * KIB)))
    assert finish(a, xfer, a.post(xfer, b"never")) == nb.ERR_INVALID_PARAM
    assert b.notifs() == []  # a failed transfer sends no notification
    # a peer that went away
    assert b.disconnect("a") == nb.SUCCESS and b.knows("a") == nb.ERR_NOT_FOUND
    b.close()
    xfer = a.prepare(nb.NIXL_WRITE, "b", descs((addr, ctypes.addressof(ctheirs), 16)))
    assert finish(a, xfer, a.post(xfer, None)) == nb.ERR_REMOTE_DISCONNECT
    del cbuf, ctheirs


def test_post_refuses_an_oversized_notification(pair):
    """post checks the notification's size as gen_notif does: before any data moves."""
    a, b = pair
    src, dst = bytearray(b"\x5a" * (4 * KIB)), bytearray(4 * KIB)
    ca = (ctypes.c_char * len(src)).from_buffer(src)
    cb = (ctypes.c_char * len(dst)).from_buffer(dst)
    sa, sb = ctypes.addressof(ca), ctypes.addressof(cb)
    ta, tb = a.register(sa, len(src), 0, nb.DRAM_SEG), b.register(sb, len(dst), 0, nb.DRAM_SEG)
    xfer = a.prepare(nb.NIXL_WRITE, "b", descs((sa, sb, len(src))))
    assert a.post(xfer, b"x" * (nb.MAX_NOTIF_NBYTES + 1)) == nb.ERR_INVALID_PARAM
    assert xfer.batch is None and dst == bytes(len(dst))  # nothing was started
    assert b.notifs() == []
    # the limit itself is allowed, and the same request still posts
    assert finish(a, xfer, a.post(xfer, b"y" * nb.MAX_NOTIF_NBYTES)) == nb.SUCCESS
    assert dst == src and b.notifs() == [(b"a", b"y" * nb.MAX_NOTIF_NBYTES)]
    assert a.release(xfer) == nb.SUCCESS
    assert a.deregister(ta) == nb.SUCCESS and b.deregister(tb) == nb.SUCCESS
    del ca, cb


def test_plugin_entry_points():
    """The built plugin exports NIXL's entry points; its table names our backend."""
    if not pd.PLUGIN_FILE.exists():
        pytest.skip("the NIXL plugin was not built (no C++20 compiler at install)")
    lib = ctypes.CDLL(str(pd.PLUGIN_FILE))
    lib.nixl_plugin_init.restype = ctypes.c_void_p
    table = lib.nixl_plugin_init()
    api_version = ctypes.c_int.from_address(table).value
    name_fn = ctypes.CFUNCTYPE(ctypes.c_char_p)(ctypes.c_void_p.from_address(table + 24).value)
    version_fn = ctypes.CFUNCTYPE(ctypes.c_char_p)(ctypes.c_void_p.from_address(table + 32).value)
    assert (api_version, name_fn(), version_fn()) == (1, b"MOONCAKE", b"0.1.0")


def test_plugin_dir_mirrors_the_wheel_layout(tmp_path, monkeypatch):
    """Over a stand-in NIXL wheel (a package name no real NIXL uses): every bundled plugin is linked, ours under both names,
    and the library directories the bundled plugins' RPATH names resolve from there."""
    if not pd.PLUGIN_FILE.exists():
        pytest.skip("the NIXL plugin was not built (no C++20 compiler at install)")
    site = tmp_path / "site"
    (site / "nixl_cu99").mkdir(parents=True)
    (site / "nixl_cu99" / "__init__.py").write_text("")
    (site / "nixl_cu99.libs").mkdir()
    (site / "nixl_cu99.libs" / "libucp-x.so.0").write_text("")
    libs = site / ".nixl_cu99.mesonpy.libs"
    (libs / "plugins").mkdir(parents=True)
    (libs / "libnixl_common.so").write_text("")
    (libs / "plugins" / "libplugin_UCX.so").write_text("ucx")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(pd, "nixl_package", lambda: "nixl_cu99")
    made = pd.plugin_dir(cache=tmp_path / "cache")
    assert made.name == "plugins" and made.parent.name == ".nixl_cu99.mesonpy.libs"
    assert (made / "libplugin_UCX.so").read_text() == "ucx"
    assert (made / "libplugin_MOONCAKE.so").resolve() == pd.PLUGIN_FILE.resolve()
    assert (made / "libplugin_Mooncake.so").resolve() == pd.PLUGIN_FILE.resolve()
    assert (made / ".." / "libnixl_common.so").exists()  # $ORIGIN/..
    assert (made / ".." / ".." / "nixl_cu99.libs" / "libucp-x.so.0").exists()
    assert pd.plugin_dir(cache=tmp_path / "cache") == made  # made once, then reused
    # a NIXL build with its own Mooncake plugin keeps that name; a changed wheel is remade
    (libs / "plugins" / "libplugin_Mooncake.so").write_text("theirs")
    again = pd.plugin_dir(cache=tmp_path / "cache")
    assert (again / "libplugin_Mooncake.so").read_text() == "theirs"
    assert (again / "libplugin_MOONCAKE.so").resolve() == pd.PLUGIN_FILE.resolve()
    assert (made / "libplugin_Mooncake.so").resolve() == pd.PLUGIN_FILE.resolve()  # kept

    # processes starting at once (vLLM's) all get one whole directory, none removed
    (libs / "plugins" / "libplugin_POSIX.so").write_text("posix")
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(8) as pool:
        dirs = list(pool.map(lambda _: pd.plugin_dir(cache=tmp_path / "cache"), range(8)))
    assert len(set(dirs)) == 1 and (dirs[0] / "libplugin_POSIX.so").read_text() == "posix"
    assert not [d for d in (tmp_path / "cache").iterdir() if d.name.startswith(".")]  # no leftovers
    # one that seemed missing at first look but was made meanwhile (another process won
    # the race) is used as it is, never removed and made again
    inode = dirs[0].stat().st_ino
    real, calls = pd._complete, []

    def complete_after_first_look(target, bundled):
        calls.append(target)
        return len(calls) > 1 and real(target, bundled)

    monkeypatch.setattr(pd, "_complete", complete_after_first_look)
    assert pd.plugin_dir(cache=tmp_path / "cache") == dirs[0]
    assert dirs[0].stat().st_ino == inode and len(calls) == 2


def test_no_nixl_is_one_clear_sentence(monkeypatch):
    monkeypatch.setattr(pd.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(pd.NixlNotFound, match="NIXL is not installed here"):
        pd.plugin_dir()


def test_check_waits_only_for_a_busy_poller(pair):
    """A transfer checked again right after its last check is being busy-polled (with the
    GIL held): only then does check wait for it, briefly, so the engine threads can run.
    A once-per-step poller gets IN_PROG at once."""
    a, _ = pair

    class Running:  # a batch that never finishes, recording the waits asked of it
        waits: list[float] = []

        def done(self) -> bool:
            return False

        def wait_done(self, timeout_s: float) -> bool:
            self.waits.append(timeout_s)
            return False

    xfer = nb.Transfer("b", [])
    xfer.batch = Running()
    assert a.check(xfer) == nb.IN_PROG and Running.waits == []  # first check: no wait
    assert a.check(xfer) == nb.IN_PROG and Running.waits == [nb.CHECK_WAIT_S]  # busy poll
    xfer.checked -= 2 * nb.BUSY_POLL_S  # as if the last check were a step ago
    assert a.check(xfer) == nb.IN_PROG and Running.waits == [nb.CHECK_WAIT_S]


def test_vram_registrations_go_to_the_engines_gpu_paths(pair, double):
    """VRAM_SEG memory registered through the backend is GPU memory of the engine (its
    device from NIXL's devId), and moves by the engine's GPU paths: here to the peer's DRAM
    and back, staged through pinned memory over tcp (the peer's transports). Over the CUDA
    driver TEST DOUBLE (tests/cuda_double.py): the glue, not CUDA."""
    a, b = pair
    n = 1 << 20
    dev = double.alloc(n, device=1)
    pattern = bytes(range(256)) * (n // 256)
    ctypes.memmove(dev, pattern, n)
    host = bytearray(n)
    chost = (ctypes.c_char * n).from_buffer(host)
    haddr = ctypes.addressof(chost)
    token = a.register(dev, n, 1, nb.VRAM_SEG)
    assert token > 0 and [r.location for r in a.engine.regions()] == ["cuda:1"]
    assert b.register(haddr, n, 0, nb.DRAM_SEG) > 0
    xfer = a.prepare(nb.NIXL_WRITE, "b", descs((dev, haddr, n)))
    assert finish(a, xfer, a.post(xfer, b"vram")) == nb.SUCCESS
    assert bytes(host) == pattern and b.notifs() == [(b"a", b"vram")]
    assert sum(c[2] for c in double.copy_log) == n  # one D2H of every byte
    assert all(double.is_pinned(d, c) for d, _, c in double.copy_log)
    assert a.deregister(token) == nb.SUCCESS
    del chost
