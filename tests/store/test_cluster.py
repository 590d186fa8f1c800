"""Master and clients as separate processes: data crosses processes, faults are real kills."""

import hashlib
import json
import os
import random
import signal

from helpers import wait_until


def sha(seed, n):
    return hashlib.sha256(random.Random(seed).randbytes(n)).hexdigest()


def test_put_on_one_get_on_others(master_process, nodes):
    _, addr = master_process()
    a, b, c = nodes(addr), nodes(addr), nodes(addr)
    for i, n in enumerate((1, 4096, 1 << 20, (8 << 20) + 3)):
        assert a.ask(f"put k{i} {i} {n}") == "ok"
        assert b.ask(f"get k{i}") == sha(i, n)
        assert c.ask(f"get k{i}") == sha(i, n)
    assert c.ask("exists k0") == "1" and c.ask("exists nope") == "0"
    assert b.ask("get nope").startswith("error ObjectNotFound")
    assert a.ask("put k0 9 10").startswith("error ObjectAlreadyExists")
    assert json.loads(a.ask("stats"))["segments"] == 3


def test_replica_survives_killing_one_holder(master_process, nodes):
    _, addr = master_process("--client_ttl", "1.5")
    holders = [nodes(addr), nodes(addr), nodes(addr)]
    writer = holders[0]
    for i in range(12):
        assert writer.ask(f"put r{i} {i} 65536 2") == "ok"
    victim = holders[1]
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(10)
    # once the master notices (client TTL), every object still has a readable replica
    assert wait_until(lambda: json.loads(writer.ask("stats"))["clients"] == 2, 15)
    for i in range(12):
        assert holders[2].ask(f"get r{i}") == sha(i, 65536)
    # and before the master notices, readers fall back to the surviving replica as well
    reader = nodes(addr)
    for i in range(12, 16):
        assert writer.ask(f"put r{i} {i} 65536 2") == "ok"
    os.kill(holders[2].proc.pid, signal.SIGKILL)
    holders[2].proc.wait(10)
    for i in range(12, 16):
        reply = reader.ask(f"get r{i}")
        assert reply == sha(i, 65536), reply


def test_eviction_under_pressure_never_returns_bad_data(master_process, nodes):
    _, addr = master_process("--eviction_ratio", "0.2")
    a = nodes(addr, "--segment", str(4 << 20))
    b = nodes(addr, "--segment", str(4 << 20))
    n = 256 << 10
    for i in range(80):  # 20 MiB into 8 MiB of pool
        assert a.ask(f"put e{i} {i} {n}") == "ok"
    hits = 0
    for i in range(80):
        reply = b.ask(f"get e{i}")
        if reply.startswith("error"):
            assert reply.startswith("error ObjectNotFound"), reply
        else:
            assert reply == sha(i, n)
            hits += 1
    assert 0 < hits < 80
    stats = json.loads(a.ask("stats"))
    assert stats["evicted"] >= 80 - hits and stats["used_bytes"] <= stats["capacity_bytes"]


def test_client_leaving_unmounts_its_segment(master_process, nodes):
    _, addr = master_process()
    a, b = nodes(addr), nodes(addr)
    assert b.ask("put k 1 1000") == "ok"
    stats = json.loads(a.ask("stats"))
    b.close()
    assert wait_until(lambda: json.loads(a.ask("stats"))["segments"] == stats["segments"] - 1, 10)
