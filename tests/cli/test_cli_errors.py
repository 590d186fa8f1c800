"""The console scripts answer a mistake with one line that names the flag, not a traceback
or a hundred lines of usage: bad flag values, ports out of range or in use, a dead master,
a missing etcd client."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from helpers import free_port

from mooncake import http_metadata_server
from mooncake_plugins.cli import client, doctor, master, metadata_server

HINT = "for all flags"


def _run(module: str, *args: str, pre: str = "") -> subprocess.CompletedProcess:
    """``python -m mooncake_plugins.cli.<module> args`` (``pre``: code run first)."""
    code = f"{pre}\nimport runpy, sys\nsys.argv[0] = {module!r}\n" \
           f"runpy.run_module('mooncake_plugins.cli.{module}', run_name='__main__')"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=60)


def _short_error(capsys, main, argv: list[str]) -> list[str]:
    """Run an in-process ``main`` that must refuse ``argv``: its stderr lines."""
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and HINT in lines[1], lines
    return lines


# the master's flags through parse_args: main would serve where a bad port got through
PORT_FLAGS = [pytest.param(main, flag, id=f"{name}{flag}") for name, main, flags in [
    ("master", master.parse_args, ["--rpc_port", "--port", "--metrics_port",
                                   "--http_metadata_server_port"]),
    ("client", client.main, ["--port", "--http_port"]),
    ("metadata_server", metadata_server.main, ["--port"]),
    ("mooncake_http_metadata_server", http_metadata_server.parse_args, ["--port"]),
] for flag in flags]


@pytest.mark.parametrize("main, flag", PORT_FLAGS)
@pytest.mark.parametrize("value", ["70000", "-1", "abc"])
def test_every_port_flag_is_checked(capsys, main, flag, value):
    error = _short_error(capsys, main, [f"{flag}={value}"])[0]
    assert f"argument {flag}:" in error and value in error


def test_a_bad_flag_value_is_two_lines_not_the_usage(capsys):
    error = _short_error(capsys, master.parse_args, ["--eviction_ratio=lots"])[0]
    assert error.startswith("mooncake-master: error: argument --eviction_ratio")


@pytest.mark.parametrize("argv, flag, want", [
    (["--eviction_high_watermark_ratio=2"], "--eviction_high_watermark_ratio", "a ratio in (0, 1]"),
    (["--eviction_ratio=0"], "--eviction_ratio", "a ratio in (0, 1]"),
    (["--client_ttl=0"], "--client_ttl", "seconds > 0"),
    (["--default_kv_lease_ttl=0"], "--default_kv_lease_ttl", "a duration > 0"),
    (["--restored_client_grace=-1"], "--restored_client_grace", "seconds >= 0"),
    (["--replica_repair_concurrency=-1"], "--replica_repair_concurrency", "a count >= 0"),
    (["--stripe_size=100"], "--stripe_size", "bytes >= 4096"),
    (["--default_kv_soft_pin_ttl=2h", "--max_kv_soft_pin_ttl=1h"], "--default_kv_soft_pin_ttl",
     "--max_kv_soft_pin_ttl"),
])
def test_a_master_value_out_of_range_names_the_program_and_the_flag(capsys, argv, flag, want):
    error = _short_error(capsys, master.parse_args, argv)[0]
    assert error.startswith(f"mooncake-master: error: argument {flag}: ") and want in error


def test_master_config_file_and_flagfile_errors(tmp_path):
    config = tmp_path / "master.json"
    config.write_text(json.dumps({"rpc_port": 70000}))
    with pytest.raises(SystemExit, match="rpc_port: port 70000 is not in 0..65535"):
        master.parse_args([f"--config_path={config}"])
    with pytest.raises(SystemExit, match="--flagfile .*: No such file"):
        master.parse_args([f"--flagfile={tmp_path / 'none'}"])


@pytest.mark.parametrize("flag", ["--rpc_port", "--metrics_port", "--http_metadata_server_port"])
def test_a_port_in_use_names_its_flag(flag):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--rpc_port": 0, "--metrics_port": 0, "--http_metadata_server_port": 0,
                 flag: port}
        res = _run("master", "--enable_http_metadata_server", "--log_level=WARNING",
                   *(f"{f}={p}" for f, p in ports.items()))
    assert res.returncode == 1 and "Traceback" not in res.stderr
    [line] = [ln for ln in res.stderr.splitlines() if ln.startswith("mooncake-master:")]
    assert line == (f"mooncake-master: cannot listen on 127.0.0.1:{port} ({flag}): Address "
                    f"already in use; pick another {flag} (0 picks a free port)")


def test_ha_without_a_fixed_rpc_port_is_refused():
    res = _run("master", "--enable_ha", "--etcd_endpoints=127.0.0.1:1", "--rpc_port=0",
               "--metrics_port=0")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--enable_ha needs a fixed --rpc_port" in res.stderr


def test_ha_without_the_etcd_client_says_how_to_install_it():
    res = _run("master", "--enable_ha", "--etcd_endpoints=127.0.0.1:1",
               f"--rpc_port={free_port()}", "--metrics_port=0", "--enable_metric_reporting=false",
               pre="import sys; sys.modules['etcd3gw'] = None")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.splitlines()[-1].endswith("pip install 'mooncake_plugins[etcd]'")


def test_the_etcd_client_is_in_the_base_install():
    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11 has no tomllib")
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    assert any(d.startswith("etcd3gw") for d in deps)


def test_client_with_a_dead_master_says_so_in_one_line():
    res = _run("client", "--metadata_server=P2PHANDSHAKE", f"--master_server_address=127.0.0.1:"
               f"{free_port()}", "--global_segment_size=1MB", "--log_level=WARNING")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.splitlines() == [line for line in res.stderr.splitlines()
                                       if line.startswith("mooncake_client: cannot set up")]
    assert "cannot reach master" in res.stderr


@pytest.mark.parametrize("address", ["127.0.0.1:70000", "127.0.0.1", "127.0.0.1:port"])
def test_client_checks_the_master_address(capsys, address):
    error = _short_error(capsys, client.main, [f"--master_server_address={address}"])[0]
    assert "argument --master_server_address" in error


def test_client_without_the_etcd_client_says_how_to_install_it():
    res = _run("client", "--metadata_server=P2PHANDSHAKE",
               "--master_server_address=etcd://127.0.0.1:1", "--global_segment_size=1MB",
               "--log_level=WARNING", pre="import sys; sys.modules['etcd3gw'] = None")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.strip().endswith("pip install 'mooncake_plugins[etcd]'")


def test_bench_with_a_bad_address_says_so_in_one_line():
    res = _run("bench", "--mode=target", "--local_server_name=127.0.0.1:70000",
               "--buffer_size=1m")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.strip().startswith("mooncake-transfer-bench: bad port")


def test_doctor_reports_a_bad_port():
    assert doctor.probe("etcd://127.0.0.1:70000", 0.1)[1].startswith("bad port")
