"""NIC topology from hand-made sysfs trees: two NUMA nodes, four RDMA NICs (and one whose
port is down), two GPUs, laid out as the kernel lays out /sys."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mooncake.engine import TransferEngine
from mooncake_plugins.config import gid_index
from mooncake_plugins.transfer.nic_topology import NicTopology, choose_gid, port_gids

#       name      PCI path under devices/                       NUMA  port state
NICS = [("mlx5_0", "pci0000:00/0000:00:01.0/0000:01:00.0", 0, "4: ACTIVE"),
        ("mlx5_1", "pci0000:00/0000:00:03.0/0000:03:00.0", 0, "4: ACTIVE"),
        ("mlx5_2", "pci0000:80/0000:80:01.0/0000:81:00.0", 1, "4: ACTIVE"),
        ("mlx5_3", "pci0000:80/0000:80:03.0/0000:83:00.0", 1, "4: ACTIVE"),
        ("mlx5_4", "pci0000:80/0000:80:03.0/0000:84:00.0", 1, "1: DOWN")]
GPUS = ["pci0000:00/0000:00:01.0/0000:02:00.0", "pci0000:80/0000:80:01.0/0000:82:00.0"]


def pci_device(root: Path, path: str, numa: int, vendor: str, cls: str) -> Path:
    dev = root / "devices" / path
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text(f"{numa}\n")
    (dev / "vendor").write_text(f"{vendor}\n")
    (dev / "class").write_text(f"{cls}\n")
    bus = root / "bus" / "pci" / "devices"
    bus.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(dev, bus), bus / path.rsplit("/", 1)[1])
    return dev


def sysfs_tree(root: Path, nics=NICS, gpus=GPUS, nodes=(0, 1)) -> Path:
    for n in nodes:
        (root / "devices" / "system" / "node" / f"node{n}").mkdir(parents=True)
    (root / "class" / "infiniband").mkdir(parents=True)
    for i, (name, path, numa, state) in enumerate(nics):
        dev = pci_device(root, path, numa, "0x15b3", "0x020700")
        (dev / "net" / f"eth{i}").mkdir(parents=True)
        ibdev = dev / "infiniband" / name
        (ibdev / "ports" / "1").mkdir(parents=True)
        (ibdev / "ports" / "1" / "state").write_text(state + "\n")
        os.symlink("../..", ibdev / "device")
        os.symlink(os.path.relpath(ibdev, root / "class" / "infiniband"),
                   root / "class" / "infiniband" / name)
    for i, path in enumerate(gpus):
        pci_device(root, path, 0 if "0000:00" in path else 1, "0x10de", "0x030200")
    pci_device(root, "pci0000:00/0000:00:05.0", 0, "0x8086", "0x060000")  # a bridge
    return root


def test_each_location_prefers_its_numa_node_or_nearest_nics(tmp_path):
    topo = NicTopology.discover(str(sysfs_tree(tmp_path)), gpu_bus_ids=None)
    assert [n.name for n in topo.nics] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"], \
        "a NIC without an ACTIVE port is left out"
    assert topo.nics[0].netdevs == ("eth0",) and topo.nics[0].active_ports == (1,)
    assert json.loads(topo.to_json()) == {
        "cpu:0": [["mlx5_0", "mlx5_1"], ["mlx5_2", "mlx5_3"]],
        "cpu:1": [["mlx5_2", "mlx5_3"], ["mlx5_0", "mlx5_1"]],
        "cuda:0": [["mlx5_0"], ["mlx5_1", "mlx5_2", "mlx5_3"]],   # same switch as 02:00.0
        "cuda:1": [["mlx5_2"], ["mlx5_0", "mlx5_1", "mlx5_3"]],
    }


def test_cuda_order_and_device_filter(tmp_path):
    root = str(sysfs_tree(tmp_path))
    # CUDA may number the GPUs otherwise than PCI order: its bus ids decide
    topo = NicTopology.discover(root, gpu_bus_ids=["00000000:82:00.0", "0000:02:00.0"])
    assert topo.nics_for("cuda:0") == (["mlx5_2"], ["mlx5_0", "mlx5_1", "mlx5_3"])
    assert topo.nics_for("cuda:1")[0] == ["mlx5_0"]
    only = NicTopology.discover(root, gpu_bus_ids=[], devices=["mlx5_1", "mlx5_3"])
    assert json.loads(only.to_json())["cpu:0"] == [["mlx5_1"], ["mlx5_3"]]
    assert only.nics_for("host-bogus") == ([], ["mlx5_1", "mlx5_3"])


def test_unknown_numa_counts_as_local_and_no_nic_gives_empty_lists(tmp_path):
    nics = [("rxe0", "pci0000:00/0000:00:02.0", -1, "4: ACTIVE"),
            ("mlx5_0", "pci0000:80/0000:80:01.0/0000:81:00.0", 1, "4: ACTIVE")]
    topo = NicTopology.discover(str(sysfs_tree(tmp_path / "a", nics=nics, gpus=[])),
                                gpu_bus_ids=[])
    assert topo.nics_for("cpu:0") == (["rxe0"], ["mlx5_0"])
    assert topo.nics_for("cpu:1") == (["mlx5_0", "rxe0"], [])   # in name order
    # without NICs, the original's shape still: every location, with empty lists
    empty = NicTopology.discover(str(sysfs_tree(tmp_path / "b", nics=[])),
                                 gpu_bus_ids=None)
    assert empty.nics == [] and json.loads(empty.to_json()) == {
        "cpu:0": [[], []], "cpu:1": [[], []], "cuda:0": [[], []], "cuda:1": [[], []]}
    nothing = NicTopology.discover(str(tmp_path / "nothing"), gpu_bus_ids=[])
    assert json.loads(nothing.to_json()) == {"cpu:0": [[], []]}


def test_the_drop_in_reports_this_hosts_topology(monkeypatch, tmp_path):
    e = TransferEngine()
    try:
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        # this machine: no RDMA NIC, so every NUMA node's lists are empty, as the original's
        if not os.path.isdir("/sys/class/infiniband"):
            here = json.loads(e.get_local_topology())
            assert "cpu:0" in here and all(v == [[], []] for v in here.values()), here
        root = str(sysfs_tree(tmp_path))
        import mooncake_plugins.compat.engine as compat_engine

        monkeypatch.setattr(compat_engine, "SYSFS", root)
        got = json.loads(e.get_local_topology("mlx5_2,mlx5_3"))
        assert got["cpu:1"] == [["mlx5_2", "mlx5_3"], []]
    finally:
        e.close()


@pytest.mark.parametrize("bus_id,want", [("00000000:3B:00.0", "0000:3b:00.0"),
                                         ("3b:00.0", "0000:3b:00.0")])
def test_cuda_bus_ids_name_sysfs_entries(bus_id, want):
    from mooncake_plugins.transfer.nic_topology import _full_bdf

    assert _full_bdf(bus_id) == want


def gid_port(root: Path, link: str, entries: list[tuple[int, str, str, str]]) -> Path:
    """A port of device mlx5_0 with GID table ``entries`` of (index, gid, type, netdev)."""
    port = root / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    for sub in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
        (port / sub).mkdir(parents=True, exist_ok=True)
    (port / "link_layer").write_text(link + "\n")
    for i in range(8):   # the kernel shows every slot; unused ones are all zero
        (port / "gids" / str(i)).write_text("0000:0000:0000:0000:0000:0000:0000:0000\n")
    for index, gid, kind, ndev in entries:
        (port / "gids" / str(index)).write_text(gid + "\n")
        (port / "gid_attrs" / "types" / str(index)).write_text(kind + "\n")
        (port / "gid_attrs" / "ndevs" / str(index)).write_text(ndev + "\n")
    return port


ROCE = [(0, "fe80:0000:0000:0000:0a00:27ff:fe00:0001", "IB/RoCE v1", "eth0"),
        (1, "fe80:0000:0000:0000:0a00:27ff:fe00:0001", "RoCE v2", "eth0"),
        (2, "0000:0000:0000:0000:0000:ffff:0a00:0001", "IB/RoCE v1", "eth0"),
        (3, "0000:0000:0000:0000:0000:ffff:0a00:0001", "RoCE v2", "eth0"),
        (5, "2001:0db8:0000:0000:0000:0000:0000:0007", "RoCE v2", "eth0")]


def test_roce_prefers_v2_with_an_ipv4_address(tmp_path):
    gid_port(tmp_path, "Ethernet", ROCE)
    link, gids = port_gids(str(tmp_path), "mlx5_0", 1)
    assert link == "Ethernet" and [g.index for g in gids] == [0, 1, 2, 3, 5], \
        "all-zero slots are not GIDs"
    best = choose_gid(link, gids)
    assert (best.index, best.ipv4, best.netdev) == (3, "10.0.0.1", "eth0")
    # without the IPv4 one: the global IPv6 v2 entry, then v2 link-local, then v1
    assert choose_gid(link, [g for g in gids if g.index != 3]).index == 5
    assert choose_gid(link, [g for g in gids if g.index in (0, 1, 2)]).index == 1
    assert choose_gid(link, [g for g in gids if g.index in (0, 2)]).index == 2
    assert choose_gid(link, gids, forced=0).index == 0   # MC_GID_INDEX wins
    with pytest.raises(ValueError, match="MC_GID_INDEX=4: the port has no GID at that index"):
        choose_gid(link, gids, forced=4)


def test_infiniband_takes_the_first_gid_and_an_empty_table_is_an_error(tmp_path):
    gid_port(tmp_path, "InfiniBand", [(0, "fe80:0000:0000:0000:0002:c903:0001:2345", "", "")])
    link, gids = port_gids(str(tmp_path), "mlx5_0", 1)
    assert link == "InfiniBand" and choose_gid(link, gids).index == 0
    assert gids[0].ipv4 is None
    with pytest.raises(ValueError, match="the port has no GID"):
        choose_gid("Ethernet", [])


@pytest.mark.parametrize("raw,want", [("", None), ("-1", None), ("3", 3)])
def test_gid_index_from_the_environment(raw, want):
    assert gid_index({"MC_GID_INDEX": raw}) == want


def test_a_bad_gid_index_names_the_variable():
    with pytest.raises(ValueError, match="MC_GID_INDEX='x' is not an integer"):
        gid_index({"MC_GID_INDEX": "x"})
    with pytest.raises(ValueError, match="MC_GID_INDEX=-2"):
        gid_index({"MC_GID_INDEX": "-2"})
