"""README.md as a test: its Python snippets run as written, and every option its command table
names exists in that command's ``--help`` (so the table cannot drift from the CLI)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, re.S)
ROWS = re.findall(r"^\| `(kvpool [^`]+)` \|", README, re.M)


def _kvpool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpool.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("code", SNIPPETS, ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_python_snippets_run_as_written(code: str, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    for expected in re.findall(r"print\(.*\)\s+# (.+)$", code, re.M):  # a printed value's comment
        assert expected.strip() in out.stdout, (expected, out.stdout)


def test_command_table_options_exist() -> None:
    assert len(ROWS) >= 10
    for row in ROWS:
        words = row.split()
        sub = [w for w in words[1:3] if re.fullmatch(r"[a-z-]+", w)]
        if sub[:1] != ["bench"]:
            sub = sub[:1]
        helptext = _kvpool(*sub, "--help")
        assert helptext.returncode == 0, (row, helptext.stderr)
        for opt in set(re.findall(r"--[a-z][a-z0-9-]*", row)):
            assert opt in helptext.stdout, (row, opt)


def test_quick_start_commands() -> None:
    out = _kvpool("doctor")
    assert out.returncode in (0, 1) and "memlock" in out.stdout and "Traceback" not in out.stderr
