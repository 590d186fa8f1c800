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
    with pytest.raises(ValueError, match="protocol 'efa'"):
        sglang_settings({"protocol": "efa"})
    assert sglang_settings({"protocol": "rdma"}).protocol == "rdma"


class _FakeFactory:
    """Stands in for SGLang's ``StorageBackendFactory`` (its registry and register call)."""

    def __init__(self) -> None:
        self._registry = {"mooncake": {"module_path": "sglang.srt.mem_cache.storage.mooncake_store"
                                                      ".mooncake_store",
                                       "class_name": "MooncakeStore"}}
        self.calls: list[tuple[str, str, str]] = []

    def register_backend(self, name: str, module_path: str, class_name: str) -> None:
        self.calls.append((name, module_path, class_name))
        self._registry[name] = {"module_path": module_path, "class_name": class_name}


@pytest.fixture
def fake_sglang(monkeypatch: pytest.MonkeyPatch) -> _FakeFactory:
    """SGLang's backend factory module, faked in ``sys.modules`` (SGLang need not be
    installed); the factory records what :func:`mooncake_sglang.register` registers."""
    import sys
    import types

    factory = _FakeFactory()
    name = "sglang.srt.mem_cache.storage.backend_factory"
    module = types.ModuleType(name)
    module.StorageBackendFactory = factory  # type: ignore[attr-defined]
    parts = name.split(".")
    for i in range(1, len(parts)):  # parent packages, so the import statement resolves
        parent = ".".join(parts[:i])
        if parent not in sys.modules:
            pkg = types.ModuleType(parent)
            pkg.__path__ = []  # type: ignore[attr-defined]
            monkeypatch.setitem(sys.modules, parent, pkg)
    monkeypatch.setitem(sys.modules, name, module)
    return factory


@pytest.mark.parametrize("value", [None, "", "0", "false", "no", "off", "2"])
def test_sglang_entry_point_does_nothing_unless_asked(monkeypatch, fake_sglang, value):
    if value is None:
        monkeypatch.delenv(mooncake_sglang.ENABLE_ENV, raising=False)
    else:
        monkeypatch.setenv(mooncake_sglang.ENABLE_ENV, value)
    before = {k: dict(v) for k, v in fake_sglang._registry.items()}
    mooncake_sglang.register()
    assert fake_sglang.calls == [] and fake_sglang._registry == before  # "mooncake" stays SGLang's


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_sglang_entry_point_registers_ours_as_mooncake_when_asked(monkeypatch, fake_sglang, value):
    monkeypatch.setenv(mooncake_sglang.ENABLE_ENV, value)
    mooncake_sglang.register()
    ours = ("mooncake", mooncake_sglang.MODULE_PATH, mooncake_sglang.CLASS_NAME)
    assert fake_sglang.calls == [ours]
    assert fake_sglang._registry["mooncake"] == {"module_path": "mooncake_sglang.backend",
                                                 "class_name": "MooncakePluginsHiCache"}
    mooncake_sglang.register()  # idempotent: SGLang runs its plugins in each process
    assert fake_sglang.calls == [ours]


def test_sglang_entry_point_is_the_registered_plugin():
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "mooncake_plugins"]
    if not found:
        pytest.skip("the distribution's entry points are not installed here")
    (ep,) = found
    assert ep.value == "mooncake_sglang:register"
