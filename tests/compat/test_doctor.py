"""``mooncake-plugins doctor``: the implementation behind ``import mooncake`` and the probes."""

from __future__ import annotations

import socket

import pytest

from mooncake_plugins.cli import doctor


def test_reports_our_implementation_and_probes(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: refused
        up, down = listening.getsockname()[1], closed.getsockname()[1]
        rc = doctor.main(["doctor", f"master://127.0.0.1:{up}", f"etcd://127.0.0.1:{down}",
                          "P2PHANDSHAKE", "ftp://x"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "implementation: mooncake_plugins" in out and "0.3.13.post1" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "reachable" in lines[f"master://127.0.0.1:{up}"]
    assert "not reachable" not in lines[f"master://127.0.0.1:{up}"]
    assert "not reachable" in lines[f"etcd://127.0.0.1:{down}"]
    assert "built in" in lines["P2PHANDSHAKE"]
    assert "not a metadata URL" in lines["ftp://x"]
    assert "available" in lines["tcp"] and "available" in lines["shm"]
    # cuda_ipc says why in one line where CUDA does not work; the NIXL plugin's state
    from mooncake_plugins.transfer import cuda
    if cuda.available():
        assert lines["cuda_ipc"].split(None, 1)[1].startswith("available")
    else:
        assert "unavailable: " + cuda.why_unavailable() in lines["cuda_ipc"]
    from mooncake_plugins.nixl.plugin_dir import PLUGIN_FILE
    nixl = next(line for line in out.splitlines() if line.startswith("  NIXL backend"))
    assert ("plugin built" if PLUGIN_FILE.exists() else "plugin not built") in nixl


def test_nixl_plugin_dir_without_nixl_is_one_sentence(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    if importlib.util.find_spec("nixl_cu12") or importlib.util.find_spec("nixl_cu13"):
        pytest.skip("NIXL is installed here (tests/integrations/nixl_backend covers it)")
    assert doctor.main(["nixl-plugin-dir"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("mooncake-plugins: NIXL is not installed here") and "\n" not in err
    # --export feeds an eval, which then sets nothing: the sentence says so
    assert doctor.main(["nixl-plugin-dir", "--export"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "\n" not in captured.err.strip()
    assert captured.err.startswith("mooncake-plugins: NIXL_PLUGIN_DIR is left unset, as NIXL is "
                                   "not installed here")


def test_warns_when_the_original_wheel_is_installed_too(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    real = doctor._installed
    monkeypatch.setattr(doctor, "_installed", lambda d: "0.3.13.post1"
                        if d == "mooncake-transfer-engine-non-cuda" else real(d))
    assert doctor.main(["doctor", "P2PHANDSHAKE"]) == 0
    out = capsys.readouterr().out
    assert "WARNING: both mooncake_plugins and mooncake-transfer-engine-non-cuda" in out
    assert "pip uninstall mooncake-transfer-engine-non-cuda" in out
