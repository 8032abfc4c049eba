"""CUDA TEST DOUBLE: builds the fake CUDA driver library (``fakecuda.c`` beside this file).

:func:`build` compiles it once with the system C compiler into a cache directory and returns the
path; tests point ``KVPOOL_CUDA_DRIVER`` (or ``TransferConfig.cuda_driver``) at it, so that
:mod:`kvpool.transfer.cuda_driver` loads it instead of ``libcuda.so.1``. Production code never
names it. :func:`stats` reads its counters (kernel launches, copies, bytes) in this process.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("fakecuda.c")


def build(out_dir: str | os.PathLike[str] | None = None) -> str:
    """Path of the compiled fake driver (``libfakecuda-<hash>.so``); compiled when missing."""
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src).hexdigest()[:12]
    root = Path(out_dir) if out_dir is not None else Path(tempfile.gettempdir()) / "kvpool-fakecuda"
    root.mkdir(parents=True, exist_ok=True)
    lib = root / f"libfakecuda-{tag}.so"
    if not lib.exists():
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
        tmp = root / f".{lib.name}.{os.getpid()}"
        subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-Wall", "-o", str(tmp), str(SOURCE), "-lpthread"],
            check=True,
            capture_output=True,
        )
        os.replace(tmp, lib)  # atomic: concurrent builders never load a half-written file
    return str(lib)


def stats(path: str) -> tuple[int, int, int]:
    """(kernel launches, copies, bytes moved) counted by the fake driver loaded from ``path`` here."""
    lib = ctypes.CDLL(path)
    a, b, c = ctypes.c_long(), ctypes.c_long(), ctypes.c_long()
    lib.fakecuda_stats(ctypes.byref(a), ctypes.byref(b), ctypes.byref(c))
    return a.value, b.value, c.value
