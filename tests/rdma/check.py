"""What an RDMA machine offers, as our discovery sees it, beside the system's own tools.

Run by tests/rdma/run.sh, before datapath.py (the rdma transport itself). This checks the
groundwork the data path stands on, on real hardware: our device list
(NicTopology: devices with an ACTIVE port) and our verbs binding's (``transfer/verbs.py``:
devices, ports, GID tables, against sysfs) beside ``ibv_devices`` and, where importable,
pyverbs; each port's link layer and the GID our
rules choose (choose_gid) beside its whole GID table; the per-location NIC ranking
(get_local_topology's JSON); and, where the kernel allows, the same on a Soft-RoCE device
made on a veth pair. Writes one JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mooncake_plugins.config import gid_index  # noqa: E402
from mooncake_plugins.transfer.nic_topology import NicTopology, choose_gid, port_gids  # noqa: E402


def run(*cmd: str) -> tuple[int, str]:
    if shutil.which(cmd[0]) is None:
        return 127, f"{cmd[0]} not installed"
    p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    return p.returncode, (p.stdout + p.stderr).strip()


def describe(sysfs: str = "/sys") -> dict:
    """Our view of every RDMA device under ``sysfs``."""
    topo = NicTopology.discover(sysfs)
    ib = os.path.join(sysfs, "class", "infiniband")
    every = sorted(os.listdir(ib)) if os.path.isdir(ib) else []
    out: dict = {"devices_in_sysfs": every, "active": [n.name for n in topo.nics],
                 "topology": json.loads(topo.to_json()), "ports": {}}
    for nic in topo.nics:
        for port in nic.active_ports:
            link, gids = port_gids(sysfs, nic.name, port)
            entry: dict = {"link_layer": link, "netdevs": list(nic.netdevs),
                           "numa_node": nic.numa_node,
                           "gids": [[g.index, g.gid, g.kind, g.netdev] for g in gids]}
            try:
                g = choose_gid(link, gids, gid_index())
                entry["chosen"] = [g.index, g.gid, g.kind, g.netdev, g.ipv4]
            except ValueError as exc:
                entry["chosen"] = f"none: {exc}"
            out["ports"][f"{nic.name}/{port}"] = entry
    return out


def soft_roce() -> dict:
    """Make a Soft-RoCE device on a veth pair in namespaces, describe it, remove it."""
    if os.geteuid() != 0 or shutil.which("rdma") is None or shutil.which("ip") is None:
        return {"tried": False, "why": "needs root, iproute2's rdma and ip"}
    tag = str(os.getpid() % 100000)
    veth, peer = f"rxv{tag}", f"rxp{tag}"
    result: dict = {"tried": True}
    try:
        rc, text = run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
        if rc:
            return {**result, "made": False, "why": text}
        run("ip", "addr", "add", "10.251.0.1/24", "dev", veth)
        run("ip", "link", "set", veth, "up")
        run("ip", "link", "set", peer, "up")
        rc, text = run("rdma", "link", "add", f"rxe{tag}", "type", "rxe", "netdev", veth)
        result["rdma_link_add"] = text or "ok"
        if rc:
            return {**result, "made": False}
        time.sleep(1)
        result["made"] = True
        result["ours"] = describe()
    finally:
        run("rdma", "link", "delete", f"rxe{tag}")
        run("ip", "link", "del", veth)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ours = describe()
    rc, ibv = run("ibv_devices")
    listed = sorted(line.split()[0] for line in ibv.splitlines()[2:] if line.split()) \
        if rc == 0 else None
    from mooncake_plugins.transfer import verbs
    report = {"ours": ours, "verbs": verbs.devices() if verbs.available() else
              verbs.why_unavailable(), "ibv_devices": ibv, "ibv_devices_names": listed,
              "ibv_devinfo": run("ibv_devinfo")[1][:20000]}
    try:
        import pyverbs.device as d
        report["pyverbs_names"] = sorted(x.name.decode() for x in d.get_device_list())
    except Exception as exc:   # not installed, or no library: say which
        report["pyverbs_names"] = f"unavailable: {exc!r}"
    if listed is not None:
        report["same_devices_as_ibv_devices"] = listed == ours["devices_in_sysfs"]
    if verbs.available():   # our verbs binding's view against sysfs: names and GIDs
        report["verbs_names_equal_sysfs"] = sorted(d["name"] for d in report["verbs"]) == \
            ours["devices_in_sysfs"]
        report["verbs_gids_equal_sysfs"] = {
            f"{d['name']}/{p['port']}": [g[1] for g in p.get("gids", [])] ==
            [g[1] for g in ours["ports"].get(f"{d['name']}/{p['port']}", {}).get("gids", [])]
            for d in report["verbs"] for p in d.get("ports", [])}
    report["soft_roce"] = soft_roce()
    Path(a.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("ibv_devices_names", "pyverbs_names", "verbs")},
                     indent=1)[:4000])
    print("ours:", json.dumps(ours, indent=1)[:4000])
    print("soft-RoCE:", json.dumps(report["soft_roce"], indent=1)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
