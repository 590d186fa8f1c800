"""Settings of our LMCache connector and SGLang backend, which need neither framework:
values converted by type, every error naming the key."""

from __future__ import annotations

import pytest

import mooncake_lmcache
import mooncake_sglang
from mooncake_lmcache.config import ConnectorSettings
from mooncake_lmcache.config import from_extra_config as lmcache_settings
from mooncake_sglang.config import BackendSettings
from mooncake_sglang.config import from_extra_config as sglang_settings


def test_lmcache_settings_come_from_prefixed_extra_config_keys():
    extra = mooncake_lmcache.extra_config(master_server_address="10.0.0.1:50051",
                                          global_segment_size="2GB", replica_num="2")
    extra["chunk_size_other_lmcache_key"] = 1  # LMCache's own keys are not ours
    s = lmcache_settings(extra)
    assert (s.master_server_address, s.global_segment_size, s.replica_num) == \
        ("10.0.0.1:50051", 2 << 30, 2)
    assert extra["remote_storage_plugin.mooncake_plugins.class_name"] == \
        "MooncakePluginsConnector"
    assert lmcache_settings(None) == ConnectorSettings()
    with pytest.raises(ValueError, match=r"LMCache extra_config: unknown key "
                                         r"'mooncake_plugins.master'; known keys: .*"
                                         r"mooncake_plugins.master_server_address"):
        lmcache_settings({"mooncake_plugins.master": "h:1"})
    with pytest.raises(ValueError, match=r"\['mooncake_plugins.io_threads'\]: expected an "
                                         r"integer"):
        lmcache_settings({"mooncake_plugins.io_threads": 1.5})
    with pytest.raises(ValueError, match="transfer_timeout_s must be positive"):
        lmcache_settings({"mooncake_plugins.transfer_timeout_s": "0"})


def test_sglang_settings_skip_the_dynamic_loader_keys():
    extra = mooncake_sglang.dynamic_extra_config(master_server_address="h:1",
                                                 global_segment_size="512MB")
    s = sglang_settings(extra)
    assert (s.master_server_address, s.global_segment_size) == ("h:1", 512 << 20)
    assert sglang_settings({}) == BackendSettings()
    with pytest.raises(ValueError, match=r"hicache-storage-backend-extra-config: unknown key "
                                         r"'tenant_id'"):
        sglang_settings({"tenant_id": "x"})
    with pytest.raises(ValueError, match=r"\['global_segment_size'\]: bad size"):
        sglang_settings({"global_segment_size": "lots"})
    with pytest.raises(ValueError, match="protocol 'rdma'"):
        sglang_settings({"protocol": "rdma"})


def test_sglang_entry_point_does_nothing_unless_asked(monkeypatch):
    monkeypatch.delenv(mooncake_sglang.ENABLE_ENV, raising=False)
    mooncake_sglang.register()  # no SGLang import, no registration
