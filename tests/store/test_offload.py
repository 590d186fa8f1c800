"""The SSD tier's trust boundary: the master deletes only files it named under root_fs_dir."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterator

import pytest

from mooncake_plugins.errors import InvalidParams, RpcFailed, StoreTransferFailed
from mooncake_plugins.store import offload
from mooncake_plugins.store import server as server_module
from mooncake_plugins.store.client import ReplicateConfig, StoreClient
from mooncake_plugins.store.master import MasterConfig
from mooncake_plugins.store.rpc import RpcClient
from mooncake_plugins.store.server import MasterServer, ServerOptions


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir()
    return path


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the root that nothing may delete."""
    path = tmp_path / "victim.obj"
    path.write_bytes(b"precious")
    return path


@pytest.fixture
def offload_master(root: Path) -> Iterator[MasterServer]:
    server = MasterServer(MasterConfig(enable_offload=True, root_fs_dir=str(root),
                                       eviction_ratio=0.5), ServerOptions(rpc_port=0))
    server.start()
    yield server
    server.close()


@pytest.fixture
def attacker(offload_master: MasterServer) -> Iterator[RpcClient]:
    """A raw RPC client: whatever a peer on the network can send."""
    rpc = RpcClient("127.0.0.1", offload_master.port, timeout_s=5)
    yield rpc
    rpc.close()


def _plant(root: Path, key: str, data: bytes = b"disk copy") -> Path:
    path = Path(offload.path_for(str(root), key))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_names_are_derived_and_validated(root: Path) -> None:
    name = offload.relative_name("../../etc/passwd\x00")
    assert offload.is_valid_name(name) and name.endswith(".obj") and "/" in name
    assert offload.path_for("/r", "k") == os.path.join("/r", offload.relative_name("k"))
    good = offload.relative_name("k")
    for bad in ["../" + good, "/" + good, good + "\n", good.replace("/", "/../"), "ab/" + "a" * 40
                + ".obj", good[:2] + "/" + good[3:].upper(), "", None, 7]:
        assert not offload.is_valid_name(bad), bad
        with pytest.raises(ValueError):
            offload.resolve(str(root), bad)
        if isinstance(bad, str):
            with pytest.raises(ValueError):
                offload.delete_under(str(root), bad)
    planted = _plant(root, "k")
    assert offload.delete_under(str(root), good) is True and not planted.exists()
    assert offload.delete_under(str(root), good) is False


def test_offload_needs_a_root(tmp_path: Path) -> None:
    with pytest.raises(InvalidParams, match="root_fs_dir"):
        MasterConfig(enable_offload=True).validate()
    with pytest.raises(InvalidParams, match="not a directory"):
        MasterConfig(enable_offload=True, root_fs_dir=str(tmp_path / "missing")).validate()


def test_a_client_cannot_make_the_master_delete_a_file(offload_master: MasterServer,
                                                       attacker: RpcClient, root: Path,
                                                       victim: Path, caplog) -> None:
    with StoreClient(offload_master.address, global_segment_size=1 << 20) as client:
        client.put("k", b"v" * 1000)
        # the old wire form, with a path: refused as a malformed request
        with pytest.raises(RpcFailed):
            attacker.call("add_disk_replica", keys=["k"], paths=[str(victim)])
        assert "add_disk_replica takes exactly ['keys']" in caplog.text
        # keys that look like paths are only hashed into a name under the root
        for key in [str(victim), "../victim.obj", "k"]:
            if key != "k":
                client.put(key, b"x")
            assert attacker.call("add_disk_replica", keys=[key]) == [[0, None]]
        legit = _plant(root, "k", b"d" * 1000)
        # eviction pressure: objects with a disk replica leave memory, the rest go
        for i in range(12):
            client.put(f"fill{i}", os.urandom(200 << 10), ReplicateConfig(replica_num=1))
        assert client.stats()["offloaded_evictions"] > 0
        assert client.get("k") == b"d" * 1000  # read back from the disk replica
        assert client.replicas(["k"])[0][1:] == ([], str(legit))
        legit.write_bytes(b"short")  # a truncated file is an error, never garbage bytes
        with pytest.raises(StoreTransferFailed, match="holds 5 bytes"):
            client.get("k")
        assert client.remove_all(force=True) >= 3
    assert victim.read_bytes() == b"precious"
    assert not legit.exists()  # the master's own name under the root was deleted


def test_symlinks_under_the_root_are_not_followed(offload_master: MasterServer,
                                                  attacker: RpcClient, root: Path,
                                                  victim: Path, tmp_path: Path, caplog) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    with StoreClient(offload_master.address, global_segment_size=1 << 20) as client:
        # a file link: root/xx/<hash>.obj -> victim
        client.put("file-link", b"1")
        link = Path(offload.path_for(str(root), "file-link"))
        link.parent.mkdir(parents=True)
        link.symlink_to(victim)
        # a directory link: root/xx -> outside, holding a file of the right name
        client.put("dir-link", b"2")
        name = offload.relative_name("dir-link")
        (outside / name.split("/")[1]).write_bytes(b"outside")
        (root / name.split("/")[0]).symlink_to(outside, target_is_directory=True)
        assert attacker.call("add_disk_replica", keys=["file-link", "dir-link"]) == [[0, None]] * 2
        with caplog.at_level(logging.ERROR, logger=server_module.__name__):
            assert client.batch_remove(["file-link", "dir-link"], force=True) == [None, None]
    assert victim.read_bytes() == b"precious" and link.is_symlink()
    assert (outside / name.split("/")[1]).read_bytes() == b"outside"
    assert caplog.text.count("not deleting disk replica") == 2


def test_files_are_deleted_outside_the_master_lock(offload_master: MasterServer, root: Path,
                                                   monkeypatch) -> None:
    seen: list[bool] = []
    delete = offload.delete_under

    def spy(directory: str, name: str) -> bool:
        seen.append(offload_master.service._lock.locked())
        return delete(directory, name)

    monkeypatch.setattr(server_module.offload, "delete_under", spy)
    with StoreClient(offload_master.address, global_segment_size=1 << 20) as client:
        for key in ["a", "b"]:
            client.put(key, b"v")
            _plant(root, key)
        rpc = RpcClient("127.0.0.1", offload_master.port)
        try:
            assert rpc.call("add_disk_replica", keys=["a", "b"]) == [[0, None]] * 2
        finally:
            rpc.close()
        client.upsert("a", b"w")  # a new version drops the old disk replica
        client.remove("b", force=True)
    assert seen == [False, False]
    assert not list(root.rglob("*.obj"))


def test_offload_disabled_refuses_disk_replicas(master: MasterServer) -> None:
    rpc = RpcClient("127.0.0.1", master.port)
    try:
        code, message = rpc.call("add_disk_replica", keys=["k"])[0]
        assert code == InvalidParams.code and "enable_offload" in message
    finally:
        rpc.close()
