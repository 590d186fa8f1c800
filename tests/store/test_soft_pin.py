"""Soft and hard pins against a live master: what a put asks for, and what eviction spares."""

import pytest

from mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction
from mooncake_plugins.errors import InvalidParams, NoAvailableSpace
from mooncake_plugins.store.client import ReplicateConfig as Config
from mooncake_plugins.store.client import StoreClient

# This module checks soft pins in the master. CI's MOONCAKE_PUREPYTHON=1 pass leaves it out
# (-m 'not control_plane'): the Python fallbacks would carry only its RPC frames, which that
# pass's data-path modules and tests/security/test_master_rpc.py cover.
pytestmark = pytest.mark.control_plane

CHUNK = 200 << 10    # five of them fill the 1 MiB segment past the 95 % watermark


@pytest.fixture
def client(master):
    c = StoreClient(master.address, global_segment_size=1 << 20)
    yield c
    c.close()


def _fill(client, prefix: str, n: int) -> None:
    for i in range(n):
        client.put(f"{prefix}{i}", b"f" * CHUNK)


def test_soft_pinned_objects_are_evicted_last(client):
    client.put("pinned", b"p" * CHUNK, Config(soft_pin_action="enable", soft_pin_ttl_ms=60_000))
    client.put("plain", b"u" * CHUNK)
    _fill(client, "fill", 3)   # the fifth object needs room: the oldest unpinned one goes
    assert client.exists("pinned") and not client.exists("plain")


def test_the_legacy_flag_and_a_zero_ttl(client):
    client.put("legacy", b"p" * CHUNK, Config(with_soft_pin=True))
    client.put("unpinned", b"u" * CHUNK, Config(soft_pin_action="enable", soft_pin_ttl_ms=0))
    _fill(client, "fill", 3)
    assert client.exists("legacy") and not client.exists("unpinned")


def test_upsert_preserves_or_disables_the_pin(client):
    client.put("a", b"a" * CHUNK, Config(soft_pin_action="enable"))
    client.put("b", b"b" * CHUNK, Config(soft_pin_action="enable"))
    client.upsert("a", b"A" * CHUNK)                                   # PRESERVE: still pinned
    client.upsert("b", b"B" * CHUNK, Config(soft_pin_action="disable"))
    _fill(client, "fill", 3)
    assert client.exists("a") and not client.exists("b")


def test_hard_pinned_objects_are_never_evicted(client):
    client.put("hard", b"h" * CHUNK, Config(with_hard_pin=True))
    _fill(client, "fill", 8)   # evicts older fills, never the pinned one
    assert client.get("hard") == b"h" * CHUNK
    assert not client.exists("fill0")
    with pytest.raises(NoAvailableSpace):   # what is left is too small, and nothing may go
        client.put("big", b"b" * (900 << 10), Config(with_hard_pin=True))


@pytest.mark.parametrize("cfg", [
    Config(soft_pin_ttl_ms=1000),                                   # a TTL needs "enable"
    Config(soft_pin_action="disable", soft_pin_ttl_ms=1000),
    Config(soft_pin_action="enable", soft_pin_ttl_ms=25 * 3600 * 1000),   # over the maximum
    Config(soft_pin_action="sometimes"),
], ids=["preserve-ttl", "disable-ttl", "over-max", "bad-action"])
def test_bad_pin_requests_are_refused(client, cfg):
    with pytest.raises(InvalidParams):
        client.put("k", b"v", cfg)
    assert not client.exists("k")


def test_compat_config_and_codes(master):
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 1 << 20, "tcp", "", master.address) == 0
    try:
        cfg = ReplicateConfig()
        assert cfg.soft_pin_action is SoftPinAction.PRESERVE and cfg.soft_pin_ttl_ms is None
        for bad in (-1, 1 << 64, "5"):
            with pytest.raises(TypeError):
                cfg.soft_pin_ttl_ms = bad
        with pytest.raises(TypeError):
            cfg.soft_pin_action = 1
        cfg.soft_pin_ttl_ms = 1000
        assert store.put("k", b"v", cfg) == -600
        cfg.soft_pin_action = SoftPinAction.ENABLE
        assert store.put("k", b"v", cfg) == 0
        assert "soft_pin_action: ENABLE" in str(cfg) and "1000" in str(cfg)
    finally:
        store.close()


def test_a_bool_ttl_is_refused_on_the_wire(client):
    from mooncake_plugins.errors import MooncakeError, ProtocolError
    from mooncake_plugins.store.rpc import validate_args
    from mooncake_plugins.store.server import PUT_CONFIG

    wire = Config(soft_pin_action="enable", soft_pin_ttl_ms=True).to_wire(False)
    with pytest.raises(ProtocolError):
        validate_args({"config": wire}, {"config": PUT_CONFIG}, "put_start")
    for ok in (None, 0, 1000):
        validate_args({"config": {**wire, "soft_pin_ttl_ms": ok}}, {"config": PUT_CONFIG}, "put_start")
    with pytest.raises(MooncakeError):
        client.put("k", b"v", Config(soft_pin_action="enable", soft_pin_ttl_ms=False))
    assert not client.exists("k")
