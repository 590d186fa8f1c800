"""The master's KV events (store/kv_events.py): a real ZMQ subscriber decodes every event a
put, a remove, an eviction, a holder killed -9 and the SSD tier cause; the queue drops
oldest under pressure and says so; a late subscriber catches up through the replay socket.

The wire format checked here is the original master's publisher
(mooncake-store/src/kv_event/kv_event_publisher.cpp): frames (topic, 8-byte big-endian
sequence, msgpack ``[timestamp_ms, [event...], 0]``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Iterator

import msgpack
import pytest
from helpers import wait_until

from mooncake_plugins.store.client import ReplicateConfig, StoreClient
from mooncake_plugins.store.kv_events import END_SEQ, KvEventConfig, KvEventPublisher, seq_hash
from mooncake_plugins.store.master import MasterConfig
from mooncake_plugins.store.server import MasterServer, ServerOptions

zmq = pytest.importorskip("zmq")

# the original's map of a stored and a removed event, legacy names and object key on
STORED_FIELDS = {"event_id", "timestamp", "event_type", "type", "model_name", "block_size",
                 "additional_salt", "lora_name", "tenant_id", "backend_id", "group_id",
                 "medium", "dp_rank", "object_key", "seq_hashes", "block_hashes",
                 "base_block_idx", "parent_hash", "token_ids", "parent_block_hash"}
REMOVED_FIELDS = STORED_FIELDS - {"parent_hash", "token_ids", "parent_block_hash"}
MiB = 1 << 20


class Subscriber:
    """A ZMQ SUB socket on a publisher; keeps every (sequence, event) it read."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.seqs: list[int] = []
        self.events: list[dict] = []

    def read(self, timeout_s: float = 0.1) -> int:
        """Read what arrives within ``timeout_s`` of the last message; how many events."""
        n = 0
        while self.sock.poll(int(timeout_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b"" and len(seq) == 8
            stamp, events, dp_rank = msgpack.unpackb(payload)
            assert isinstance(stamp, int) and dp_rank == 0 and events
            self.seqs.append(int.from_bytes(seq, "big"))
            self.events += events
            n += len(events)
        return n

    def of(self, key: str) -> list[tuple[str, str]]:
        """(event_type, medium) of ``key``'s events, in order."""
        return [(e["event_type"], e["medium"]) for e in self.events if e["object_key"] == key]

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _joined(sub: Subscriber, client: StoreClient) -> None:
    """Wait until the subscription reached the publisher (ZMQ drops what a PUB sends
    before that): put probe objects until one's event arrives."""
    n = 0

    def probe() -> bool:
        nonlocal n
        n += 1
        client.put(f"probe-{n}", b"p")
        return sub.read(0.05) > 0
    assert wait_until(probe, 10)


@pytest.fixture
def evented(tmp_path: Path) -> Iterator[MasterServer]:
    root = tmp_path / "ssd"
    root.mkdir()
    server = MasterServer(
        MasterConfig(client_ttl_s=1.0, enable_offload=True, root_fs_dir=str(root)),
        ServerOptions(rpc_port=0, metrics_port=0, kv_events=KvEventConfig(
            bind_endpoint="tcp://127.0.0.1:*", backend_id="pool-a")))
    server.start()
    yield server
    server.close()


def test_keys_are_read_as_block_hashes_as_the_original_does():
    assert seq_hash("12345") == 12345 and seq_hash("0x1F") == 31 and seq_hash("0Xff") == 255
    assert seq_hash(str((1 << 64) - 1)) == (1 << 64) - 1
    for key in ("", "0x", "plain", "12a", "-1", "+1", " 1", "1_000", str(1 << 64), "0x1g"):
        assert seq_hash(key) is None, key


def test_puts_removes_and_evictions_are_published(evented):
    sub = Subscriber(evented.events.endpoint)
    try:
        with StoreClient(evented.address, global_segment_size=4 * MiB) as c:
            _joined(sub, c)
            c.put("0x1f", b"a" * 100)
            c.put("4242", b"b" * 100)
            c.put("plain", b"c" * 100)
            c.remove("plain")
            big = [f"big-{i}" for i in range(8)]
            for key in big:            # 8 x 1 MiB through a 4 MiB segment: LRU evicts
                c.put(key, os.urandom(MiB))
            assert wait_until(lambda: sub.read() == 0 and any(
                sub.of(k) == [("stored", "cpu"), ("removed", "cpu")] for k in big), 5)
        by_key = {e["object_key"]: e for e in sub.events if e["event_type"] == "stored"}
        hashed = by_key["0x1f"]
        assert set(hashed) == STORED_FIELDS
        assert hashed["seq_hashes"] == [31] and hashed["block_hashes"] == [31]
        assert hashed["type"] == "BlockStored" and hashed["medium"] == "cpu"
        assert hashed["backend_id"] == "pool-a" and hashed["tenant_id"] == "default"
        assert hashed["base_block_idx"] == 0 and hashed["parent_hash"] is None
        assert all(hashed[f] is None for f in ("model_name", "block_size", "lora_name",
                                               "additional_salt", "dp_rank", "group_id"))
        assert by_key["4242"]["seq_hashes"] == [4242]
        assert by_key["plain"]["seq_hashes"] == [] and by_key["plain"]["block_hashes"] == []
        removed = next(e for e in sub.events if e["event_type"] == "removed")
        assert removed["object_key"] == "plain" and set(removed) == REMOVED_FIELDS
        assert removed["type"] == "BlockRemoved" and removed["base_block_idx"] is None
        assert sub.of("plain") == [("stored", "cpu"), ("removed", "cpu")]
        evicted = [k for k in big if sub.of(k) == [("stored", "cpu"), ("removed", "cpu")]]
        kept = [k for k in big if sub.of(k) == [("stored", "cpu")]]
        assert evicted and kept and len(evicted) + len(kept) == len(big), sub.events
        assert evicted == big[:len(evicted)]          # least recently used first
        ids = [e["event_id"] for e in sub.events]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
        assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))  # no gap
        stats = evented.events.stats()
        assert stats["dropped_events"] == 0 and stats["skipped_unparsed_keys"] >= 1
    finally:
        sub.close()


def test_a_holder_killed_and_the_ssd_tier_are_published(evented, nodes, tmp_path):
    """Objects on a holder killed -9 are removed once the master drops its segment; a disk
    replica is a stored event of its own (medium disk), and eviction from memory then
    removes only the memory medium."""
    sub = Subscriber(evented.events.endpoint)
    holder = nodes(evented.address, "--segment", str(8 * MiB))
    try:
        with StoreClient(evented.address, global_segment_size=4 * MiB, enable_ssd_offload=True,
                         ssd_offload_path=str(tmp_path / "ssd")) as c:
            _joined(sub, c)
            with StoreClient(evented.address, global_segment_size=MiB) as plain:
                plain.put("on-holder", b"h" * 1000, ReplicateConfig(
                    preferred_segments=[holder.segment]))   # no disk copy of this one
            os.killpg(holder.proc.pid, signal.SIGKILL)
            holder.proc.wait(10)
            assert wait_until(lambda: sub.read() == 0 and sub.of("on-holder") == [
                ("stored", "cpu"), ("removed", "cpu")], 15), sub.of("on-holder")
            assert not c.exists("on-holder")

            c.put("on-disk", b"d" * 1000)     # the only segment left is c's
            assert wait_until(lambda: sub.read() == 0 and sub.of("on-disk") == [
                ("stored", "cpu"), ("stored", "disk")], 10), sub.of("on-disk")
            for i in range(6):        # 6 MiB through 4: "on-disk" leaves memory, stays on disk
                c.put(f"fill-{i}", os.urandom(MiB))
            assert wait_until(lambda: sub.read() == 0 and sub.of("on-disk") == [
                ("stored", "cpu"), ("stored", "disk"), ("removed", "cpu")], 10), sub.of("on-disk")
            assert c.get("on-disk") == b"d" * 1000
            c.remove("on-disk", force=True)    # (the get above holds a read lease)
            assert wait_until(lambda: sub.read() == 0 and sub.of("on-disk")[-1] == (
                "removed", "disk"), 10), sub.of("on-disk")
    finally:
        sub.close()


def _publisher(**kw) -> KvEventPublisher:
    return KvEventPublisher(KvEventConfig(bind_endpoint="tcp://127.0.0.1:*", backend_id="b",
                                          **kw))


def test_a_full_queue_drops_oldest_counts_them_and_leaves_a_gap():
    """A burst far faster than the sending thread through a queue of 4: what is dropped is
    counted, every event is either published or dropped, and each dropped event is a gap in
    the sequence numbers the subscriber sees."""
    pub = _publisher(queue_capacity=4)
    sub = Subscriber(pub.endpoint)
    try:
        assert wait_until(lambda: (pub.stored("1", "cpu"), sub.read(0.05))[1] > 0, 10)
        sub.read(0.3)                          # the probes still on their way
        last_probe = sub.seqs[-1]
        sub.seqs.clear()
        sub.events.clear()
        before = pub.stats()
        total = 20_000
        for i in range(total):
            pub.stored(str(i), "cpu")
        assert wait_until(lambda: pub.stats()["published_events"] + pub.stats()[
            "dropped_events"] == before["published_events"] + total, 10)
        sub.read(0.3)
        stats = pub.stats()
        dropped = stats["dropped_events"]
        assert dropped > 0, stats
        assert len(sub.events) == total - dropped
        batches = stats["published_batches"] - before["published_batches"]
        assert len(sub.seqs) == batches
        keys = [int(e["object_key"]) for e in sub.events]
        assert keys == sorted(keys) and keys[-1] == total - 1    # oldest dropped, newest kept
        # each batch and each dropped event took a sequence number: the drops are the
        # numbers missing since the last probe
        assert sub.seqs[-1] - last_probe == batches + dropped
        missing = set(range(last_probe + 1, sub.seqs[-1] + 1)) - set(sub.seqs)
        assert len(missing) == dropped
    finally:
        sub.close()
        pub.close()


def test_a_late_subscriber_catches_up_through_the_replay_socket():
    pub = _publisher(replay_endpoint="tcp://127.0.0.1:*", replay_batches=3)
    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)
    req.connect(pub.replay_endpoint)
    try:
        for i in range(5):               # nobody listens: five batches, one event each
            pub.stored(str(i), "cpu")
            assert wait_until(lambda: pub.stats()["published_batches"] == i + 1, 5)
        req.send_multipart((b"", (3).to_bytes(8, "big")))
        got = []
        while True:
            assert req.poll(5000), "no replay answer"
            empty, topic, seq, payload = req.recv_multipart()
            assert empty == b"" and topic == b""
            if seq == END_SEQ:
                assert payload == b""
                break
            _, events, _ = msgpack.unpackb(payload)
            got.append((int.from_bytes(seq, "big"), [e["object_key"] for e in events]))
        assert got == [(3, ["2"]), (4, ["3"]), (5, ["4"])]
        req.send_multipart((b"", b"bad"))      # malformed: ignored, the publisher goes on
        pub.stored("5", "cpu")
        assert wait_until(lambda: pub.stats()["published_batches"] == 6, 5)
        assert not req.poll(200)
    finally:
        req.close(linger=0)
        ctx.term()
        pub.close()


def test_events_need_an_endpoint_and_a_bindable_one():
    from mooncake_plugins.errors import InvalidParams

    with pytest.raises(InvalidParams, match="kv_events_bind_endpoint"):
        KvEventPublisher(KvEventConfig(bind_endpoint="", backend_id="b"))
    with pytest.raises(InvalidParams, match="cannot bind"):
        KvEventPublisher(KvEventConfig(bind_endpoint="tcp://256.1.1.1:1", backend_id="b"))
    pub = _publisher()
    pub.close()
    pub.close()                           # idempotent


def test_the_master_command_publishes_with_the_originals_flags(master_process):
    """``mooncake_master --enable_kv_events --kv_events_bind_endpoint=...`` as the original
    takes them (backend id defaulting to the master's address); the flag alone is refused."""
    import subprocess
    import sys

    from helpers import free_port

    res = subprocess.run([sys.executable, "-m", "mooncake_plugins.cli.master",
                          "--enable_kv_events"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--kv_events_bind_endpoint" in res.stderr
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    _, address = master_process("--enable_kv_events", f"--kv_events_bind_endpoint={endpoint}",
                                "--kv_events_emit_legacy_compat=false")
    sub = Subscriber(endpoint)
    try:
        with StoreClient(address, global_segment_size=MiB) as c:
            _joined(sub, c)
        event = sub.events[0]
        assert event["event_type"] == "stored" and "type" not in event
        assert "block_hashes" not in event and "parent_block_hash" not in event
        assert event["backend_id"] == address      # the master's own address by default
    finally:
        sub.close()
