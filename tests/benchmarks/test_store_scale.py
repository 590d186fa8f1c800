"""benchmarks/store_scale.py --quick end to end: every section's figures are in the JSON and
plausible, and no process the script started outlives it."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "store_scale.py"
RPC_OPS = {(op, batch) for op in ("exist", "get_replicas", "get", "put") for batch in (1, 128)}


def _positive(*values: object) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def _tagged_processes(tag: str) -> list[int]:
    """Live processes whose environment carries ``tag`` (every descendant of the script)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if tag.encode() in f.read():
                    found.append(int(pid))
        except OSError:   # gone, or not ours
            continue
    return found


def _check_latency(r: dict) -> None:
    assert _positive(r["p50_ms"], r["p99_ms"], r["max_ms"]), r
    assert r["p50_ms"] <= r["p99_ms"] <= r["max_ms"], r


def test_quick_runs_leave_the_committed_results_alone() -> None:
    """--quick writes store_scale.quick.json unless --out says otherwise (in a child: the
    script puts benchmarks/ on sys.path when imported)."""
    code = (f"import sys; sys.path.insert(0, {str(SCRIPT.parent)!r}); import store_scale\n"
            "for argv in ([], ['--quick'], ['--quick', '--out', 'x.json']):\n"
            "    print(store_scale.parse_args(argv).out)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    results = SCRIPT.parent / "results"
    assert res.stdout.splitlines() == [str(results / "store_scale.json"),
                                       str(results / "store_scale.quick.json"), "x.json"]


@pytest.mark.slow
def test_quick_run_reports_every_section(tmp_path: Path) -> None:
    out = tmp_path / "store_scale.json"
    tag = f"store-scale-test-{uuid.uuid4().hex}"
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
                         capture_output=True, text=True, timeout=180,
                         env={**os.environ, "MC_STORE_SCALE_TEST": tag})
    assert res.returncode == 0, res.stderr[-4000:]
    assert not _tagged_processes(tag), "store_scale.py left processes running"
    doc = json.loads(out.read_text())
    raw = doc["raw"]
    assert doc["params"]["quick"] and doc["cpus"] == os.cpu_count()

    md = raw["metadata"]
    assert md["objects"] >= doc["params"]["objects"] == 5000
    assert _positive(md["rss_empty"], md["rss_full"], md["bytes_per_object"], md["projected_rss_100M"])
    assert md["rss_full"] > md["rss_empty"]
    assert {(r["op"], r["batch"]) for r in md["rpc"]} == RPC_OPS
    for r in md["rpc"]:
        assert _positive(r["calls_per_s"], r["keys_per_s"], r["master_cpu"]) and r["failed"] == 0, r
        assert r["keys"] == r["calls"] * r["batch"], r
        _check_latency(r)

    ev = raw["eviction"]
    assert ev["below_watermark"]["evicted"] == 0 < ev["evicting"]["evicted"]
    for phase in (ev["below_watermark"], ev["evicting"]):
        assert _positive(phase["puts"], phase["puts_per_s"]), phase
        _check_latency(phase)

    configs = raw["scaling"]["configs"]
    assert [(c["holders"], c["clients"]) for c in configs] == [(1, 1), (2, 2)]
    for c in configs:
        for cell in ("put_4KiB", "get_4KiB", "put_4MiB", "get_4MiB"):
            assert _positive(c[f"{cell}_ops"], c[f"{cell}_GBps"]), (cell, c)

    fo = raw["failover"]
    setups = {"file": doc["params"]["failover_objects"]}
    if shutil.which("etcd"):
        setups["ha"] = doc["params"]["ha_objects"]
    else:
        assert "skipped" in fo["ha"]
    for setup, objects in setups.items():
        f = fo[setup]
        assert f["objects"] == objects and f["recovered"] >= objects, f
        assert _positive(f["journal_load_s"], f["recovered_per_s"], f["kill_to_ready_s"],
                         f["kill_to_get_s"], f["kill_to_put_s"]), f
        assert f["verified"] == {"checked": doc["params"]["verify_sample"], "missing": 0, "wrong": 0}

    assert {r["section"] for r in doc["rows"]} == {"metadata", "metadata_rpc", "eviction", "scaling",
                                                   "failover"}
    for title in ("### Master metadata", "### Eviction", "### Scaling", "### Failover"):
        assert title in res.stdout
