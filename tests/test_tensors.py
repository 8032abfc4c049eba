"""Torch tensors: registration with the engine and the store's tensor helpers (CPU torch)."""

from __future__ import annotations

import torch

from kvpool import OpCode, Store, TransferEngine
from kvpool.transfer.peer import PeerProcess


def test_register_tensor_and_transfer(peer: PeerProcess) -> None:
    t = torch.arange(4096, dtype=torch.float32)
    with TransferEngine(protocol="tcp") as eng:
        addr = eng.register_local_memory(t)
        assert addr == t.data_ptr()
        eng.transfer_sync(peer.segment, addr, peer.addr, t.numel() * 4, OpCode.WRITE)
        back = torch.zeros_like(t)
        baddr = eng.register_local_memory(back)
        eng.transfer_sync(peer.segment, baddr, peer.addr, back.numel() * 4, OpCode.READ)
        assert torch.equal(back, t)


def test_store_tensor_roundtrip() -> None:
    with Store.connect(segment_size=16 << 20) as st:
        for i, t in enumerate(
            [
                torch.randn(3, 5, 7),
                torch.arange(100, dtype=torch.int64).reshape(10, 10)[:, ::2],  # non-contiguous
                torch.randn(8, 16).to(torch.bfloat16),
                torch.tensor([True, False, True]),
            ]
        ):
            st.put_tensor(f"t{i}", t)
            got = st.get_tensor(f"t{i}")
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t.contiguous())
