"""mooncake-transfer-bench: a target and an initiator process, figures printed."""

import json
import subprocess
import sys

import pytest
from helpers import spawn_ready, terminate_group

BENCH = [sys.executable, "-m", "mooncake_plugins.cli.bench"]


@pytest.mark.parametrize("protocol,op", [("tcp", "read"), ("shm", "write")])
def test_target_and_initiator(protocol, op):
    target, port = spawn_ready(BENCH + ["--mode", "target", "--protocol", protocol,
                                        "--buffer_size", "16M"], timeout_s=30)
    try:
        out = subprocess.run(BENCH + ["--mode", "initiator", "--segment_id", f"127.0.0.1:{port}",
                                      "--protocol", protocol, "--operation", op,
                                      "--block_size", "64K", "--batch_size", "8", "--threads", "2",
                                      "--duration", "0.5", "--buffer_size", "16M", "--json"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        r = json.loads(out)
        assert r["bytes"] > 0 and r["batches"] * 8 * 65536 == r["bytes"]
        assert r["throughput"] > 0
        assert r["batch_latency_us"]["p50"] <= r["batch_latency_us"]["p99"]
    finally:
        assert terminate_group(target) == 0  # SIGTERM ends the target cleanly


def test_initiator_rejects_oversized_load():
    res = subprocess.run(BENCH + ["--mode", "initiator", "--segment_id", "127.0.0.1:1",
                                  "--block_size", "1M", "--batch_size", "64", "--threads", "4",
                                  "--buffer_size", "16M"], capture_output=True, text=True, timeout=30)
    assert res.returncode != 0 and "buffer_size" in res.stderr
