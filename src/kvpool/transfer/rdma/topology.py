"""NIC topology: which RDMA NICs sit close to which memory (NUMA node, GPU).

The matrix uses Mooncake's JSON format::

    {"cpu:0": [["mlx5_0", "mlx5_1"], ["mlx5_2", "mlx5_3"]],
     "cuda:0": [["mlx5_0"], ["mlx5_1", "mlx5_2", "mlx5_3"]]}

Each location maps to ``[preferred NICs, available (secondary) NICs]``. Discovery reads sysfs:
``/sys/class/infiniband/<nic>/device`` (PCI path, ``numa_node``), NVIDIA display/3D controllers under
``/sys/bus/pci/devices`` (``cuda:N`` in PCI bus order, as with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``) and
``/sys/devices/system/node``. For a CPU location the preferred NICs are those on its NUMA node; for a
GPU the NICs with the longest common PCIe path (same switch first, then same root port / NUMA node).
A user-supplied matrix (file or JSON string) replaces discovery; an allow-list filters both.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.errors import ConfigError

Matrix = dict[str, list[list[str]]]


@dataclass(frozen=True)
class PciDevice:
    """A NIC or GPU as seen in sysfs."""

    name: str  # NIC name (mlx5_0) or location (cuda:0)
    pci_path: str  # resolved sysfs path, e.g. /sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0
    numa: int  # -1 when unknown


def _numa(devdir: str) -> int:
    try:
        return int(Path(devdir, "numa_node").read_text().strip())
    except (OSError, ValueError):
        return -1


def discover_nics(sysfs: str = "/sys") -> list[PciDevice]:
    """RDMA devices under ``<sysfs>/class/infiniband`` with their PCI path and NUMA node."""
    out = []
    for d in sorted(glob.glob(os.path.join(sysfs, "class", "infiniband", "*"))):
        dev = os.path.join(d, "device")
        path = os.path.realpath(dev) if os.path.exists(dev) else ""
        out.append(PciDevice(os.path.basename(d), path, _numa(dev)))
    return out


def discover_gpus(sysfs: str = "/sys") -> list[PciDevice]:
    """NVIDIA GPUs (PCI class 0x0300xx / 0x0302xx, vendor 0x10de) in PCI bus order as ``cuda:N``."""
    found = []
    for d in sorted(glob.glob(os.path.join(sysfs, "bus", "pci", "devices", "*"))):
        try:
            vendor = Path(d, "vendor").read_text().strip()
            cls = Path(d, "class").read_text().strip()
        except OSError:
            continue
        if vendor == "0x10de" and cls[:6] in ("0x0300", "0x0302"):
            found.append((os.path.basename(d), os.path.realpath(d), _numa(d)))
    return [PciDevice(f"cuda:{i}", path, numa) for i, (_, path, numa) in enumerate(found)]


def numa_nodes(sysfs: str = "/sys") -> list[int]:
    """NUMA node ids (``[0]`` when sysfs has none)."""
    nodes = []
    for d in glob.glob(os.path.join(sysfs, "devices", "system", "node", "node*")):
        tail = os.path.basename(d)[4:]
        if tail.isdigit():
            nodes.append(int(tail))
    return sorted(nodes) or [0]


def _common_depth(a: str, b: str) -> int:
    pa, pb = a.split("/"), b.split("/")
    n = 0
    for x, y in zip(pa, pb, strict=False):
        if x != y:
            break
        n += 1
    return n


def build_matrix(nics: list[PciDevice], gpus: list[PciDevice], nodes: list[int]) -> Matrix:
    """Mooncake-style matrix from discovered devices (see the module docstring)."""
    names = [n.name for n in nics]
    matrix: Matrix = {}
    for node in nodes:
        pref = [n.name for n in nics if n.numa == node or n.numa < 0]
        pref = pref or names
        matrix[f"cpu:{node}"] = [pref, [x for x in names if x not in pref]]
    for g in gpus:
        if not nics:
            matrix[g.name] = [[], []]
            continue
        depth = {
            n.name: _common_depth(g.pci_path, n.pci_path) if g.pci_path and n.pci_path else 0 for n in nics
        }
        best = max(depth.values())
        pref = [x for x in names if depth[x] == best]
        if best <= 3:  # only the sysfs root in common: fall back to the GPU's NUMA node
            pref = [n.name for n in nics if n.numa == g.numa and g.numa >= 0] or names
        matrix[g.name] = [pref, [x for x in names if x not in pref]]
    return matrix


def validate_matrix(obj: Any, where: str = "topology") -> Matrix:
    """Check the JSON shape; raise :class:`ConfigError` naming what is wrong."""
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object of location -> [[preferred], [available]]")
    out: Matrix = {}
    for loc, lists in obj.items():
        if not isinstance(loc, str) or not (loc.startswith("cpu:") or loc.startswith("cuda:")):
            raise ConfigError(f"{where}: location {loc!r} must be 'cpu:N' or 'cuda:N'")
        if (
            not isinstance(lists, list)
            or len(lists) not in (1, 2)
            or not all(isinstance(li, list) and all(isinstance(x, str) for x in li) for li in lists)
        ):
            raise ConfigError(f"{where}: {loc!r} must map to [[preferred NICs], [available NICs]]")
        out[loc] = [list(lists[0]), list(lists[1]) if len(lists) > 1 else []]
    return out


def filter_matrix(matrix: Matrix, allowed: list[str] | None) -> Matrix:
    """Keep only NICs in ``allowed``; a location whose preferred list empties takes its secondaries."""
    if not allowed:
        return matrix
    out: Matrix = {}
    for loc, (pref, avail) in matrix.items():
        p = [x for x in pref if x in allowed]
        a = [x for x in avail if x in allowed]
        out[loc] = [p, a] if p else [a, []]
    return out


def load_matrix(
    source: str | dict[str, Any] | None, sysfs: str = "/sys", allowed: list[str] | None = None
) -> Matrix:
    """The topology matrix from ``source`` (a dict, a JSON string, or a path to a JSON file) or,
    when ``source`` is None, discovered from ``sysfs``; filtered by the ``allowed`` NIC list."""
    if source is None:
        m = build_matrix(discover_nics(sysfs), discover_gpus(sysfs), numa_nodes(sysfs))
    elif isinstance(source, dict):
        m = validate_matrix(source)
    else:
        text = source.strip()
        if not text.startswith("{"):
            try:
                text = Path(source).read_text()
            except OSError as exc:
                raise ConfigError(f"cannot read topology file {source}: {exc}") from None
        try:
            m = validate_matrix(json.loads(text), where=f"topology {source[:60]!r}")
        except ValueError as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"topology {source[:60]!r} is not valid JSON: {exc}") from None
    return filter_matrix(m, allowed)


def matrix_nics(matrix: Matrix) -> list[str]:
    """Every NIC named in the matrix, in first-seen order."""
    seen: dict[str, None] = {}
    for pref, avail in matrix.values():
        for x in pref + avail:
            seen.setdefault(x, None)
    return list(seen)


def nics_for(matrix: Matrix, location: str, known: list[str]) -> tuple[list[str], list[str]]:
    """(preferred, secondary) NICs for ``location``, restricted to ``known`` (opened) NICs.

    An unknown location uses ``cpu:0``'s lists for CPU memory; otherwise all NICs are preferred.
    """
    entry = matrix.get(location)
    if entry is None and location.startswith("cpu"):
        entry = matrix.get("cpu:0")
    if entry is None:
        return list(known), []
    pref = [x for x in entry[0] if x in known]
    sec = [x for x in entry[1] if x in known and x not in pref]
    rest = [x for x in known if x not in pref and x not in sec]
    if not pref:
        pref, sec = sec or rest, [] if sec else []
        rest = [x for x in known if x not in pref]
        return pref, rest
    return pref, sec + rest
