"""A target process for the CUDA IPC tests (run with KVPOOL_CUDA_DRIVER pointing at the fake
driver), ``cuda_ipc_peer.py NBUFS SIZE [PORT]``: registers GPU buffers, one shared host buffer and
one plain host buffer (no GPU copy reaches it: staged; with ``KVPOOL_TEST_PEER_ALLOC=torch`` on a real
GPU the GPU buffers are slices of one torch tensor, 4 KiB past its start), prints one JSON line
{"name", "gpu": [addr...], "shm": addr, "host": addr}, then answers stdin commands one line each:
``dump ADDR LEN`` -> hex sha256 of the bytes; ``fill ADDR LEN SEED`` -> ok; ``unregister ADDR`` ->
ok or the error; ``exit``."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from kvpool import TransferEngine, _native
from kvpool.transfer.cuda_driver import load_driver


class Peer:
    """This script in a child process (the tests' target): ``name``, ``gpu``, ``shm`` and ``host``
    from its JSON line; :meth:`ask` sends one command and returns the answer."""

    def __init__(self, nbufs: int, size: int, port: int = 0, env: dict[str, str] | None = None) -> None:
        self.p = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), str(nbufs), str(size), str(port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1],
            env=env,
        )  # fmt: skip
        info = json.loads(self.p.stdout.readline())  # type: ignore[union-attr]
        self.name: str = info["name"]
        self.gpu: list[int] = info["gpu"]
        self.shm: int = info["shm"]
        self.host: int = info["host"]

    def ask(self, line: str) -> str:
        self.p.stdin.write(line + "\n")  # type: ignore[union-attr]
        self.p.stdin.flush()  # type: ignore[union-attr]
        return self.p.stdout.readline().strip()  # type: ignore[union-attr]

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.ask("exit")
            except (BrokenPipeError, OSError):
                pass
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def main() -> None:
    nbufs, size = int(sys.argv[1]), int(sys.argv[2])
    port = int(sys.argv[3]) if len(sys.argv) > 3 else 0  # a restarted owner keeps its segment name
    drv = load_driver()
    assert drv is not None, "the fake CUDA driver did not load"
    eng = TransferEngine(timeout_s=5.0, port=port)
    gpu = []
    keep = []
    if os.environ.get("KVPOOL_TEST_PEER_ALLOC") == "torch":  # real GPU only: torch's caching allocator
        import torch  # one tensor, buffers 4 KiB past its start: inside one cudaMalloc block

        big = torch.zeros(nbufs * size + 4096, dtype=torch.uint8, device="cuda:0")
        keep.append(big)
        for k in range(nbufs):
            t = big[4096 + k * size : 4096 + (k + 1) * size]
            eng.register_local_memory(t)
            gpu.append(t.data_ptr())
    else:
        for k in range(nbufs):
            p = drv.alloc(size, k % drv.count)
            eng.register_local_memory(p, size, location=f"cuda:{k % drv.count}")
            gpu.append(p)
    shm = eng.alloc_shared_buffer(size)
    shm_addr = _native.buffer_address(shm)[0]
    host = bytearray(size)
    hbase = _native.buffer_address(host)[0]
    plain = bytearray(size)
    plain_addr = eng.register_local_memory(plain)
    info = {"name": eng.segment_name, "gpu": gpu, "shm": shm_addr, "host": plain_addr}
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "dump":
                a, n = int(args[0]), int(args[1])
                if a in gpu or any(g <= a < g + size for g in gpu):
                    drv.memcpy(hbase, a, n)
                    data = bytes(host[:n])
                elif plain_addr <= a < plain_addr + size:
                    data = bytes(plain[a - plain_addr : a - plain_addr + n])
                else:
                    data = bytes(shm[a - shm_addr : a - shm_addr + n])
                print(hashlib.sha256(data).hexdigest(), flush=True)
            elif cmd == "fill":
                a, n, seed = int(args[0]), int(args[1]), int(args[2])
                _native.fill_pattern(hbase, n, seed)
                drv.memcpy(a, hbase, n)
                print("ok", flush=True)
            elif cmd == "unregister":
                eng.unregister_local_memory(int(args[0]))
                print("ok", flush=True)
            elif cmd == "exit":
                break
        except Exception as exc:  # noqa: BLE001 - reported to the test
            print(f"error {type(exc).__name__}: {exc}", flush=True)
    eng.close()


if __name__ == "__main__":
    main()
