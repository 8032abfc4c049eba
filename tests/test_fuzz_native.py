"""Random input into the native code that parses what peers send (drivers: tests/fuzz_native.py):
on the installed build, and on an AddressSanitizer + UndefinedBehaviorSanitizer build of csrc/
made here (cached in build/asan) -- an overflow that happens to land in mapped memory passes the
first and fails the second."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvpool
from tests.fuzz_native import fuzz_client, fuzz_ingest, fuzz_ingest_capped, fuzz_server

ROOT = Path(__file__).resolve().parents[1]
SANITIZE = "-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -O1"


def test_random_request_frames_never_touch_bytes_outside_a_registration() -> None:
    st = fuzz_server(seed=11, n=400)
    assert st["ok_replies"] > 20 and st["err_replies"] > 20, st  # both outcomes were exercised


def test_random_reply_frames_end_in_success_or_a_typed_error() -> None:
    st = fuzz_client(seed=12, n=120)
    assert st["errors"] > 10 and st["ok"] > 0, st


def test_random_kv_event_payloads_are_counted_and_the_index_still_works() -> None:
    st = fuzz_ingest(seed=13, n=20_000)
    assert st["stored"] > 100 and st["malformed"] > 1_000, st


def test_capped_indexes_evict_under_concurrent_ingest_and_match() -> None:
    st = fuzz_ingest_capped(seed=14, n=6_000)
    assert st["evicted"] > 500 and st["stored"] > 1_000 and st["matches"] > 100, st


def _runtime(name: str) -> str:
    path = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    assert os.path.isabs(path) and os.path.exists(path), f"{name} not found (gcc's sanitizer runtime)"
    return path


def _sanitized_package(dest: Path) -> Path:
    """A copy of the kvpool package in use with its native modules built with the sanitizers."""
    import pybind11

    build = ROOT / "build" / "asan"
    subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Debug",
         f"-DCMAKE_CXX_FLAGS={SANITIZE}", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
         f"-DPython_EXECUTABLE={sys.executable}"],
        check=True, capture_output=True,
    )  # fmt: skip
    subprocess.run(["ninja", "-C", str(build)], check=True, capture_output=True)
    pkg = dest / "kvpool"
    shutil.copytree(Path(kvpool.__file__).parent, pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for so in build.glob("_*.so"):
        data = so.read_bytes()
        assert b"__asan_report_load" in data and b"__ubsan_handle" in data, f"{so.name} is not instrumented"
        shutil.copy(so, pkg / so.name)
    return dest


# Runs a driver with the copy first on the path. An editable install's import hook would take
# precedence over sys.path, so only the path-based finders are kept.
_BOOT = """
import importlib.machinery, runpy, sys
sys.path[:0] = [sys.argv.pop(1), sys.argv.pop(1)]
sys.meta_path[:] = [f for f in sys.meta_path if f in (importlib.machinery.BuiltinImporter,
                    importlib.machinery.FrozenImporter, importlib.machinery.PathFinder)]
import kvpool._native, kvpool._conductor
print("native:", kvpool._native.__file__, kvpool._conductor.__file__, flush=True)
runpy.run_module("tests.fuzz_native", run_name="__main__")
"""


@pytest.mark.timeout(1200)
def test_the_fuzzers_are_clean_under_address_and_undefined_behavior_sanitizers(tmp_path: Path) -> None:
    site = _sanitized_package(tmp_path)
    env = dict(
        os.environ,
        LD_PRELOAD=f"{_runtime('libasan.so')} {_runtime('libubsan.so')}",
        ASAN_OPTIONS="detect_leaks=0",  # the interpreter keeps its arenas for good
        UBSAN_OPTIONS="print_stacktrace=1",
    )
    env.pop("PYTHONPATH", None)
    for kind, seed, n in (
        ("server", 21, 1_500),
        ("client", 22, 200),
        ("ingest", 23, 60_000),
        ("capped", 24, 6_000),
    ):
        proc = subprocess.run(
            [sys.executable, "-c", _BOOT, str(site), str(ROOT), kind, str(seed), str(n)],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        out = proc.stdout + proc.stderr
        assert f"native: {site}" in out, out[-2000:]  # the sanitized build ran, not the installed one
        assert "AddressSanitizer" not in out and "runtime error:" not in out, out[-6000:]
        assert proc.returncode == 0 and f"{kind} ok" in out, out[-3000:]
