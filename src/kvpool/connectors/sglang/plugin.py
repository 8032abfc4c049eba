"""SGLang general plugin (entry point group ``sglang.srt.plugins``): adds the ``kvpool`` transfer
backend to an unmodified SGLang.

SGLang calls :func:`register` in every process it starts (launcher, schedulers, detokenizer)
before arguments are parsed. It

* extends the ``--disaggregation-transfer-backend`` choices (SGLang's own
  ``add_disagg_transfer_backend_choices``);
* adds ``TransferBackend.KVPOOL`` (``TransferBackend("kvpool")`` resolves);
* wraps ``get_kv_class`` with an AROUND hook of SGLang's ``HookRegistry`` so that it returns
  kvpool's manager, sender, receiver and bootstrap server for that backend.
"""

from __future__ import annotations

import logging
from enum import Enum
from typing import Any

from kvpool.connectors.sglang import SUPPORTED_SGLANG

log = logging.getLogger("kvpool.connectors.sglang")

BACKEND = "kvpool"


def _extend_enum(cls: type[Enum], name: str, value: str) -> Enum:
    """Add a member to a plain Enum (SGLang's TransferBackend has no extension point)."""
    existing = cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(cls)
    member._name_ = name
    member._value_ = value
    member._sort_order_ = len(cls._member_names_)  # type: ignore[attr-defined]
    type.__setattr__(cls, name, member)  # EnumType.__setattr__ only refuses existing members
    cls._member_names_.append(name)  # type: ignore[attr-defined]
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    return member


def _get_kv_class(original: Any, transfer_backend: Any, class_type: Any, *args: Any, **kwargs: Any) -> Any:
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
        return original(transfer_backend, class_type, *args, **kwargs)
    from sglang.srt.disaggregation.base import KVArgs
    from sglang.srt.disaggregation.utils import KVClassType

    from kvpool.connectors.sglang import bootstrap_server, conn, endpoints

    return {
        KVClassType.KVARGS: KVArgs,
        KVClassType.MANAGER: conn.KvpoolKVManager,
        KVClassType.SENDER: endpoints.KvpoolKVSender,
        KVClassType.RECEIVER: endpoints.KvpoolKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: bootstrap_server.KvpoolKVBootstrapServer,
    }.get(class_type)


def _has(obj: Any, dotted: str) -> bool:
    for name in dotted.split("."):
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def check_sglang() -> str:
    """The SGLang version; raises ImportError naming what is missing when its interface differs."""
    import sglang

    version = getattr(sglang, "__version__", "unknown")
    needed = {
        "sglang.srt.arg_groups.choices": [
            "DISAGG_TRANSFER_BACKEND_CHOICES",
            "add_disagg_transfer_backend_choices",
        ],
        "sglang.srt.disaggregation.utils": ["TransferBackend", "KVClassType", "get_kv_class"],
        "sglang.srt.plugins.hook_registry": ["HookRegistry", "HookType"],
        "sglang.srt.disaggregation.common.conn": [
            "CommonKVManager",
            "CommonKVSender",
            "CommonKVReceiver",
            "CommonKVBootstrapServer",
            # overridden to sign (prefill) and check (server) the bootstrap registrations
            "CommonKVManager._register_topology_row",
            "CommonKVSender._register_prefill_dp_rank",
            "CommonKVBootstrapServer._handle_route_put",
            "CommonKVBootstrapServer._handle_register_dp_rank",
            "CommonKVBootstrapServer._setup_routes",  # extended: the nonce route
            # overridden: one Failed status per decode rank under prefill_complete
            "CommonKVManager._notify_bootstrap",
            "CommonKVManager._room_notify_targets",
        ],
    }
    import importlib

    missing = []
    for mod, names in needed.items():
        try:
            m = importlib.import_module(mod)
        except ImportError as exc:
            missing.append(f"{mod} ({exc})")
            continue
        missing += [f"{mod}.{n}" for n in names if not _has(m, n)]
    if missing:
        raise ImportError(
            f"kvpool's SGLang backend supports SGLang {', '.join(SUPPORTED_SGLANG)}; SGLang {version} "
            f"lacks: {', '.join(missing)}"
        )
    if version not in SUPPORTED_SGLANG:
        log.warning("kvpool's SGLang backend is tested with SGLang %s, this is %s", SUPPORTED_SGLANG, version)
    return version


def register() -> None:
    """Entry point: make ``--disaggregation-transfer-backend kvpool`` work (idempotent)."""
    check_sglang()
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    _extend_enum(TransferBackend, "KVPOOL", BACKEND)
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class, HookType.AROUND)
