"""The rdma transport end to end over the libibverbs test double: every scenario of
``rdma_scenarios.py`` in a fresh process, with the double as the process's libibverbs.

The double (``verbs_double.c``) stands in for an RDMA device: it keeps the verbs
objects, checks the queue-pair state machine, GIDs, lkeys and rkeys like a NIC, and
copies with process_vm_readv/writev. It proves the transport's logic, not a NIC's
behaviour or speed: that is ``tests/rdma/run.sh`` on RDMA hardware.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import verbs_double

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def run(name: str, tmp_path: Path, devices: str = "double0,double1", clean: bool = True,
        **extra: str) -> str:
    """Run scenario ``name``; with ``clean``, every object it made must be gone after."""
    env = {**os.environ, **verbs_double.environment(str(tmp_path / "verbs"), devices), **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), str(HERE.parent),
                                         env.get("PYTHONPATH", "")])
    env.pop("MC_TRANSPORTS", None)
    proc = subprocess.run([sys.executable, str(HERE / "rdma_scenarios.py"), name], env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("ok"), out
    left = sorted(os.listdir(tmp_path / "verbs")) if (tmp_path / "verbs").exists() else []
    assert not clean or not left, f"the double's objects were left published: {left}"
    return out


@pytest.mark.parametrize("name", ["roundtrip", "refusals", "revoke", "two_process",
                                  "handshake", "gid_choice", "model"])
def test_scenario(name, tmp_path):
    run(name, tmp_path)


def test_link_down_mid_transfer_is_retried_on_a_new_connection(tmp_path):
    run("link_down", tmp_path, VERBS_DOUBLE_FAIL_AFTER="5")


def test_a_failed_path_is_paused_and_used_again_after(tmp_path):
    run("path_pause", tmp_path, VERBS_DOUBLE_FAIL_AFTER="5")


def test_peer_killed(tmp_path):
    out = run("peer_killed", tmp_path, clean=False)  # the killed peer's objects stay
    assert "dead peer:" in out


def test_no_device_is_one_sentence_and_the_engine_goes_on(tmp_path):
    run("no_device", tmp_path, devices="")
