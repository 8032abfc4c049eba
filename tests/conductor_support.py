"""Helpers for the conductor's real-engine tests and benchmark: vLLM CPU servers publishing KV
events, an independent KV-event mirror, and ``kvpool proxy --backends ... --policy ...`` as a child.

* :func:`kv_events_args` -- the ``--kv-events-config`` of a server publishing on a loopback port.
* :class:`EventMirror` -- subscribes to servers' publishers itself (separately from the proxy) and
  keeps, per server, the engine block hashes stored and not removed, and the token ids of each
  stored block: the ground truth the proxy's index is compared with.
* :class:`RouterProxy` -- ``kvpool proxy`` in a child process (stopped by SIGTERM).
* :func:`start_servers` -- N tiny-model servers with KV events, started together.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack

from kvpool.child import ChildProcess
from tests.vllm_support import VllmServer

__all__ = ["EventMirror", "RouterProxy", "kv_events_args", "start_servers"]

BLOCK = 32


def kv_events_args(endpoint: str) -> list[str]:
    """vLLM binds its publisher only for ``tcp://*:PORT`` (every interface) or ``ipc://``; given a
    host it *connects*. Tests use ``ipc://`` (local only; any number of subscribers)."""
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": ""}
    return ["--kv-events-config", json.dumps(cfg)]


def start_servers(model: Path, logs: Path, n: int = 3, kv_bytes: int = 256 << 20,
                  block_size: int = BLOCK) -> tuple[list[VllmServer], list[str]]:  # fmt: skip
    """``n`` servers with KV events (not yet ready: call ``wait_ready`` on each) and their
    publisher addresses."""
    servers, endpoints = [], []
    sock_dir = Path(tempfile.mkdtemp(prefix="kvev-"))
    for k in range(n):
        endpoints.append(f"ipc://{sock_dir}/{k}.sock")
        s = VllmServer(model, logs, name=f"conductor{k}", kv_cache_bytes=kv_bytes, block_size=block_size,
                       max_num_seqs=4, extra_args=kv_events_args(endpoints[-1]))  # fmt: skip
        servers.append(s.start())
    return servers, endpoints


class EventMirror(threading.Thread):
    """Per endpoint: engine hashes stored minus removed, and the first block's token ids seen."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        super().__init__(daemon=True, name="event-mirror")
        self.endpoints = list(endpoints)
        self.blocks: list[set[Any]] = [set() for _ in endpoints]
        self.tokens: list[list[tuple[int, ...]]] = [[] for _ in endpoints]
        self.batches = [0] * len(endpoints)
        self.lock = threading.Lock()
        self._stop = threading.Event()

    def run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        socks = []
        poller = zmq.Poller()
        for ep in self.endpoints:
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            poller.register(s, zmq.POLLIN)
            socks.append(s)
        try:
            while not self._stop.is_set():
                for s, _ in poller.poll(100):
                    k = socks.index(s)
                    _, _, payload = s.recv_multipart()
                    self._apply(k, msgpack.unpackb(payload, raw=False))
        finally:
            for s in socks:
                s.close(0)

    def _apply(self, k: int, batch: list[Any]) -> None:
        with self.lock:
            self.batches[k] += 1
            for ev in batch[1]:
                kind = ev.get("type")
                hs = [h if not isinstance(h, list) else tuple(h) for h in ev.get("block_hashes") or []]
                if kind == "BlockStored":
                    self.blocks[k].update(hs)
                    toks = ev.get("token_ids") or []
                    bs = ev.get("block_size") or BLOCK
                    self.tokens[k].extend(tuple(toks[i : i + bs]) for i in range(0, len(toks), bs))
                elif kind == "BlockRemoved":
                    self.blocks[k].difference_update(hs)
                elif kind == "AllBlocksCleared":
                    self.blocks[k].clear()

    def holder_of(self, block_tokens: Sequence[int]) -> list[int]:
        """Servers whose events stored a block with exactly these token ids."""
        t = tuple(block_tokens)
        with self.lock:
            return [k for k in range(len(self.endpoints)) if t in self.tokens[k]]

    def counts(self) -> list[int]:
        with self.lock:
            return [len(b) for b in self.blocks]

    def stop(self) -> None:
        self._stop.set()


class RouterProxy(ChildProcess):
    """``kvpool proxy --backends URLS --policy POLICY ...`` in a child process."""

    def __init__(self, backends: Sequence[str], policy: str, *extra: str) -> None:
        cmd = [sys.executable, "-m", "kvpool.cli", "proxy", "--port", "0", "--health-interval-s", "1",
               "--backends", *backends, "--policy", policy, *extra]  # fmt: skip
        super().__init__(cmd, stdin=False)
        self.url = f"http://127.0.0.1:{self.info['port']}"


def wait_until(pred: Any, timeout: float = 10.0, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())
