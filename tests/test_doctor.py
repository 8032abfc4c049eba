"""``kvpool doctor``: the host checks (with sysfs/procfs trees written here where this machine has no
RDMA NIC or GPU), JSON and table output, and the server checks against real servers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvpool.doctor import run_checks
from kvpool.store.procs import MasterProcess


def _doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpool.cli", "doctor", *args], capture_output=True, text=True, timeout=60
    )


def _by_name(checks: list) -> dict:
    return {c["name"] if isinstance(c, dict) else c.name: c for c in checks}


def _fake_host(root: Path, *, peermem: bool, scope: str, v2_gid: bool) -> tuple[str, str]:
    sysfs, procfs = root / "sys", root / "proc"
    port = sysfs / "class/infiniband/mlx5_0/ports/1"
    (port / "gids").mkdir(parents=True)
    (port / "gid_attrs/types").mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("Ethernet\n")
    (port / "active_mtu").write_text("4096 (5)\n")
    (port / "gids/0").write_text("fe80:0000:0000:0000:0000:0000:0000:0001\n")
    (port / "gid_attrs/types/0").write_text("IB/RoCE v1\n")
    (port / "gids/1").write_text("0000:0000:0000:0000:0000:ffff:0a00:0001\n")
    (port / "gid_attrs/types/1").write_text("RoCE v2\n" if v2_gid else "IB/RoCE v1\n")
    (port / "gids/2").write_text("0000:0000:0000:0000:0000:0000:0000:0000\n")  # empty slot
    down = sysfs / "class/infiniband/mlx5_1/ports/1"
    down.mkdir(parents=True)
    (down / "state").write_text("1: DOWN\n")
    (down / "link_layer").write_text("InfiniBand\n")
    if peermem:
        (sysfs / "module/nvidia_peermem").mkdir(parents=True)
    (procfs / "driver/nvidia/gpus/0000:3b:00.0").mkdir(parents=True)
    (procfs / "driver/nvidia/version").write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
    )
    (procfs / "sys/kernel/yama").mkdir(parents=True)
    (procfs / "sys/kernel/yama/ptrace_scope").write_text(scope + "\n")
    return str(sysfs), str(procfs)


def test_host_checks_on_a_described_host(tmp_path: Path) -> None:
    sysfs, procfs = _fake_host(tmp_path / "a", peermem=True, scope="1", v2_gid=True)
    c = _by_name(run_checks(sysfs=sysfs, procfs=procfs))
    assert c["rdma mlx5_0/1"].status == "ok" and "MTU 4096" in c["rdma mlx5_0/1"].detail
    assert "2 GID(s), 1 RoCE v2" in c["rdma mlx5_0/1"].detail
    assert c["rdma mlx5_1/1"].status == "warn" and "DOWN" in c["rdma mlx5_1/1"].detail
    assert c["cuda driver"].status == "ok" and "550.54.15" in c["cuda driver"].detail
    assert c["cuda devices"].detail.startswith("1 GPU(s)")
    assert c["gpudirect"].status == "ok"
    assert c["ptrace_scope"].status == "warn" and c["ptrace_scope"].fix
    assert c["pyverbs"].status in ("ok", "fail")  # NICs present: a missing pyverbs is a failure
    if c["pyverbs"].status == "fail":
        assert "apt-get install" in c["pyverbs"].fix

    sysfs, procfs = _fake_host(tmp_path / "b", peermem=False, scope="0", v2_gid=False)
    c = _by_name(run_checks(sysfs=sysfs, procfs=procfs))
    assert c["rdma mlx5_0/1"].status == "warn" and "IP address" in c["rdma mlx5_0/1"].fix
    assert c["gpudirect"].status in ("warn", "fail") and "nvidia_peermem" in c["gpudirect"].fix
    assert c["ptrace_scope"].status == "ok"


def test_this_host_json_and_table() -> None:
    out = _doctor("--json")
    checks = json.loads(out.stdout)
    names = {c["name"] for c in checks}
    assert {"memlock", "ptrace_scope", "pyverbs", "cuda driver", "vllm", "sglang"} <= names
    assert all(c["status"] in ("ok", "warn", "fail", "info") for c in checks)
    assert out.returncode == (1 if any(c["status"] == "fail" for c in checks) else 0)
    table = _doctor()
    assert "kvpool doctor" in table.stdout and "memlock" in table.stdout and "Traceback" not in table.stderr


def test_server_checks_against_real_servers(etcd_url: str, redis_url: str, http_metadata_url: str) -> None:
    with MasterProcess() as master:
        out = _doctor("--json", "--master", master.address, "--etcd", etcd_url, "--redis", redis_url,
                      "--metadata", http_metadata_url)  # fmt: skip
        c = _by_name(json.loads(out.stdout))
        assert c["master"]["status"] == "ok", c["master"]
        assert c["etcd"]["status"] == "ok" and c["redis"]["status"] == "ok", (c["etcd"], c["redis"])
        assert c["metadata"]["status"] == "ok", c["metadata"]
        # Each pointed at the wrong kind of server, or at nothing.
        redis_port = redis_url.rsplit(":", 1)[1]
        wrong = _doctor("--json", "--master", f"127.0.0.1:{redis_port}", "--redis", f"redis://{master.address}",
                        "--etcd", "etcd://127.0.0.1:1", "--timeout-s", "2")  # fmt: skip
    c = _by_name(json.loads(wrong.stdout))
    assert wrong.returncode == 1
    assert c["master"]["status"] == "fail" and "not a kvpool master" in c["master"]["detail"], c["master"]
    assert c["redis"]["status"] == "fail" and "not redis" in c["redis"]["detail"], c["redis"]
    assert c["etcd"]["status"] == "fail" and "not reachable" in c["etcd"]["detail"], c["etcd"]
