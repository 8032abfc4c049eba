"""vLLM KV connectors (KV connector v1): P/D over the transfer engine, prefix reuse over the store.

``kv_connector_module_path: "kvpool.connectors.vllm"`` with ``kv_connector`` one of
``KvpoolConnector`` or ``KvpoolStoreConnector``; or install kvpool and use the short names alone
(the ``vllm.general_plugins`` entry point calls :func:`register`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvpoolConnector", "KvpoolStoreConnector", "register"]


def register() -> None:
    """vLLM plugin hook: make ``KvpoolConnector``/``KvpoolStoreConnector`` known to vLLM by name."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, mod in (
        ("KvpoolConnector", "kvpool.connectors.vllm.pd"),
        ("KvpoolStoreConnector", "kvpool.connectors.vllm.store"),
    ):
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, mod, name)


def __getattr__(name: str) -> Any:  # lazy: importing kvpool.connectors.vllm must not import vLLM
    if name == "KvpoolConnector":
        from kvpool.connectors.vllm.pd import KvpoolConnector

        return KvpoolConnector
    if name == "KvpoolStoreConnector":
        from kvpool.connectors.vllm.store import KvpoolStoreConnector

        return KvpoolStoreConnector
    raise AttributeError(name)
