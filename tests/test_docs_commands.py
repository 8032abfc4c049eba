"""Every shell command that README.md and docs/*.md show runs as written, or says what it needs.

Each line of a ``bash`` code block (continuations joined) is a documented command. Either

* it ends in a marker, ``# needs: <what>`` (a GPU, an RDMA NIC, Mooncake, a model, ...), naming
  hardware or software this CPU-only CI machine lacks (a ``minutes`` marker must also name the
  test that covers it); or
* the test runs it exactly as written, from the repository root, with the ``kvpool`` and
  ``python`` of this environment, and asserts exit status 0 and no traceback. Servers
  (``kvpool proxy/master/store-server/metadata-server``) are started, must come up and stay up,
  and are stopped by PID. Benchmarks run with their documented flags and ``KVPOOL_BENCH_SMOKE=1``
  (``kvpool._smoke``), which cuts durations, repeats and sizes so the whole file runs in about
  two minutes; their figures are not checked here. ``[...]`` in a command is optional syntax and
  is left out.

The two steps that CI performs itself (``python -m pip install .``, which ``scripts/test.sh``
does as ``pip install .[test]``, and ``bash scripts/test.sh``, which ``.ci/run`` runs) are checked
against those scripts instead of being run again.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
NEEDS = re.compile(r"#\s*needs:\s*(.+)$")
# What a marker may name first (the rest of the marker is free text).
NEED_KINDS = ("GPU", "RDMA NIC", "nixl venv", "Mooncake", "a model", "minutes", "SGLang", "vLLM servers")
SERVERS = {"proxy", "master", "store-server", "metadata-server"}
# Steps CI itself performs: the command part -> (file, text that must be in it).
CI_OWN = {
    "python -m pip install .": ("scripts/test.sh", 'pip install -q ".[test]"'),
    "bash scripts/test.sh": (".ci/run", "bash scripts/test.sh"),
}


@dataclass(frozen=True)
class DocCommand:
    where: str  # "docs/x.md:12"
    text: str  # the command without its comment
    needs: str | None  # the marker's text, None when unmarked


def _commands() -> list[DocCommand]:
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"^```([a-z]*)\n(.*?)^```", text, re.S | re.M):
            lang, body = m.group(1), m.group(2)
            first = text[: m.start(2)].count("\n") + 1
            if lang not in SHELL:
                # An unlabelled block is output or a diagram; a command there would escape this test.
                assert lang or not re.search(r"^\s*(kvpool|python|bash) ", body, re.M), (
                    f"{path.name}:{first}: commands belong in a ```bash block"
                )
                continue
            if body.lstrip().startswith("-"):
                continue  # options to add to an engine's launch line (vllm serve, sglang), not a command
            lines = body.split("\n")
            i = 0
            while i < len(lines):
                start, line = i, lines[i]
                while line.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip()[:-1] + " " + lines[i].strip()
                i += 1
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                mark = NEEDS.search(line)
                cmd = re.sub(r"\s+#.*$", "", line).strip()
                where = f"{path.relative_to(ROOT)}:{first + start}"
                out.append(DocCommand(where, cmd, mark.group(1).strip() if mark else None))
    return out


COMMANDS = _commands()
RUNNABLE = [c for c in COMMANDS if c.needs is None]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["KVPOOL_BENCH_SMOKE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _as_written(cmd: str) -> str:
    """The command with optional ``[...]`` groups removed and CI's own steps taken out."""
    cmd = re.sub(r"\s*\[[^\]]*\]", "", cmd)
    parts = [p.strip() for p in cmd.split("&&")]
    return " && ".join(p for p in parts if p not in CI_OWN)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _run_server(cmd: str, tmp: Path) -> None:
    """Start a server command, wait until it listens (``--port``) or prints, then stop it by PID."""
    log = tmp / "server.log"
    m = re.search(r"--port\s+(\d+)", cmd)
    port = int(m.group(1)) if m else None
    if port is not None and _port_open(port):
        pytest.fail(f"port {port} that the documented command uses is taken on this machine")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", "-c", f"exec {cmd}"], cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"{cmd!r} exited with {proc.returncode}:\n{log.read_text()}"
            if (port is not None and _port_open(port)) or (port is None and log.stat().st_size > 0):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"{cmd!r} did not come up within 30 s:\n{log.read_text()}")
        time.sleep(0.5)
        assert proc.poll() is None, f"{cmd!r} exited with {proc.returncode}:\n{log.read_text()}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert "Traceback" not in log.read_text(), log.read_text()


def test_commands_found() -> None:
    """The extraction sees the documented commands (so an empty list cannot pass silently)."""
    assert len(COMMANDS) >= 20 and len(RUNNABLE) >= 15, COMMANDS
    assert any(c.text.startswith("kvpool demo") or "kvpool demo" in c.text for c in RUNNABLE)


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.needs], ids=lambda c: c.where)
def test_marked_commands_say_what_they_need(cmd: DocCommand) -> None:
    assert cmd.needs is not None and cmd.needs.startswith(NEED_KINDS), (cmd, NEED_KINDS)
    if cmd.needs.startswith("minutes"):  # only real-server runs, and only when a test covers them
        tests = re.findall(r"tests/test_\w+\.py", cmd.needs)
        assert tests and all((ROOT / t).is_file() for t in tests), cmd


@pytest.mark.parametrize("part", sorted(CI_OWN))
def test_ci_performs_its_own_steps(part: str) -> None:
    assert any(part in c.text for c in COMMANDS), part
    file, text = CI_OWN[part]
    assert text in (ROOT / file).read_text(), (file, text)


@pytest.mark.parametrize("cmd", RUNNABLE, ids=lambda c: c.where)
def test_documented_command_runs_as_written(cmd: DocCommand) -> None:
    run = _as_written(cmd.text)
    if not run:
        return  # only CI's own steps (test_ci_performs_its_own_steps)
    words = run.split()
    with tempfile.TemporaryDirectory() as tmp:
        if words[0] == "kvpool" and words[1] in SERVERS:
            _run_server(run, Path(tmp))
            return
        # A command that creates something in the current directory (python -m venv .venv) runs in
        # a scratch directory; everything else from the repository root, as the docs say.
        cwd = tmp if "python -m venv" in run else ROOT
        out = subprocess.run(
            ["bash", "-c", run], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=180,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    assert out.returncode == 0, (cmd.where, run, out.stdout[-2000:], out.stderr[-3000:])
    assert "Traceback" not in out.stdout + out.stderr, (cmd.where, out.stderr[-3000:])


def test_sglang_pd_example_starts_without_an_rdma_nic(tmp_path: Path) -> None:
    """examples/sglang/pd.sh picks its transfer path from the host and launches SGLang, on a host
    without an RDMA NIC too. SGLang cannot run a model here, so ``python`` is a stand-in on PATH that
    records how it was called (the launch lines themselves are SGLang's documented ones)."""
    log = tmp_path / "calls"
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/sh\necho "$KVPOOL_PROTOCOL $*" >> {log}\n')
    stub.chmod(0o755)
    env = {**_env(), "PATH": f"{stub.parent}{os.pathsep}{os.environ['PATH']}", "MODEL": "some/model"}
    env.pop("KVPOOL_PROTOCOL", None)
    out = subprocess.run(
        ["bash", str(ROOT / "examples/sglang/pd.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    rdma = bool(list(Path("/sys/class/infiniband").glob("*")))
    proto = "rdma" if rdma else "auto"
    assert f"KVPOOL_PROTOCOL={proto}" in out.stderr
    calls = log.read_text().splitlines()
    assert len(calls) == 3, calls
    servers = [c for c in calls if "sglang.launch_server" in c]
    assert len(servers) == 2 and all(c.startswith(proto + " ") for c in calls), calls
    assert all("--disaggregation-transfer-backend kvpool" in c for c in servers), calls
    assert {"prefill", "decode"} == {c.split("--disaggregation-mode ")[1].split()[0] for c in servers}
