"""``examples/lmcache_mooncake_plugins.yaml``, loaded by LMCache's own config loader, builds
our connector with every setting it names; a chunk round-trips through it (pool and
sizes made small, the master address pointed at the test store)."""

from __future__ import annotations

from pathlib import Path

from lmcache.v1.config import LMCacheEngineConfig

import lmc
import mooncake_lmcache
from mooncake_lmcache.connector import MooncakePluginsConnector

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "lmcache_mooncake_plugins.yaml"


def test_example_config_builds_our_connector_and_round_trips(store):
    cfg = LMCacheEngineConfig.from_file(str(EXAMPLE))
    assert cfg.remote_storage_plugins == [mooncake_lmcache.PLUGIN_NAME]
    # the scheduler-role alternative the file documents is the URL the package exports
    assert f'remote_url: "{mooncake_lmcache.EXTERNAL_REMOTE_URL}"' in EXAMPLE.read_text()
    cfg.max_local_cpu_size, cfg.chunk_size = 0.05, lmc.CHUNK
    cfg.extra_config["mooncake_plugins.master_server_address"] = store.address
    b = lmc.Backends(cfg)
    try:
        conn = b.remote.connection.getWrappedConnector()
        assert isinstance(conn, MooncakePluginsConnector)
        assert conn.settings.global_segment_size == 0 and conn.settings.io_threads == 4
        obj = b.chunk(3, 0)
        try:
            b.put([lmc.key(0)], [obj])
        finally:
            obj.ref_count_down()
        (got,) = b.remote.batched_get_blocking([lmc.key(0)])
        assert lmc.digest(got) == lmc.expected_digest(3, 0)
        got.ref_count_down()
    finally:
        b.close()
