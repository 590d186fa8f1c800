"""A crashed engine's segment descriptor leaves the metadata service on every backend (etcd
lease, Redis expiry, our HTTP server's TTL); a live one keeps it; a new process publishes
its own."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
from helpers import LineChild, wait_until

from mooncake_plugins.transfer.metadata import MetadataServer, from_url

# This module checks metadata descriptors of crashed engines. CI's MOONCAKE_PUREPYTHON=1
# pass leaves it out (-m 'not control_plane'): the Python fallbacks would carry only its RPC
# frames, which that pass's data-path modules and tests/security/test_master_rpc.py cover.
pytestmark = pytest.mark.control_plane

TTL_S = 4   # renewed every TTL_S / 3: a live engine keeps it unless stalled for seconds
ENGINE = f"""
import json, sys
import mooncake_plugins.transfer.engine as engine
engine.DESCRIPTOR_TTL_S = {TTL_S}
eng = engine.TransferEngine("127.0.0.1", sys.argv[1])
print("READY " + json.dumps({{"segment": eng.segment_name}}), flush=True)
sys.stdin.readline()
eng.close()
"""


@pytest.fixture(params=["etcd", "redis", "http"])
def metadata_url(request: pytest.FixtureRequest) -> str:
    if request.param == "etcd":
        return "etcd://" + request.getfixturevalue("etcd_server").split("://", 1)[1]
    if request.param == "redis":
        return request.getfixturevalue("redis_server")
    return request.getfixturevalue("metadata_server").url


@pytest.mark.slow
def test_crashed_engine_descriptor_expires(metadata_url: str) -> None:
    store = from_url(metadata_url)
    engines: list[LineChild] = []
    try:
        engines.append(LineChild([sys.executable, "-c", ENGINE, metadata_url]))
        published = time.monotonic()                   # it published before saying READY
        key = "mooncake/segments/" + engines[0].info["segment"]
        # renewed while the engine lives: there all along, past the TTL it was put with
        while time.monotonic() < published + TTL_S + 1:
            assert store.get(key) is not None, "a live engine's descriptor went away"
            time.sleep(0.2)
        os.killpg(engines[0].proc.pid, signal.SIGKILL)
        engines[0].proc.wait(10)
        # no longer renewed: the backend drops it (within TTL_S; generous for a loaded machine)
        assert wait_until(lambda: store.get(key) is None, TTL_S + 30, 0.1)
        engines.append(LineChild([sys.executable, "-c", ENGINE, metadata_url]))
        again = "mooncake/segments/" + engines[1].info["segment"]
        assert store.get(again) is not None            # a new process publishes its own
        engines[1].close()                             # a clean close deletes it at once
        assert store.get(again) is None
    finally:
        for e in engines:
            e.close()
        store.close()


def test_leased_keys_come_back_to_a_restarted_metadata_server(metadata_server) -> None:
    store = from_url(metadata_server.url)
    try:
        store.put("mooncake/segments/x", b"descriptor", ttl_s=1)
        port = metadata_server.port
        metadata_server.stop()
        with MetadataServer(port=port) as fresh:   # a master restart: an empty server
            assert wait_until(lambda: fresh.get("mooncake/segments/x") == b"descriptor", 3)
    finally:
        store.close()


def test_put_without_ttl_stays_and_a_bad_ttl_is_refused(metadata_server) -> None:
    store = from_url(metadata_server.url)
    try:
        store.put("plain", b"v", ttl_s=1)
        store.put("plain", b"v")                       # permanent again, and not renewed
        time.sleep(1.3)
        assert store.get("plain") == b"v"
        with pytest.raises(Exception, match="ttl_s"):
            store.put("k", b"v", ttl_s=0.5)
    finally:
        store.close()
