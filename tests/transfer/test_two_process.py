"""Two engines in two processes: every transport, every metadata backend, real servers."""

import hashlib
import random

import pytest

from mooncake_plugins.config import EngineConfig
from mooncake_plugins.transfer import OpCode, TransferEngine, TransferRequest

NBYTES = (4 << 20) + 4096 * 3


def pattern(seed, n):
    return random.Random(seed).randbytes(n)


def engine(metadata="P2PHANDSHAKE", transports=("shm", "tcp")):
    return TransferEngine("127.0.0.1", metadata, config=EngineConfig(transports=list(transports),
                                                                     slice_nbytes=256 << 10))


@pytest.mark.parametrize("transports,plain", [
    ("tcp", False), ("tcp", True), ("shm,tcp", False), ("shm,tcp", True)],
    ids=["tcp", "tcp-plain", "shm-memfd", "shm-process_vm"])
def test_write_and_read_across_processes(spawn_peer, transports, plain):
    peer = spawn_peer("--nbytes", str(NBYTES), "--seed", "7", *(["--plain"] if plain else []))
    with engine(transports=transports.split(",")) as e:
        local = e.allocate(NBYTES)
        e.read(peer.segment, local.address, peer.address, NBYTES)
        assert bytes(local.view()) == pattern(7, NBYTES)
        local.view()[:] = pattern(8, NBYTES)
        e.write(peer.segment, local.address, peer.address, NBYTES)
        assert peer.ask("sha") == hashlib.sha256(pattern(8, NBYTES)).hexdigest()


def test_peer_initiates_into_us(spawn_peer):
    with engine(transports=["tcp"]) as e:
        mine = e.allocate(1 << 20)
        mine.view()[:] = pattern(3, 1 << 20)
        peer = spawn_peer("--nbytes", str(1 << 20), "--seed", "1")
        assert peer.ask(f"read {e.segment_name} {mine.address} {1 << 20}") == "ok"
        assert peer.ask("sha") == hashlib.sha256(pattern(3, 1 << 20)).hexdigest()
        assert peer.ask(f"write {e.segment_name} {mine.address + 1} {1 << 20}").startswith(
            "error AddressError")


def test_async_batch_interleaved(spawn_peer):
    peer = spawn_peer("--nbytes", str(1 << 20), "--seed", "5")
    with engine(transports=["tcp"]) as e:
        local = e.allocate(1 << 20)
        reqs = [TransferRequest(OpCode.READ, local.address + i * 8192, peer.address + i * 8192, 8192)
                for i in range(128)]
        batches = [e.submit(peer.segment, reqs[i::4]) for i in range(4)]
        for b in batches:
            b.wait(30)
        assert bytes(local.view()) == pattern(5, 1 << 20)


@pytest.fixture(params=["http", "etcd", "redis"])
def metadata_url(request):
    if request.param == "http":
        return request.getfixturevalue("metadata_server").url
    if request.param == "etcd":
        return "etcd://" + request.getfixturevalue("etcd_server").split("://", 1)[1]
    return request.getfixturevalue("redis_server")


def test_metadata_backends(spawn_peer, metadata_url):
    peer = spawn_peer("--metadata", metadata_url, "--nbytes", str(1 << 20), "--seed", "11",
                      "--hostname", "127.0.0.1:0")
    with engine(metadata_url, ["tcp"]) as e:
        local = e.allocate(1 << 20)
        e.read(peer.segment, local.address, peer.address, 1 << 20)
        assert bytes(local.view()) == pattern(11, 1 << 20)
        assert e.open_segment(peer.segment).descriptor.port == peer.port


def test_named_segment_in_metadata_mode(metadata_server):
    url = metadata_server.url
    with TransferEngine("127.0.0.1:0", url, segment_name="prefill-0",
                        config=EngineConfig(transports=["tcp"])) as target, engine(url, ["tcp"]) as e:
        buf = target.allocate(4096)
        buf.view()[:4] = b"abcd"
        into = e.allocate(4096)
        e.read("prefill-0", into.address, buf.address, 4096)
        assert bytes(into.view()[:4]) == b"abcd"
    from mooncake_plugins.transfer.engine import METADATA_PREFIX
    from mooncake_plugins.transfer.metadata import from_url
    store = from_url(url)
    assert store.get(METADATA_PREFIX + "prefill-0") is None  # unpublished on close
    store.close()


def test_shm_maps_a_peer_range_once_per_access_kind(spawn_peer, monkeypatch):
    """A peer's pages are populated (one madvise per slice) on the first read of a range
    and on the first write (which needs them writable), not on every copy again."""
    from mooncake_plugins.transfer import memory

    calls = []
    real = memory.populate
    peer = spawn_peer("--nbytes", str(NBYTES), "--seed", "7")
    with engine(transports=["shm"]) as e:
        local = e.allocate(NBYTES)
        monkeypatch.setattr(memory, "populate",
                            lambda a, n, write: calls.append(write) or real(a, n, write))
        for op, expect in [("read", [False]), ("read", []), ("write", [True]),
                           ("read", []), ("write", [])]:
            calls.clear()
            if op == "read":
                local.view()[:] = bytes(NBYTES)
                e.read(peer.segment, local.address, peer.address, NBYTES)
                assert bytes(local.view()) == pattern(7, NBYTES)
            else:
                e.write(peer.segment, local.address, peer.address, NBYTES)
                assert peer.ask("sha") == hashlib.sha256(pattern(7, NBYTES)).hexdigest()
            assert set(calls) == set(expect) and (not expect or len(calls) >= NBYTES >> 20), \
                f"{op}: populate calls {calls}, expected {expect}"
