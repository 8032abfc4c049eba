"""The verbs layer the RDMA transport calls: the real ``pyverbs``, or what a caller passes.

:func:`load_verbs` imports pyverbs. Tests inject another implementation of the same surface (the
test double :mod:`kvpool.testing.fake_verbs`) as an object, ``TransferEngine(verbs=...)``, which
:func:`as_verbs` wraps; nothing here selects a double by name, and nothing falls back to one.

pyverbs is not on PyPI in a form that builds; Debian/Ubuntu ship it as ``python3-pyverbs`` for the
system python. When ``import pyverbs`` fails and that package is installed for the same Python
minor version, it is imported from the system ``dist-packages`` directory (the path is added only
for that import).
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from typing import Any

from kvpool.errors import ProtocolUnavailable

SYSTEM_DIST = "/usr/lib/python3/dist-packages"
_MODULES = ("device", "pd", "mr", "cq", "qp", "wr", "addr", "enums", "pyverbs_error")


class Verbs(types.SimpleNamespace):
    """``device, pd, mr, cq, qp, wr, addr, enums, pyverbs_error`` modules, and ``kind``."""

    kind: str
    device: Any
    pd: Any
    mr: Any
    cq: Any
    qp: Any
    wr: Any
    addr: Any
    enums: Any
    pyverbs_error: Any


def _import_pyverbs() -> Verbs:
    try:
        mods = {m: importlib.import_module(f"pyverbs.{m}") for m in _MODULES}
    except ImportError as first:
        tag = f"cpython-{sys.version_info.major}{sys.version_info.minor}"
        sysdir = os.path.join(SYSTEM_DIST, "pyverbs")
        has_sys = os.path.isdir(sysdir) and any(tag in f for f in os.listdir(sysdir))
        if not has_sys:
            raise ProtocolUnavailable(
                f"RDMA needs pyverbs, which is not importable ({first}); install rdma-core's Python "
                "bindings (Debian/Ubuntu: `apt-get install python3-pyverbs rdma-core ibverbs-providers` "
                f"for a {tag} interpreter), or use protocol='tcp'"
            ) from None
        sys.modules.pop("pyverbs", None)
        sys.path.append(SYSTEM_DIST)
        try:
            mods = {m: importlib.import_module(f"pyverbs.{m}") for m in _MODULES}
        except ImportError as exc:
            raise ProtocolUnavailable(f"pyverbs from {SYSTEM_DIST} failed to import: {exc}") from None
        finally:
            sys.path.remove(SYSTEM_DIST)
    return Verbs(kind="pyverbs", **mods)


def load_verbs() -> Verbs:
    """The real pyverbs modules (ProtocolUnavailable saying what to install when they do not import)."""
    return _import_pyverbs()


def as_verbs(obj: Any) -> Verbs:
    """A :class:`Verbs` over ``obj``: a Verbs, or any object (module, namespace) with pyverbs'
    ``device, pd, mr, cq, qp, wr, addr, enums, pyverbs_error`` attributes. ``kind`` is the object's
    ``kind`` or ``__name__``."""
    if isinstance(obj, Verbs):
        return obj
    missing = [m for m in _MODULES if not hasattr(obj, m)]
    if missing:
        raise TypeError(f"verbs object {obj!r} lacks {missing}")
    kind = getattr(obj, "kind", None) or getattr(obj, "__name__", type(obj).__name__)
    return Verbs(kind=str(kind), **{m: getattr(obj, m) for m in _MODULES})
