"""Where the SGLang interpreter is: SGLang 0.5.23 lives in its own virtualenv (created by
scripts/test.sh with ``--system-site-packages``, so it sees this environment's torch, vLLM and
kvpool) because its CPU install needs a torchvision import fix that must not leak into the vLLM
environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def sglang_python() -> str:
    """The interpreter with SGLang: ``KVPOOL_SGLANG_PYTHON``, else ``.venv-sglang`` in the repo."""
    env = os.environ.get("KVPOOL_SGLANG_PYTHON")
    if env:
        return env
    venv = ROOT / ".venv-sglang" / "bin" / "python"
    if venv.exists():
        return str(venv)
    try:
        import sglang  # noqa: F401

        return sys.executable
    except ImportError:
        pytest.fail(
            "no SGLang interpreter: run scripts/test.sh (it creates .venv-sglang) or set KVPOOL_SGLANG_PYTHON"
        )


SGLANG_ENV = {"SGLANG_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
