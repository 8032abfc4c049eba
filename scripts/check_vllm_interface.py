"""Check kvpool's vLLM connectors against the vLLM installed here (its KVConnectorBase_V1): the
methods kvpool needs exist, no abstract method is left unimplemented, no override takes fewer
positional arguments than the base, and the stats classes import. Exit 1 with the reasons.

    python scripts/check_vllm_interface.py          # or: bash scripts/check_vllm033.sh
"""

from __future__ import annotations

import inspect
import sys

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvpool.connectors.vllm import KvpoolConnector, KvpoolStoreConnector
from kvpool.connectors.vllm.common import _REQUIRED
from kvpool.connectors.vllm.stats import KvpoolKVConnectorStats, KvpoolPromMetrics


def _positional(fn: object, required_only: bool) -> tuple[list[str], bool]:
    ps = list(inspect.signature(fn).parameters.values())  # type: ignore[arg-type]
    pos = [p for p in ps if p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)]
    if required_only:
        pos = [p for p in pos if p.default is inspect.Parameter.empty]
    return [p.name for p in pos], any(p.kind == p.VAR_POSITIONAL for p in ps)


def main() -> int:
    problems = [f"KVConnectorBase_V1 lacks {m}" for m in _REQUIRED if not hasattr(KVConnectorBase_V1, m)]
    for cls in (KvpoolConnector, KvpoolStoreConnector):
        for m in sorted(getattr(cls, "__abstractmethods__", ())):
            problems.append(f"{cls.__name__} does not implement abstract {m}")
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            base = getattr(KVConnectorBase_V1, name, None)
            if name.startswith("_") or not callable(base):
                continue
            try:
                need, _ = _positional(base, True)
                have, star = _positional(fn, False)
            except (TypeError, ValueError):
                continue
            if len(have) < len(need) and not star:
                problems.append(f"{cls.__name__}.{name}{tuple(have)} takes fewer arguments than {need}")
    assert KvpoolKVConnectorStats and KvpoolPromMetrics
    for p in problems:
        print("kvpool: vLLM", vllm.__version__, ":", p)
    if not problems:
        print(f"kvpool connectors match vLLM {vllm.__version__}'s KVConnectorBase_V1")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
