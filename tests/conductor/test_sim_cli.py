"""``mooncake-sim`` end to end on a small generated trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_plugins.cli.conductor import main

REPO = Path(__file__).resolve().parents[2]


def _write_trace(path: Path, count: int = 60) -> Path:
    lines = []
    for i in range(count):
        shared = [0, 1, 2] if i % 2 else [10, 11]
        unique = [1000 + 10 * i + k for k in range(i % 5 + 1)]
        blocks = shared + unique
        lines.append(json.dumps({"timestamp": 250 * i, "input_length": 512 * len(blocks) - 7,
                                 "output_length": 20 + i % 7, "hash_ids": blocks}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_cli_compare_plot_and_json(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "small.jsonl")
    png, out = tmp_path / "plot.png", tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "mooncake_plugins.cli.conductor", str(trace), "--compare",
         "--prefill", "2", "--decode", "1", "--cache-tokens", "4096", "--plot", str(png),
         "--json", str(out), "--quiet"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:2] == ["policy", "hit"]
    assert [line.split()[0] for line in lines[1:]] == ["random", "round_robin", "load_balance",
                                                       "cache_aware", "conductor"]
    report = json.loads(out.read_text())
    assert [r["policy"] for r in report["results"]] == [line.split()[0] for line in lines[1:]]
    assert len(report["cache_sweep"]["conductor"]) == 8
    assert all(0.0 <= hit <= 1.0 for _, hit in report["cache_sweep"]["random"])
    assert report["cluster"]["num_prefill"] == 2


def test_cli_capacity_and_slo_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write_trace(tmp_path / "small.jsonl")
    out = tmp_path / "out.json"
    assert main([str(trace), "--policy", "load_balance", "--ttft-slo-ms", "2000",
                 "--tbt-slo-ms", "80", "--rate-scale", "2", "--capacity", "--json", str(out),
                 "--quiet"]) == 0
    header = capsys.readouterr().out.splitlines()[0].split()
    assert header[-2:] == ["x", "req/s"]
    report = json.loads(out.read_text())
    assert report["slo"] == {"ttft_s": 2.0, "tbt_s": 0.08}
    assert report["results"][0]["rate_scale"] == 2.0
    capacity = report["capacity"]["load_balance"]
    assert capacity["rate_scale"] > 0 and capacity["probes"]


def test_cli_reports_a_bad_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": -3, "output_length": 1, "hash_ids": []}\n')
    assert main([str(trace), "--quiet"]) == 1
    assert f"{trace}:1: input_length" in capsys.readouterr().err


def test_cli_replays_a_bundled_trace_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # no file of that name here: the package's copy is read
    assert main(["synthetic_trace", "--policy", "random", "--json", "out.json", "--quiet"]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["results"][0]["requests"] == 3993
    _write_trace(tmp_path / "synthetic_trace", count=7)  # a file of that name comes first
    assert main(["synthetic_trace", "--policy", "random", "--json", "out.json", "--quiet"]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["results"][0]["requests"] == 7
    assert main(["synthetic", "--quiet"]) == 1
    assert "No such file" in capsys.readouterr().err


def test_plot_without_matplotlib_says_what_to_install(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    trace = _write_trace(tmp_path / "small.jsonl")
    assert main([str(trace), "--plot", str(tmp_path / "p.png"), "--quiet"]) == 1
    assert "mooncake_plugins[sim]" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_cli_prefill_steps_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write_trace(tmp_path / "small.jsonl")
    out = tmp_path / "out.json"
    assert main([str(trace), "--max-num-batched-tokens", "8192", "--json", str(out),
                 "--quiet"]) == 0
    assert json.loads(out.read_text())["cluster"]["prefill_step_tokens"] == 8192
    assert main([str(trace), "--max-num-batched-tokens", "-1", "--quiet"]) == 1
    assert "prefill_step_tokens must be >= 0, got -1" in capsys.readouterr().err
