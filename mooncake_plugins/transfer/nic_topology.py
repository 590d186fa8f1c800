"""Which RDMA NIC serves which memory: NICs, NUMA nodes and GPUs of this host, from sysfs.

Each memory location gets its NICs in two ranks, as the original's ``get_local_topology``
reports them: ``cpu:N`` prefers the NICs on NUMA node N; ``cuda:N`` prefers the NICs
nearest the GPU on the PCI tree (fewest hops between their sysfs device paths); every
other NIC is a fallback. A NIC whose NUMA node the kernel does not know (``numa_node``
-1, as single-socket machines report) counts as local to every node. Only NICs with an
ACTIVE port are listed.

The sysfs root is a parameter, so tests hand in a directory tree. GPUs are ordered as CUDA
numbers them when a CUDA driver answers (its PCI bus ids), else in PCI order (what
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` gives).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Sequence

log = logging.getLogger(__name__)

_NVIDIA = "0x10de"
_GPU_CLASSES = ("0x0300", "0x0302")   # VGA / 3D controller (class code's top 16 bits)


@dataclass(frozen=True)
class Nic:
    """An RDMA device: its name, PCI device path (resolved), NUMA node, netdevs, ports."""

    name: str
    pci_path: str
    numa_node: int
    netdevs: tuple[str, ...] = ()
    active_ports: tuple[int, ...] = ()


@dataclass(frozen=True)
class Gid:
    """One entry of a port's GID table, as sysfs shows it."""

    index: int
    gid: str            # "0000:0000:0000:0000:0000:ffff:0a00:0001"
    kind: str           # "RoCE v2", "IB/RoCE v1", or "" (an InfiniBand port)
    netdev: str = ""    # the Ethernet device the entry belongs to (RoCE)

    @property
    def ipv4(self) -> str | None:
        """The IPv4 address of an IPv4-mapped GID (``::ffff:a.b.c.d``), else None."""
        words = self.gid.split(":")
        if len(words) != 8 or any(int(w, 16) for w in words[:5]) or int(words[5], 16) != 0xFFFF:
            return None
        return ".".join(str(b) for b in bytes.fromhex(words[6] + words[7]))

    @property
    def link_local(self) -> bool:
        return self.gid.lower().startswith("fe80:")


def port_gids(sysfs: str, device: str, port: int) -> tuple[str, list[Gid]]:
    """The port's link layer (``Ethernet`` or ``InfiniBand``) and its non-empty GIDs."""
    base = os.path.join(sysfs, "class", "infiniband", device, "ports", str(port))
    link = _read(os.path.join(base, "link_layer"), "InfiniBand")
    gids = []
    names = os.listdir(os.path.join(base, "gids")) if os.path.isdir(os.path.join(base, "gids")) \
        else []
    for name in sorted((n for n in names if n.isdigit()), key=int):
        gid = _read(os.path.join(base, "gids", name))
        if not gid or not any(int(w, 16) for w in gid.split(":") if w):
            continue   # an unused slot
        gids.append(Gid(int(name), gid, _read(os.path.join(base, "gid_attrs", "types", name)),
                        _read(os.path.join(base, "gid_attrs", "ndevs", name))))
    return link, gids


def choose_gid(link_layer: str, gids: Sequence[Gid], forced: int | None = None) -> Gid:
    """The GID a queue pair on this port should use.

    ``forced`` (``MC_GID_INDEX``) wins when that entry exists. On InfiniBand, the first
    GID. On RoCE (Ethernet), best first: RoCE v2 with an IPv4 address, RoCE v2 with a
    global IPv6 address, RoCE v2 link-local, then RoCE v1 in the same order: a wrong
    choice here is the most common reason RDMA connections never come up.

    Raises:
        ValueError: no usable GID, or ``forced`` names none.
    """
    if forced is not None:
        for g in gids:
            if g.index == forced:
                return g
        raise ValueError(f"MC_GID_INDEX={forced}: the port has no GID at that index "
                         f"(it has {[g.index for g in gids]})")
    if not gids:
        raise ValueError("the port has no GID (is its link up, does its netdev have an address?)")
    if link_layer != "Ethernet":
        return gids[0]

    def rank(g: Gid) -> tuple[int, int, int]:
        family = 0 if g.ipv4 else (2 if g.link_local else 1)
        return (0 if "v2" in g.kind else 1, family, g.index)

    return min(gids, key=rank)


@dataclass
class NicTopology:
    """NICs, NUMA nodes and GPUs (PCI device paths in CUDA order) of one host."""

    nics: list[Nic] = field(default_factory=list)
    numa_nodes: list[int] = field(default_factory=list)
    gpus: list[str] = field(default_factory=list)

    @classmethod
    def discover(cls, sysfs: str = "/sys", gpu_bus_ids: Sequence[str] | None = None,
                 devices: Sequence[str] | None = None) -> "NicTopology":
        """Read the host's topology under ``sysfs``.

        Args:
            gpu_bus_ids: the GPUs' PCI addresses in CUDA's order (default: asked of the
                CUDA driver when one answers, else every NVIDIA GPU in PCI order).
            devices: only these RDMA devices (the original's ``device_name`` filter).
        """
        topo = cls(numa_nodes=_numa_nodes(sysfs))
        ib = os.path.join(sysfs, "class", "infiniband")
        names = sorted(os.listdir(ib)) if os.path.isdir(ib) else []
        for name in names:
            if devices and name not in devices:
                continue
            nic = _read_nic(ib, name)
            if nic.active_ports:
                topo.nics.append(nic)
            else:
                log.info("RDMA device %s has no ACTIVE port: not used", name)
        if gpu_bus_ids is None:
            gpu_bus_ids = _cuda_bus_ids()
        topo.gpus = _gpu_paths(sysfs, gpu_bus_ids)
        return topo

    def nics_for(self, location: str) -> tuple[list[str], list[str]]:
        """``(preferred, fallback)`` NIC names for memory at ``location`` (``cpu:N``,
        ``cuda:N``, ``cpu`` meaning node 0); unknown locations get every NIC as fallback."""
        kind, _, index = location.partition(":")
        n = int(index) if index.isdigit() else 0
        if kind == "cuda" and n < len(self.gpus):
            gpu = self.gpus[n]
            dist = {nic.name: _pci_distance(nic.pci_path, gpu) for nic in self.nics}
            best = min(dist.values(), default=0)
            preferred = [nic.name for nic in self.nics if dist[nic.name] == best]
        elif kind == "cpu":
            preferred = [nic.name for nic in self.nics if nic.numa_node in (n, -1)]
        else:
            preferred = []
        return preferred, [nic.name for nic in self.nics if nic.name not in preferred]

    def to_json(self) -> str:
        """The original's shape: ``{"cpu:0": [[preferred], [fallback]], "cuda:0": ...}``,
        one entry per NUMA node and per GPU, on every host (empty lists without RDMA NICs:
        ``{"cpu:0": [[], []]}``)."""
        locations = [f"cpu:{n}" for n in self.numa_nodes or [0]] + \
            [f"cuda:{i}" for i in range(len(self.gpus))]
        return json.dumps({loc: [list(p) for p in self.nics_for(loc)] for loc in locations})


def _read(path: str, default: str = "") -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def _numa_nodes(sysfs: str) -> list[int]:
    base = os.path.join(sysfs, "devices", "system", "node")
    try:
        entries = os.listdir(base)
    except OSError:
        return [0]
    nodes = sorted(int(e[4:]) for e in entries if e.startswith("node") and e[4:].isdigit())
    return nodes or [0]


def _read_nic(ib: str, name: str) -> Nic:
    dev = os.path.join(ib, name, "device")
    pci = os.path.realpath(dev)
    try:
        numa = int(_read(os.path.join(dev, "numa_node"), "-1"))
    except ValueError:
        numa = -1
    net = os.path.join(dev, "net")
    netdevs = tuple(sorted(os.listdir(net))) if os.path.isdir(net) else ()
    ports_dir = os.path.join(ib, name, "ports")
    active = []
    for port in sorted(os.listdir(ports_dir)) if os.path.isdir(ports_dir) else []:
        if port.isdigit() and "ACTIVE" in _read(os.path.join(ports_dir, port, "state")):
            active.append(int(port))
    return Nic(name, pci, numa, netdevs, tuple(active))


def _cuda_bus_ids() -> list[str]:
    """The GPUs' PCI addresses in CUDA's order, or [] when no CUDA driver answers here
    (then the sysfs order is used)."""
    from . import cuda

    if not cuda.driver_in_process() or not cuda.available():
        return []
    try:
        return [cuda.device_pci_bus_id(d).lower() for d in range(cuda.device_count())]
    except cuda.CudaError as exc:
        log.info("CUDA could not list its GPUs' PCI addresses (%s): using sysfs order", exc)
        return []


def _gpu_paths(sysfs: str, bus_ids: Sequence[str]) -> list[str]:
    """Resolved sysfs device paths of the GPUs: those named (PCI addresses, in order), or
    every NVIDIA display/3D controller in PCI order."""
    pci = os.path.join(sysfs, "bus", "pci", "devices")
    if bus_ids:
        return [os.path.realpath(os.path.join(pci, _full_bdf(b))) for b in bus_ids]
    out = []
    for bdf in sorted(os.listdir(pci)) if os.path.isdir(pci) else []:
        path = os.path.join(pci, bdf)
        if _read(os.path.join(path, "vendor")) == _NVIDIA and \
                _read(os.path.join(path, "class"))[:6] in _GPU_CLASSES:
            out.append(os.path.realpath(path))
    return out


def _full_bdf(bus_id: str) -> str:
    """``0000:3b:00.0`` from CUDA's ``00000000:3B:00.0`` or a short ``3b:00.0``."""
    parts = bus_id.lower().split(":")
    if len(parts) == 2:
        parts.insert(0, "0000")
    return ":".join([parts[0][-4:].rjust(4, "0")] + parts[1:])


def _pci_distance(a: str, b: str) -> int:
    """Hops between two sysfs device paths through their deepest common bridge."""
    pa, pb = a.strip("/").split("/"), b.strip("/").split("/")
    common = 0
    for x, y in zip(pa, pb):
        if x != y:
            break
        common += 1
    return (len(pa) - common) + (len(pb) - common)
