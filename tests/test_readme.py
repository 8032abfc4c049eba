"""README.md and docs/ as tests: README's Python snippets run as written, and every option that a
``kvpool ...`` command in README.md or docs/*.md names (command table, code blocks, inline code)
exists in that command's ``--help`` (so the docs cannot drift from the CLI)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, re.S)
ROWS = re.findall(r"^\| `(kvpool [^`]+)` \|", README, re.M)
ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {"demo", "bench", "master", "store-server", "metadata-server", "proxy", "doctor", "topology",
            "simulate"}  # fmt: skip


def _documented_commands() -> list[tuple[str, str]]:
    """(file, command) for every `kvpool <subcommand> ... --option` in README.md and docs/*.md."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        lines = [ln for b in re.findall(r"```[a-z]*\n(.*?)```", text, re.S) for ln in b.splitlines()]
        lines += re.findall(r"`([^`\n]+)`", text)
        for line in lines:
            m = re.search(r"(?:^|[\s;&|(])(kvpool (?:bench )?[a-z][a-z-]+\b.*)", line)
            if m and " --" in m.group(1) and m.group(1).split()[1] in COMMANDS:
                out.append((path.name, m.group(1).split("#")[0]))
    return out


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


def test_documented_options_exist() -> None:
    assert len(ROWS) >= 10
    helps: dict[tuple[str, ...], str] = {}
    for where, row in [("README.md", r) for r in ROWS] + _documented_commands():
        words = row.split()
        sub = [w for w in words[1:3] if re.fullmatch(r"[a-z-]+", w)]
        if sub[:1] != ["bench"]:
            sub = sub[:1]
        key = tuple(sub)
        if key not in helps:
            helptext = _kvpool(*sub, "--help")
            assert helptext.returncode == 0, (where, row, helptext.stderr)
            helps[key] = helptext.stdout
        for opt in set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", row)):
            assert opt in helps[key], (where, row, opt)


def test_quick_start_commands() -> None:
    out = _kvpool("doctor")
    assert out.returncode in (0, 1) and "memlock" in out.stdout and "Traceback" not in out.stderr
