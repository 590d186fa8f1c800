"""The verbs module where there is no RDMA device (this machine, CI): it is built, links
nothing from libibverbs (one wheel for every machine), loads the library at run time, and
says in one sentence why there is no RDMA; a wrong library path is one sentence too, and
an engine told to use rdma alone fails at start with it. tests/rdma/run.sh compares its
device list with the system's on RDMA hardware."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import textwrap

import pytest
from helpers import skip_or_fail


def native_verbs():
    try:
        return importlib.import_module("mooncake_plugins._native.verbs")
    except ImportError as exc:   # not built, or built and unloadable (an unresolved symbol)
        skip_or_fail(f"the verbs module cannot be imported here: {exc}")


def test_the_module_links_nothing_from_libibverbs():
    mod = native_verbs()
    if shutil.which("readelf") is None or shutil.which("nm") is None:
        skip_or_fail("needs binutils (readelf, nm) to read the module")
    needed = subprocess.run(["readelf", "-d", mod.__file__], capture_output=True, text=True,
                            check=True).stdout
    assert "NEEDED" in needed and "ibverbs" not in needed, needed
    undefined = subprocess.run(["nm", "-D", "--undefined-only", mod.__file__],
                               capture_output=True, text=True, check=True).stdout
    assert not [s for s in undefined.split() if s.startswith("ibv_")], undefined


def run(code: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env={**__import__("os").environ, **env}, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_no_device_is_one_sentence_not_a_crash():
    native_verbs()
    text = run("""
        from mooncake_plugins.transfer import verbs
        try:
            verbs.devices()
        except verbs.RdmaUnavailable as exc:
            print(verbs.available(), "|", exc)
        else:
            print("devices", verbs.devices())
    """)
    if text.startswith("devices"):
        pytest.skip(f"this machine has RDMA devices: {text}")
    if "cannot be loaded" in text:
        skip_or_fail(f"libibverbs is not installed (apt install libibverbs1): {text}")
    available, _, why = text.partition(" | ")
    assert available == "False" and why.startswith("no RDMA device"), text
    assert "\n" not in why


def test_a_library_that_cannot_load_is_named():
    native_verbs()
    text = run("""
        from mooncake_plugins.transfer import verbs
        print(verbs.why_unavailable())
    """, MOONCAKE_LIBIBVERBS="/nonexistent/libibverbs.so.1")
    assert text.startswith("/nonexistent/libibverbs.so.1 cannot be loaded"), text
    assert "MOONCAKE_LIBIBVERBS" in text


def test_rdma_alone_without_rdma_fails_at_start_and_protocol_rdma_falls_back():
    text = run("""
        from mooncake.engine import TransferEngine as Compat
        from mooncake_plugins.errors import TransportUnavailable
        from mooncake_plugins.transfer import TransferEngine
        from mooncake_plugins.config import EngineConfig
        try:
            TransferEngine("127.0.0.1", config=EngineConfig(transports=["rdma"])).close()
        except TransportUnavailable as exc:
            print(exc)
        else:
            print("started")
        compat = Compat()
        print(compat.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", ""))
        compat.close()
    """, MOONCAKE_LIBIBVERBS="/nonexistent/libibverbs.so.1")
    sentence, code = text.splitlines()
    assert sentence.startswith("no RDMA device: "), sentence
    assert "MC_TRANSPORTS=rdma" in sentence, sentence
    assert code == "0", text   # the original API's protocol="rdma" runs over tcp
