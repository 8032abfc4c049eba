"""GPU memory as a TCP target: the C++ server serves READs of, and accepts WRITEs into, a peer's
GPU regions by staging through pinned memory (CUDA driver loaded at run time), across real
processes on the fake CUDA driver (whose device pointers the CPU cannot touch: a server that read
or wrote GPU memory directly would crash the peer)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool import OpCode, TransferEngine, _native
from kvpool.errors import KvpoolError, RemoteAccessError, TransferError
from kvpool.transfer.cuda_driver import load_driver
from tests.cuda_ipc_peer import Peer

ROOT = Path(__file__).resolve().parents[1]
SIZE = 8 << 20


@pytest.fixture
def peer(fake_driver: str) -> Iterator[Peer]:
    p = Peer(1, SIZE)
    yield p
    p.close()


def _pattern(n: int, seed: int) -> bytearray:
    b = bytearray(n)
    _native.fill_pattern(_native.buffer_address(b)[0], n, seed)
    return b


def test_tcp_write_and_read_peer_gpu_multichunk_and_scattered(peer: Peer) -> None:
    g = peer.gpu[0]
    with TransferEngine(protocol="tcp", timeout_s=10.0) as eng:
        data = _pattern((3 << 20) + 5, 1)  # > the server's 1 MiB staging piece, odd length
        back = bytearray(len(data))
        eng.register_local_memory(data)
        eng.register_local_memory(back)
        a, b = _native.buffer_address(data)[0], _native.buffer_address(back)[0]
        eng.transfer_sync(peer.name, a, g + 3, len(data))
        assert peer.ask(f"dump {g + 3} {len(data)}") == hashlib.sha256(data).hexdigest()
        eng.transfer_sync(peer.name, b, g + 3, len(data), OpCode.READ)
        assert back == data
        # scattered 4 KiB blocks, both directions, in one batch each
        n, blk = 256, 4096
        rems = [g + (4 << 20) + ((k * 37) % 1024) * blk for k in range(n)]
        assert eng.batch_transfer_sync(peer.name, [a + k * blk for k in range(n)], rems, [blk] * n) == n * blk
        back[:] = bytes(len(back))
        assert eng.batch_transfer_sync(peer.name, [b + k * blk for k in range(n)], rems, [blk] * n,
                                       OpCode.READ) == n * blk  # fmt: skip
        assert back[: n * blk] == data[: n * blk]


def test_tcp_local_gpu_to_peer_gpu(peer: Peer) -> None:
    drv = load_driver()
    with TransferEngine(protocol="tcp", timeout_s=10.0) as eng:
        mine = drv.alloc(2 << 20, 0)
        eng.register_local_memory(mine, 2 << 20, location="cuda:0", remote_accessible=False)
        data = _pattern(2 << 20, 5)
        drv.memcpy(mine, _native.buffer_address(data)[0], len(data))
        eng.transfer_sync(peer.name, mine, peer.gpu[0], 2 << 20)  # staged here, staged there
        assert peer.ask(f"dump {peer.gpu[0]} {2 << 20}") == hashlib.sha256(data).hexdigest()


def test_tcp_bounds_and_unregistered_gpu_region_refused(peer: Peer) -> None:
    g = peer.gpu[0]
    with TransferEngine(protocol="tcp", timeout_s=10.0) as eng:
        buf = bytearray(1 << 20)
        a = eng.register_local_memory(buf)
        with pytest.raises((RemoteAccessError, TransferError)):
            eng.transfer_sync(peer.name, a, g + SIZE - 100, 4096)  # runs past the region
        eng.transfer_sync(peer.name, a, g, 4096)
        assert peer.ask(f"unregister {g}") == "ok"
        with pytest.raises(TransferError):  # our cached descriptor still lists it: the target refuses
            eng.transfer_sync(peer.name, a, g, 4096)
        with pytest.raises(TransferError):
            eng.transfer_sync(peer.name, a, g, 4096, OpCode.READ)


def test_same_host_initiator_without_cuda_reaches_gpu_through_the_server(peer: Peer) -> None:
    """An initiator whose CUDA driver does not load (protocol auto, same host): GPU regions have no
    same-host fence slot, so its requests go to the server, which stages them."""
    code = textwrap.dedent(
        f"""
        import hashlib
        from kvpool import TransferEngine, _native
        with TransferEngine(timeout_s=10.0) as eng:
            assert "cuda_ipc" not in eng.local_descriptor().protocols
            data = bytearray(1 << 20)
            _native.fill_pattern(_native.buffer_address(data)[0], len(data), 9)
            a = eng.register_local_memory(data)
            eng.transfer_sync({peer.name!r}, a, {peer.gpu[0]}, len(data))
            print(hashlib.sha256(data).hexdigest())
        """
    )
    env = dict(os.environ, FAKECUDA_DEVICES="0")  # the driver loads and sees no device: CPU paths
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert peer.ask(f"dump {peer.gpu[0]} {1 << 20}") == out.stdout.strip()


@pytest.mark.parametrize("op", ["write", "read"])
def test_unregister_during_pipelined_gpu_transfer(fake_driver: str, op: str) -> None:
    """A peer whose (fake) device copies are slow (20 ms each): the server's pipelined staging has a
    copy in flight when the GPU region is unregistered. Unregister returns only after that copy;
    afterwards no byte lands in the region, and the transfer either failed or moved every byte."""
    info = Peer(1, SIZE, env=dict(os.environ, FAKECUDA_DELAY_US="20000"))
    g = info.gpu[0]
    try:
        assert info.ask(f"fill {g} {SIZE} 11") == "ok"
        with TransferEngine(protocol="tcp", timeout_s=30.0) as eng:
            data = _pattern(SIZE, 12)
            a = eng.register_local_memory(data)
            before = hashlib.sha256(data).hexdigest()
            eng.transfer_sync(info.name, a, g, 4096, OpCode.READ)  # connected, descriptor cached
            filled = info.ask(f"dump {g} {SIZE}")
            if op == "read":
                data[:] = bytes(SIZE)
            result: dict = {}

            def go() -> None:
                try:
                    eng.transfer_sync(info.name, a, g, SIZE, OpCode.READ if op == "read" else OpCode.WRITE)
                    result["ok"] = True
                except KvpoolError as exc:
                    result["err"] = exc

            t = threading.Thread(target=go)
            t.start()
            # not a timing assertion: any interleaving must satisfy the checks below
            if op == "write":  # unregister once the first staged piece landed
                while info.ask(f"dump {g} {SIZE}") == filled and t.is_alive():
                    pass
            else:
                time.sleep(0.05)
            assert info.ask(f"unregister {g}") == "ok"
            h1 = info.ask(f"dump {g} {SIZE}")
            t.join(60)
            assert not t.is_alive()
            assert info.ask(f"dump {g} {SIZE}") == h1  # nothing landed after unregister returned
            if op == "write" and "ok" in result:
                assert h1 == before
            if op == "read" and "ok" in result:
                assert hashlib.sha256(data).hexdigest() == h1
            assert result, "the transfer neither completed nor failed"
    finally:
        info.close()


def test_unregister_of_served_gpu_memory_whose_native_unregister_raises_finishes_and_raises(
    fake_driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The native unregister of GPU memory the server serves raises RegistrationError (it did
    unregister and fence the region, but a peer still pins it past timeout_s): unregister finishes
    all the same (gone from the registry, the served set, the descriptor and the CUDA IPC exports,
    the memory kept referenced) and raises it, as for host memory. The registration stayed
    everywhere, published, and every later unregister failed natively (not registered there).
    The native engine cannot pin GPU memory past its timeout today (no fence slot for it): only
    its answer is injected here, after the real native unregister ran."""
    from kvpool.errors import AddressNotRegistered, RegistrationError

    drv = load_driver()
    with TransferEngine(timeout_s=0.5) as eng:
        g = drv.alloc(1 << 20, 0)
        eng.register_local_memory(g, 1 << 20, location="cuda:0")
        assert g in eng._served_gpu and g in [b.addr for b in eng.local_descriptor().buffers]
        native = eng._native

        class _StillPinned:  # the native engine, answering that a peer still pins the region
            def __getattr__(self, name: str) -> object:
                return getattr(native, name)

            def unregister_memory(self, addr: int) -> None:
                native.unregister_memory(addr)
                raise RegistrationError("unregistered, but a peer is stopped inside a copy into this buffer")

        monkeypatch.setattr(eng, "_native", _StillPinned())
        with pytest.raises(RegistrationError, match="stopped inside a copy"):
            eng.unregister_local_memory(g)
        monkeypatch.setattr(eng, "_native", native)
        assert eng._registry.get(g) is None and g not in eng._served_gpu and len(eng._fenced) == 1
        assert g not in [b.addr for b in eng.local_descriptor().buffers]
        assert not eng.local_descriptor().cuda_ipc["bufs"]  # the CUDA IPC export is retired too
        with pytest.raises(AddressNotRegistered):
            eng.unregister_local_memory(g)  # gone everywhere, not half-registered
        eng.register_local_memory(g, 1 << 20, location="cuda:0")  # the range is usable again
        eng.unregister_local_memory(g)
        drv.free(g)
