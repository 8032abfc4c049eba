"""RDMA set-up without a device: topology discovery from a fake sysfs tree, `kvpool topology`,
typed errors when pyverbs or a device is missing, and protocol="auto" falling back to TCP.
(These tests use no verbs at all, or the real pyverbs where it is installed; none uses the test
double except the one named so.)"""

from __future__ import annotations

import builtins
import json
import logging
import os
import subprocess
import sys

import pytest

from kvpool import OpCode, TransferEngine
from kvpool.errors import ConfigError, ProtocolUnavailable
from kvpool.testing import fake_verbs as fv
from kvpool.transfer.rdma import topology as tp
from kvpool.transfer.rdma import verbs


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def sysfs(tmp_path):
    """Two NUMA nodes; NICs mlx5_0/1 under switch A (node 0) with GPU 0, mlx5_2 under switch B
    (node 1) with GPU 1, mlx5_3 on node 1's root port directly."""
    root = tmp_path / "sys"
    dev = root / "devices"
    a = dev / "pci0000:00" / "0000:00:01.0" / "0000:01:00.0"  # switch A
    b = dev / "pci0000:80" / "0000:80:01.0" / "0000:81:00.0"  # switch B
    places = {
        "mlx5_0": (a / "0000:02:00.0", 0),
        "mlx5_1": (a / "0000:02:01.0", 0),
        "mlx5_2": (b / "0000:82:00.0", 1),
        "mlx5_3": (dev / "pci0000:80" / "0000:80:02.0", 1),
    }
    for name, (p, numa) in places.items():
        _write(p / "numa_node", f"{numa}\n")
        link = root / "class" / "infiniband" / name
        link.mkdir(parents=True)
        os.symlink(p, link / "device")
    gpus = {"0000:02:02.0": (a / "0000:02:02.0", 0), "0000:82:01.0": (b / "0000:82:01.0", 1)}
    for bdf, (p, numa) in gpus.items():
        _write(p / "vendor", "0x10de\n")
        _write(p / "class", "0x030200\n")
        _write(p / "numa_node", f"{numa}\n")
        (root / "bus" / "pci" / "devices").mkdir(parents=True, exist_ok=True)
        os.symlink(p, root / "bus" / "pci" / "devices" / bdf)
    _write(root / "bus" / "pci" / "devices" / "0000:00:1f.0" / "vendor", "0x8086\n")  # not a GPU
    _write(root / "bus" / "pci" / "devices" / "0000:00:1f.0" / "class", "0x060100\n")
    for n in (0, 1):
        (root / "devices" / "system" / "node" / f"node{n}").mkdir(parents=True)
    return str(root)


def test_topology_matrix_from_fake_sysfs(sysfs):
    m = tp.load_matrix(None, sysfs=sysfs)
    assert m["cpu:0"] == [["mlx5_0", "mlx5_1"], ["mlx5_2", "mlx5_3"]]
    assert m["cpu:1"] == [["mlx5_2", "mlx5_3"], ["mlx5_0", "mlx5_1"]]
    assert m["cuda:0"] == [["mlx5_0", "mlx5_1"], ["mlx5_2", "mlx5_3"]]  # same PCIe switch
    assert m["cuda:1"] == [["mlx5_2"], ["mlx5_0", "mlx5_1", "mlx5_3"]]  # closest: mlx5_2 only
    # allow-list, and the preferred list emptied by it falls back to the secondaries
    f = tp.load_matrix(None, sysfs=sysfs, allowed=["mlx5_0", "mlx5_3"])
    assert f["cuda:1"] == [["mlx5_0", "mlx5_3"], []]
    assert f["cpu:0"] == [["mlx5_0"], ["mlx5_3"]]


def test_topology_override_file_and_validation(tmp_path):
    p = tmp_path / "topo.json"
    p.write_text(json.dumps({"cpu:0": [["mlx5_1"], ["mlx5_0"]], "cuda:0": [["mlx5_0"]]}))
    m = tp.load_matrix(str(p))
    assert m == {"cpu:0": [["mlx5_1"], ["mlx5_0"]], "cuda:0": [["mlx5_0"], []]}
    assert tp.nics_for(m, "cpu:3", ["mlx5_0", "mlx5_1"]) == (["mlx5_1"], ["mlx5_0"])  # falls to cpu:0
    assert tp.nics_for(m, "cuda:7", ["mlx5_0", "mlx5_1"]) == (["mlx5_0", "mlx5_1"], [])
    with pytest.raises(ConfigError, match="location"):
        tp.load_matrix('{"gpu0": [["a"], []]}')
    with pytest.raises(ConfigError, match="preferred"):
        tp.load_matrix('{"cpu:0": "mlx5_0"}')
    with pytest.raises(ConfigError, match="cannot read"):
        tp.load_matrix(str(tmp_path / "missing.json"))


def test_kvpool_topology_cli(sysfs, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli", "topology", "--sysfs", sysfs, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout)["cuda:1"] == [["mlx5_2"], ["mlx5_0", "mlx5_1", "mlx5_3"]]
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli", "topology", "--sysfs", sysfs, "--devices", "mlx5_2"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout)["cpu:0"] == [["mlx5_2"], []]
    assert "4 RDMA NIC(s), 2 NVIDIA GPU(s)" in out.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    r = subprocess.run(
        [sys.executable, "-m", "kvpool.cli", "topology", "--file", str(bad)], capture_output=True, text=True
    )
    assert r.returncode == 2 and "ConfigError" in r.stderr


def test_rdma_without_pyverbs_raises_typed_error_naming_it(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_pyverbs(name, *a, **k):
        if name.startswith("pyverbs"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **k)

    for m in [m for m in sys.modules if m.startswith("pyverbs")]:
        monkeypatch.delitem(sys.modules, m)
    monkeypatch.setattr(builtins, "__import__", no_pyverbs)
    monkeypatch.setattr(verbs.importlib, "import_module", lambda n: no_pyverbs(n))
    monkeypatch.setattr(verbs, "SYSTEM_DIST", str(tmp_path))  # no Debian package either
    with pytest.raises(ProtocolUnavailable, match="pyverbs.*python3-pyverbs"):
        TransferEngine(protocol="rdma")


def test_rdma_without_device_raises_and_auto_falls_back_to_tcp(caplog):
    """Uses the real pyverbs when it is importable (Debian's python3-pyverbs here): no device."""
    try:
        verbs.load_verbs()
        have_pyverbs = True
    except ProtocolUnavailable:
        have_pyverbs = False
    with pytest.raises(ProtocolUnavailable, match="no RDMA device|no usable RDMA device|pyverbs"):
        TransferEngine(protocol="rdma")
    if have_pyverbs and not os.path.isdir("/sys/class/infiniband"):
        with pytest.raises(ProtocolUnavailable, match="no RDMA device"):
            TransferEngine(protocol="rdma")
    with TransferEngine(protocol="auto") as t, TransferEngine(protocol="auto") as i:
        assert t.rdma is None and i.rdma is None
        kv = bytearray(1 << 20)
        base = t.register_local_memory(kv)
        src = bytearray(os.urandom(1 << 20))
        la = i.register_local_memory(src)
        assert i.transfer_sync(t.segment_name, la, base, 1 << 20, OpCode.WRITE) == 1 << 20
        assert kv == src


def test_auto_with_double_falls_back_and_logs_why(monkeypatch, caplog):
    """Test double injected but not configured (no registry): auto logs and uses TCP."""
    monkeypatch.delenv("KVPOOL_FAKE_VERBS_DIR", raising=False)
    with caplog.at_level(logging.INFO, logger="kvpool.transfer"):
        with TransferEngine(protocol="auto", verbs=fv) as e:
            assert e.rdma is None and "rdma" not in e.local_descriptor().protocols
    assert any("not using RDMA" in r.getMessage() for r in caplog.records)
    with pytest.raises(ProtocolUnavailable, match="no RDMA device"):
        TransferEngine(protocol="rdma", verbs=fv)


def test_double_enums_and_objects_match_real_pyverbs():
    """The test double's enum values equal pyverbs' where pyverbs imports (Debian python3-pyverbs
    here), and the pyverbs objects the transport builds accept its keyword arguments."""

    try:
        V = verbs.load_verbs()
    except ProtocolUnavailable as exc:
        assert "pyverbs" in str(exc)
        return
    E = V.enums
    assert {k: getattr(E, k) for k in vars(fv.enums)} == vars(fv.enums)
    gr = V.addr.GlobalRoute(
        dgid=V.addr.GID("0000:0000:0000:0000:0000:ffff:0a00:0001"), sgid_index=3, hop_limit=64
    )
    attr = V.qp.QPAttr(qp_state=E.IBV_QPS_RTR)
    attr.ah_attr = V.addr.AHAttr(dlid=0, is_global=1, port_num=1, gr=gr)
    V.qp.QPCap(max_send_wr=256, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    nxt = V.wr.SendWR(wr_id=1, opcode=E.IBV_WR_RDMA_READ, num_sge=1, sg=[V.wr.SGE(4096, 1, 1)], send_flags=0)
    wr = V.wr.SendWR(
        wr_id=2,
        opcode=E.IBV_WR_RDMA_WRITE,
        num_sge=1,
        sg=[V.wr.SGE(4096, 1, 1)],
        send_flags=E.IBV_SEND_SIGNALED,
        next_wr=nxt,
    )
    wr.set_wr_rdma(7, 8192)
