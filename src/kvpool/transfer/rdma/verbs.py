"""One import shim for the verbs layer: the real ``pyverbs`` or the in-repo test double.

The choice is explicit (``TransferConfig.rdma_verbs`` = ``"pyverbs"`` or ``"double"``, i.e.
``KVPOOL_RDMA_VERBS`` through :meth:`TransferConfig.from_env`); nothing falls back to the double
silently.

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


def load_verbs(kind: str = "pyverbs") -> Verbs:
    """The verbs modules: ``"pyverbs"`` (real) or ``"double"`` (:mod:`kvpool.testing.fake_verbs`)."""
    if kind == "double":
        from kvpool.testing import fake_verbs as fv

        return Verbs(
            kind="double",
            device=fv.device,
            pd=fv.pd,
            mr=fv.mr,
            cq=fv.cq,
            qp=fv.qp,
            wr=fv.wr,
            addr=fv.addr,
            enums=fv.enums,
            pyverbs_error=fv.pyverbs_error,
        )
    if kind != "pyverbs":
        raise ProtocolUnavailable(f"unknown verbs implementation {kind!r} (use 'pyverbs' or 'double')")
    return _import_pyverbs()
