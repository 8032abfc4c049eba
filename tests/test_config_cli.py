"""Config object loading and the kvpool command line (demo and bench run for real)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpool import TransferConfig, TransferEngine
from kvpool.errors import ConfigError
from kvpool.transfer.bench import parse_size, percentile


def test_config_kwargs_json_env(tmp_path) -> None:
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"timeout_s": 3, "lanes": 4, "protocol": "tcp"}))
    c = TransferConfig.from_json(f, lanes=3)
    assert (c.timeout_s, c.lanes, c.protocol) == (3.0, 3, "tcp")
    env = {
        "KVPOOL_CONFIG": str(f),
        "KVPOOL_LANES": "5",
        "KVPOOL_SECRET": "x",
        "KVPOOL_DEVICES": "mlx5_0,mlx5_1",
    }
    c = TransferConfig.from_env(environ=env)
    assert (c.lanes, c.secret, c.timeout_s, c.devices) == (5, "x", 3.0, ["mlx5_0", "mlx5_1"])
    with pytest.raises(ConfigError):
        TransferConfig(lanes=0)
    with pytest.raises(ConfigError):
        TransferConfig(metadata="ftp://nowhere")
    with pytest.raises(ConfigError):
        TransferConfig(bogus=1)
    with pytest.raises(ConfigError):
        TransferConfig.from_json(tmp_path / "missing.json")
    with pytest.raises(ConfigError):
        TransferConfig.from_env(environ={"KVPOOL_TIMEOUT_S": "soon"})


def test_engine_honours_config_object() -> None:
    cfg = TransferConfig(protocol="tcp", lanes=3, timeout_s=2.5)
    with TransferEngine(config=cfg, name="ignored-for-p2p") as eng:
        assert eng.config.lanes == 3 and eng.config.protocol == "tcp"
        assert eng.segment_name == f"127.0.0.1:{eng.port}"  # p2p names are always host:port
    with TransferEngine(config=cfg, protocol="auto") as eng:
        assert eng.config.protocol == "auto" and eng.config.lanes == 3


def test_helpers() -> None:
    assert parse_size("64K") == 65536 and parse_size("4MiB") == 4 << 20 and parse_size("1G") == 1 << 30
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0 and percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0


def _kvpool(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpool.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_demo_runs_and_verifies() -> None:
    out = _kvpool("demo", "--bytes", "96M")
    assert out.returncode == 0, out.stderr
    assert "all checksums match" in out.stdout
    assert out.stdout.count(" ok ") + out.stdout.count("│      ok") >= 1
    assert "same_host" in out.stdout and "tcp" in out.stdout


def test_bench_transfer_json() -> None:
    out = _kvpool(
        "bench", "transfer", "--block-size", "64K", "--op", "write", "read", "--duration", "0.5", "--json"
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert [r["operation"] for r in res] == ["write", "read"]
    assert all(r["gbps"] > 0 and r["p99_us"] >= r["p50_us"] > 0 and r["path"] == "tcp" for r in res)


def test_cli_reports_typed_errors() -> None:
    out = _kvpool("bench", "transfer", "--block-size", "zero", "--duration", "0.1")
    assert out.returncode == 2 and "InvalidArgument" in out.stderr
