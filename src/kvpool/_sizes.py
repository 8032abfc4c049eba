"""One size syntax for every option and config field that takes bytes.

``4096``, ``4K``, ``256M``, ``1G``, ``1GiB``, ``1.5G``, ``64KB`` (K, M, G, T are powers of 1024
with or without ``B``/``iB``). Used by the CLI (:func:`size_arg`), the config objects
(:data:`Bytes`) and the benchmarks (:func:`parse_size`).
"""

from __future__ import annotations

import os
import re
import resource
from typing import Any

from kvpool.errors import InvalidArgument

__all__ = [
    "coerce_size",
    "human",
    "memlock_limit",
    "parse_size",
    "physical_memory",
    "check_memory",
    "size_arg",
]

_MULT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*([+-]?\d+(?:\.\d*)?|[+-]?\.\d+)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)
EXAMPLES = "e.g. 4096, 4K, 256M, 1G or 1GiB"


def parse_size(value: str | int, name: str = "size", *, allow_zero: bool = False) -> int:
    """Bytes in ``value`` (an int, or text such as ``256M``); :class:`InvalidArgument` naming
    ``name`` when it is not a size, is negative, or is zero without ``allow_zero``."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{name} must be a size in bytes ({EXAMPLES}), not {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _SIZE.match(value)
        if m is None or (m.group(3) and m.group(3).upper() == "IB" and not m.group(2)):
            raise InvalidArgument(f"{name}: cannot read {value!r} as a size in bytes ({EXAMPLES})")
        num, unit = m.group(1), m.group(2).upper()
        n = int(float(num) * _MULT[unit]) if "." in num else int(num) * _MULT[unit]
    else:
        raise InvalidArgument(f"{name} must be a size in bytes ({EXAMPLES}), not {type(value).__name__}")
    if n < 0 or (n == 0 and not allow_zero):
        need = "zero or more" if allow_zero else "more than zero"
        raise InvalidArgument(f"{name} must be {need} bytes, got {value!r} ({EXAMPLES})")
    return n


def human(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}".replace(".0 ", " ")
        n /= 1024
    return f"{n} B"


def coerce_size(value: Any) -> Any:
    """Text such as ``"256M"`` to bytes; anything else unchanged (the config field's ``int`` type
    and bounds check it). The validator behind :data:`kvpool.config.Bytes`."""
    if isinstance(value, str):
        return parse_size(value, "size", allow_zero=True)
    return value


def size_arg(option: str, *, allow_zero: bool = False) -> Any:
    """An argparse ``type=`` that parses a size and names ``option`` in its error."""

    def parse(text: str) -> int:
        return parse_size(text, option, allow_zero=allow_zero)

    parse.__name__ = "size"
    return parse


def physical_memory() -> int:
    """Bytes of physical memory on this host (0 when unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def memlock_limit() -> int:
    """Soft RLIMIT_MEMLOCK in bytes (-1 = unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return -1 if soft == resource.RLIM_INFINITY else soft


def check_memory(nbytes: int, what: str, *, locked: bool = False) -> None:
    """Refuse (:class:`InvalidArgument`) ``nbytes`` of ``what`` that cannot fit this host's physical
    memory, or its RLIMIT_MEMLOCK when the memory will be pinned (``locked``, RDMA)."""
    phys = physical_memory()
    if phys and nbytes > phys:
        raise InvalidArgument(
            f"{what} needs {human(nbytes)}, more than this host's physical memory ({human(phys)}): "
            f"use a smaller size"
        )
    lim = memlock_limit()
    if locked and lim >= 0 and nbytes > lim:
        raise InvalidArgument(
            f"{what} needs {human(nbytes)} of locked memory, more than RLIMIT_MEMLOCK "
            f"({human(lim)}, `ulimit -l`): raise the limit or use a smaller size"
        )
