"""Two hosts joined by a veth pair in network namespaces the test creates (root only).

The engines run in different namespaces, so they see each other as different hosts
and talk tcp over the veth link; taking the link down mid-transfer must end in a clean
error on the initiator, not a hang.
"""

import hashlib
import json
import os
import random
import shutil
import subprocess

import pytest
from helpers import skip_or_fail, wait_until

pytestmark = [pytest.mark.netns, pytest.mark.root]

SUBNET = "10.213.{}.{}"


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        skip_or_fail("needs root and iproute2 to create network namespaces")
    tag = f"{os.getpid() % 100000}"
    a, b = f"mca{tag}", f"mcb{tag}"
    third = os.getpid() % 250 + 1
    addr_a, addr_b = SUBNET.format(third, 1), SUBNET.format(third, 2)
    try:
        probe = ip("netns", "add", a, check=False)
        if probe.returncode != 0:
            skip_or_fail(f"the kernel refused a network namespace: {probe.stderr.strip()}")
        ip("netns", "add", b)
        ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        ip("link", "set", f"va{tag}", "netns", a)
        ip("link", "set", f"vb{tag}", "netns", b)
        ip("-n", a, "addr", "add", f"{addr_a}/24", "dev", f"va{tag}")
        ip("-n", b, "addr", "add", f"{addr_b}/24", "dev", f"vb{tag}")
        for ns, dev in ((a, f"va{tag}"), (b, f"vb{tag}")):
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", dev, "up")
        yield {"a": a, "b": b, "addr_a": addr_a, "addr_b": addr_b, "dev_a": f"va{tag}"}
    finally:
        ip("netns", "del", a, check=False)
        ip("netns", "del", b, check=False)


def pattern(seed, n):
    return random.Random(seed).randbytes(n)


def test_transfer_between_namespaces(two_hosts, spawn_peer):
    h = two_hosts
    n = 8 << 20
    target = spawn_peer("--hostname", h["addr_b"], "--nbytes", str(n), "--seed", "21",
                        prefix=["ip", "netns", "exec", h["b"]])
    initiator = spawn_peer("--hostname", h["addr_a"], "--nbytes", str(n), "--seed", "22",
                           prefix=["ip", "netns", "exec", h["a"]])
    assert target.segment == f"{h['addr_b']}:{target.port}"
    assert initiator.ask(f"read {target.segment} {target.address} {n}") == "ok"
    assert initiator.ask("sha") == hashlib.sha256(pattern(21, n)).hexdigest()
    assert initiator.ask("fill 23") == "ok"
    assert initiator.ask(f"write {target.segment} {target.address} {n}") == "ok"
    assert target.ask("sha") == hashlib.sha256(pattern(23, n)).hexdigest()


def test_link_down_mid_transfer_fails_cleanly(two_hosts, spawn_peer):
    h = two_hosts
    n = 64 << 20
    # 40 Mbit/s: 64 MiB takes ~13 s, so the link certainly goes down mid-transfer
    ip("netns", "exec", h["a"], "tc", "qdisc", "add", "dev", h["dev_a"], "root", "tbf",
       "rate", "40mbit", "burst", "64kb", "latency", "400ms")
    target = spawn_peer("--hostname", h["addr_b"], "--nbytes", str(n),
                        prefix=["ip", "netns", "exec", h["b"]])
    initiator = spawn_peer("--hostname", h["addr_a"], "--nbytes", str(n), "--transports", "tcp",
                           prefix=["ip", "netns", "exec", h["a"]],
                           env={"MC_TRANSFER_TIMEOUT": "3", "MC_CONNECT_TIMEOUT": "2"})
    initiator.proc.stdin.write(f"write {target.segment} {target.address} {n}\n".encode())
    initiator.proc.stdin.flush()
    assert wait_until(lambda: json.loads(target.ask("stats"))["bytes_in"] >= 1 << 20, 30)
    ip("-n", h["a"], "link", "set", h["dev_a"], "down")
    reply = initiator.readline(timeout_s=60)
    assert reply.startswith("error TransferError"), reply
