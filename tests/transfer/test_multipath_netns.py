"""tcp multi-path between two hosts joined by several rate-limited links (network
namespaces and veth pairs this test creates, ``tc tbf`` on the initiator's side; root).

One WRITE uses every link, in proportion to what each delivers, and moves about the sum
of their rates; a link taken down mid-transfer leaves the transfer to the others, which
finish it with every byte equal; the link, brought back up, is used again after its pause.
"""

from __future__ import annotations

import hashlib
import json
import random
import time

import pytest
from helpers import skip_or_fail, wait_until
from links import Links, usable

pytestmark = [pytest.mark.netns, pytest.mark.root, pytest.mark.exclusive]

MIB = 1 << 20
RATE_MBIT = 200                       # each link: 25 MB/s
INITIATOR_ENV = {"MC_WORKERS": "4", "MC_TCP_CONNECTIONS": "4", "MC_TRANSFER_TIMEOUT": "2",
                 "MC_CONNECT_TIMEOUT": "1", "MC_PATH_PAUSE": "1", "MC_RETRIES": "3"}


@pytest.fixture
def links(request):
    why = usable()
    if why:
        skip_or_fail(why)
    with Links(request.param, RATE_MBIT) as made:
        yield made


def pair(links, spawn_peer, nbytes):
    target = spawn_peer("--hostname", links.addr_b[0], "--nbytes", str(nbytes), "--transports",
                        "tcp", "--seed", "5", prefix=links.prefix("b"),
                        env={"MC_TCP_PATHS": ",".join(links.addr_b[1:])})
    initiator = spawn_peer("--hostname", links.addr_a[0], "--nbytes", str(nbytes),
                           "--transports", "tcp", "--seed", "6", prefix=links.prefix("a"),
                           env=INITIATOR_ENV)
    return target, initiator


def per_path(initiator, target, addrs) -> list[int]:
    """Bytes the initiator moved over each of the target's addresses."""
    stats = json.loads(initiator.ask("paths"))
    return [stats.get(f"{a}:{target.port}", {}).get("bytes", 0) for a in addrs]


def start_write(initiator, target, n) -> None:
    initiator.proc.stdin.write(f"write {target.segment} {target.address} {n}\n".encode())
    initiator.proc.stdin.flush()


@pytest.mark.parametrize("links", [2], indirect=True)
def test_one_write_uses_every_link_and_their_sum(links, spawn_peer):
    n = 64 * MIB
    target, initiator = pair(links, spawn_peer, n)
    t0 = time.monotonic()
    assert initiator.ask(f"write {target.segment} {target.address} {n}") == "ok"
    seconds = time.monotonic() - t0
    assert target.ask("sha") == hashlib.sha256(random.Random(6).randbytes(n)).hexdigest()
    used = per_path(initiator, target, links.addr_b)
    assert sum(used) == n and min(used) >= n // 4, f"bytes per link: {used}"
    one_link = RATE_MBIT * 1e6 / 8
    rate = n / seconds
    print(f"2 links of {one_link / 1e6:.0f} MB/s: {rate / 1e6:.1f} MB/s, bytes per link {used}")
    assert rate > 1.4 * one_link, f"{rate / 1e6:.1f} MB/s over 2 links of {one_link / 1e6:.0f}"


@pytest.mark.parametrize("links", [2], indirect=True)
def test_a_link_down_mid_transfer_and_back(links, spawn_peer):
    n = 128 * MIB
    target, initiator = pair(links, spawn_peer, n)
    start_write(initiator, target, n)
    assert wait_until(lambda: json.loads(target.ask("stats"))["bytes_in"] >= 16 * MIB, 30)
    links.down(1)
    reply = initiator.readline(timeout_s=120)
    assert reply == "ok", reply
    assert target.ask("sha") == hashlib.sha256(random.Random(6).randbytes(n)).hexdigest()
    stats = json.loads(initiator.ask("paths"))[f"{links.addr_b[1]}:{target.port}"]
    assert stats["failures"] >= 1, stats
    before = stats["bytes"]
    links.up(1)
    time.sleep(1.5)                      # past MC_PATH_PAUSE
    assert initiator.ask("fill 7") == "ok"
    assert initiator.ask(f"write {target.segment} {target.address} {n}") == "ok"
    assert target.ask("sha") == hashlib.sha256(random.Random(7).randbytes(n)).hexdigest()
    after = json.loads(initiator.ask("paths"))[f"{links.addr_b[1]}:{target.port}"]["bytes"]
    assert after > before, "the link that came back is used again"
