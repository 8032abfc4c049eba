"""``KVPOOL_BENCH_SMOKE=1``: a documented benchmark command runs as written, in seconds.

The doc test (``tests/test_docs_commands.py``) runs every benchmark command that docs/*.md shows,
with its documented flags. Benchmarks call :func:`shorten` right after parsing their arguments;
with the variable set it replaces durations, repeats and sizes by short ones (and says so on
stderr), so CI checks that the command starts, measures and prints without spending minutes. The
figures of a smoke run mean nothing. Unset (the default), nothing changes.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ENV = "KVPOOL_BENCH_SMOKE"


def enabled() -> bool:
    """True when ``KVPOOL_BENCH_SMOKE`` is set to anything but ``""`` or ``0``."""
    return os.environ.get(ENV, "") not in ("", "0")


def shorten(args: Any, **short: Any) -> Any:
    """Set each ``short`` attribute on ``args`` when smoke mode is on; return ``args``.

    Called once per benchmark run, after argument parsing. Only attributes that exist are set.
    """
    if not enabled():
        return args
    done = {k: v for k, v in short.items() if hasattr(args, k)}
    for k, v in done.items():
        setattr(args, k, v)
    what = ", ".join(f"{k}={v}" for k, v in done.items()) or "no change"
    print(f"{ENV}=1: smoke run ({what}); its figures mean nothing", file=sys.stderr, flush=True)
    return args


def pick(normal: Any, smoke: Any) -> Any:
    """``smoke`` in smoke mode, else ``normal`` (for sizes fixed inside a benchmark)."""
    return smoke if enabled() else normal
