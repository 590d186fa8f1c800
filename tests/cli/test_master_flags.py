"""``mooncake_master`` takes every flag of the original, in gflags' spellings."""

import argparse
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from helpers import free_port, skip_or_fail, spawn_ready, terminate_group

from mooncake_plugins.cli._args import port
from mooncake_plugins.cli.master import _INERT, _bool, parse_args

# Every flag the original 0.3.13 mooncake_master lists in --helpfull.
ORIGINAL_FLAGS = """
allocation_strategy allow_evict_soft_pinned_objects batch_oplog_retry_timeout_sec client_ttl
cluster_id config_path cxl_path cxl_size default_kv_lease_ttl default_kv_soft_pin_ttl
dynamic_replication_admission_qps_threshold dynamic_replication_heat_window_seconds
dynamic_replication_max_memory_replicas dynamic_replication_mode enable_cxl
enable_disk_eviction enable_ha enable_http_metadata_server enable_kv_events
enable_metadata_cleanup_on_timeout enable_metric_reporting enable_multi_tenants
enable_offload enable_oplog enable_snapshot enable_snapshot_restore etcd_endpoints
eviction_high_watermark_ratio eviction_ratio global_file_segment_size ha_backend_connstring
ha_backend_type http_metadata_server_host http_metadata_server_port kv_events_additional_salt
kv_events_backend_id kv_events_bind_endpoint kv_events_block_size kv_events_dp_rank
kv_events_emit_legacy_compat kv_events_emit_object_key kv_events_lora_name
kv_events_model_name kv_events_queue_capacity kv_events_tenant_id max_kv_soft_pin_ttl
max_retry_attempts max_threads max_total_finished_tasks max_total_pending_tasks
max_total_processing_tasks memory_allocator metrics_host metrics_port
nof_eviction_high_watermark_ratio nof_eviction_ratio nof_heartbeat_failures_threshold
nof_heartbeat_interval_sec nof_heartbeat_probe_timeout_ms offload_cap_ratio
offload_force_evict offload_on_evict offloading_queue_limit oplog_batch_max_entries
oplog_poll_interval_ms pending_task_timeout_sec pod_name pod_namespace port
processing_task_timeout_sec promotion_admission_threshold promotion_max_per_heartbeat
promotion_on_hit promotion_queue_limit put_start_discard_timeout_sec
put_start_release_timeout_sec quota_bytes root_fs_dir rpc_address rpc_conn_timeout_seconds
rpc_enable_tcp_no_delay rpc_interface rpc_port rpc_thread_num snapshot_backup_dir
snapshot_catalog_backend_connstring snapshot_catalog_backend_type
snapshot_catalog_store_connstring snapshot_catalog_store_type snapshot_child_timeout_seconds
snapshot_interval_seconds snapshot_object_store_type snapshot_payload_backend_type
snapshot_payload_store_type snapshot_retention_count tenant_quota_connector_type
tenant_quota_connector_uri mmap_arena_pool_size use_mmap_arena_allocator flagfile fromenv
tryfromenv undefok tab_completion_columns tab_completion_word help helpfull helpmatch helpon
helppackage helpshort helpxml version alsologtoemail alsologtostderr colorlogtostderr
drop_log_memory log_backtrace_at log_dir log_link log_prefix logbuflevel logbufsecs
logemaillevel logfile_mode logmailer logtostderr max_log_size minloglevel stderrthreshold
stop_logging_if_full_disk symbolize_stacktrace v vmodule
""".split()

_SPECIAL = {"help", "helpfull", "helpmatch", "helpon", "helppackage", "helpshort", "helpxml",
            "version", "flagfile", "fromenv", "tryfromenv", "config_path", "root_fs_dir"}
_VALUES = {"allocation_strategy": "local_first", "ha_backend_type": "etcd",
           "default_kv_lease_ttl": "5s", "default_kv_soft_pin_ttl": "2m",
           "max_kv_soft_pin_ttl": "1h", "eviction_high_watermark_ratio": "0.9",
           "eviction_ratio": "0.1", "client_ttl": "3", "kv_events_queue_capacity": "8"}


def _arg(parser_types: dict, name: str) -> str:
    kind = parser_types[name]
    if kind is _bool:
        return f"--{name}"
    value = _VALUES.get(name, {int: "3", float: "0.5", port: "3"}.get(kind, "x"))
    return f"--{name}={value}"


def test_every_original_flag_is_accepted():
    from mooncake_plugins.cli.master import build_parser

    types = {a.dest: a.type for a in build_parser()._actions}
    missing = [n for n in ORIGINAL_FLAGS if n not in types]
    assert not missing
    ns = parse_args([_arg(types, n) for n in ORIGINAL_FLAGS if n not in _SPECIAL])
    assert ns.default_kv_lease_ttl == 5000 and ns.default_kv_soft_pin_ttl == 120_000
    assert ns.max_kv_soft_pin_ttl == 3_600_000 and ns.enable_cxl is True and ns.max_threads == 3


@pytest.mark.parametrize("argv, name, value", [
    (["-rpc_port=7"], "rpc_port", 7),
    (["--rpc_port", "7"], "rpc_port", 7),
    (["--rpc_port=7"], "rpc_port", 7),
    (["--enable_ha"], "enable_ha", True),
    (["-enable_ha=true"], "enable_ha", True),
    (["--enable_ha=false"], "enable_ha", False),
    (["--noenable_metric_reporting"], "enable_metric_reporting", False),
    (["--undefok=made_up,other", "--made_up=1"], "undefok", "made_up,other"),
])
def test_gflags_spellings(argv, name, value):
    assert getattr(parse_args(argv), name) == value


def test_flag_sources(tmp_path, monkeypatch):
    flagfile = tmp_path / "flags"
    flagfile.write_text("# comment\n--cluster_id=from_file\n-eviction_ratio=0.2\n")
    assert parse_args([f"--flagfile={flagfile}", "--eviction_ratio=0.3"]).eviction_ratio == 0.3
    assert parse_args([f"--flagfile={flagfile}"]).cluster_id == "from_file"
    monkeypatch.setenv("FLAGS_cluster_id", "from_env")
    assert parse_args(["--fromenv=cluster_id"]).cluster_id == "from_env"
    assert parse_args(["--tryfromenv=cluster_id,client_ttl"]).cluster_id == "from_env"
    with pytest.raises(SystemExit):
        parse_args(["--fromenv=client_ttl"])
    config = tmp_path / "master.json"
    config.write_text(json.dumps({"cluster_id": "from_json", "enable_ha": True, "client_ttl": 3}))
    ns = parse_args([f"--config_path={config}", "--client_ttl=4"])
    assert (ns.cluster_id, ns.enable_ha, ns.client_ttl) == ("from_json", True, 4.0)
    config.write_text(json.dumps({"no_such_flag": 1}))
    with pytest.raises(SystemExit):
        parse_args([f"--config_path={config}"])


def test_every_inert_flag_has_a_reason():
    assert all(reason for _, reason in _INERT.values())
    assert not set(_INERT) - set(ORIGINAL_FLAGS)


def console_script(name: str) -> str:
    """The installed console script ``name``: beside this interpreter (a venv that is not
    activated), else on PATH; skips (fails under MOONCAKE_CI=1) when it is not installed."""
    beside = Path(sys.executable).parent / name
    path = str(beside) if os.access(beside, os.X_OK) else shutil.which(name)
    if path is None:
        skip_or_fail(f"console script {name} is not installed (pip install -e .)")
    return path


@pytest.mark.parametrize("exe", ["mooncake_master", "mooncake-master"])
def test_version(exe):
    path = console_script(exe)
    res = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "version" in res.stdout


def test_runs_as_the_original_test_starts_it(tmp_path):
    """test_cli's command line: the master serves, says which flags have no effect, and why."""
    port, mport = free_port(), free_port()
    with open(tmp_path / "err", "w+b") as err:
        proc = subprocess.Popen([sys.executable, "-m", "mooncake_plugins.cli.master", f"--port={port}",
                                 "--max_threads=2", f"--metrics_port={mport}", "--enable_cxl"],
                                stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        try:
            assert proc.stdout.readline() == f"READY {port}\n".encode()
            with urllib.request.urlopen(f"http://127.0.0.1:{mport}/health", timeout=5) as r:
                assert r.read() == b"OK"
        finally:
            assert terminate_group(proc) == 0
        err.seek(0)
        inert = [ln for ln in err.read().decode().splitlines() if "has no effect here" in ln]
    assert len(inert) == 2
    assert inert[0].startswith("mooncake-master: --enable_cxl has no effect here: CXL")
    assert inert[1].startswith("mooncake-master: --max_threads has no effect here: the RPC server")


def test_root_fs_dir_alone_keeps_every_put_on_disk(tmp_path):
    """The original's persistence: clients write puts under the master's root_fs_dir."""
    from mooncake_plugins.store import offload
    from mooncake_plugins.store.client import StoreClient

    proc, port = spawn_ready([sys.executable, "-m", "mooncake_plugins.cli.master", "--rpc_port=0",
                              "--metrics_port=0", f"--root_fs_dir={tmp_path}"], timeout_s=30)
    try:
        with StoreClient(f"127.0.0.1:{port}", global_segment_size=1 << 20) as c:
            c.put("kept", b"k" * 300_000)
            c.flush_offload()
            assert (tmp_path / offload.relative_name("kept")).exists()
            for i in range(4):              # evicts "kept" from memory
                c.put(f"f{i}", b"f" * 300_000)
            _, memory, disk = c.replicas(["kept"])[0]
            assert not memory and disk is not None
            assert c.get("kept") == b"k" * 300_000
            c.remove("kept", force=True)
        assert not (tmp_path / offload.relative_name("kept")).exists()
    finally:
        terminate_group(proc)


def test_restored_client_grace_reaches_the_master_config(capsys) -> None:
    assert parse_args(["--restored_client_grace=45"]).restored_client_grace == 45.0
    with pytest.raises(SystemExit) as refused:
        parse_args(["--restored_client_grace=-1", "--rpc_port=0"])
    assert refused.value.code == 2
    assert "argument --restored_client_grace: expected seconds >= 0" in capsys.readouterr().err


def _help(capsys, flag: str) -> str:
    with pytest.raises(SystemExit) as done:
        parse_args([flag])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_help_is_short_and_lists_the_flags_that_work(capsys) -> None:
    from mooncake_plugins.cli.master import build_parser

    out = _help(capsys, "--help")
    assert len(out.splitlines()) < 150
    working = [a.option_strings[0] for a in build_parser()._actions
               if a.dest not in _INERT and a.help != argparse.SUPPRESS]
    assert "--eviction_ratio" in working and "--metrics_port" in working
    assert all(flag in out for flag in working)
    assert "--enable_cxl" not in out and "no effect here:" not in out
    assert f"--helpfull also lists the {len(_INERT)} flags of the original" in out


def test_helpfull_lists_the_flags_without_effect(capsys) -> None:
    out = _help(capsys, "--helpfull")
    assert all(f"--{name}" in out for name in _INERT)
    assert "flags of the original without effect here" in out and "--rpc_port" in out
    assert "no effect here: CXL" in out.split("--enable_cxl", 1)[1].split("--", 1)[0]
