"""SGLang HiCache with the kvpool backend in a plain process (run by the SGLang interpreter):
SGLang's real MHATokenToKVPoolHost (page_first, bf16) and StorageBackendFactory ("dynamic"),
kvpool's KvpoolHiCacheStorage against a kvpool master in another process. Prints one JSON line.

    python tests/sglang_hicache_proc.py write|read <master> <n_pages>
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import xxhash
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

L, PAGE, H, D = 4, 16, 2, 64


def host_pool(dtype: torch.dtype = torch.bfloat16) -> MHATokenToKVPoolHost:
    tokens = 64 * PAGE
    k = [torch.zeros(tokens + PAGE, H, D, dtype=dtype) for _ in range(L)]
    v = [torch.zeros(tokens + PAGE, H, D, dtype=dtype) for _ in range(L)]
    ptrs = [torch.tensor([t.data_ptr() for t in x], dtype=torch.uint64) for x in (k, v)]
    bufs = KVBuffers(
        k=tuple(k), v=tuple(v), k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=KVBufferLayout.NHD
    )
    info = MHABufferInfo(
        buffers=bufs,
        page_size=PAGE,
        head_num=H,
        head_dim=D,
        v_head_dim=D,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        "page_first",
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=tokens,
        start_layer=0,
        end_layer=L,
    )


def page_keys(n: int) -> list[str]:
    """SHA-256 chain per page, as SGLang names storage pages."""
    keys, prior = [], ""
    for i in range(n):
        prior = hashlib.sha256(f"{prior}:{i}".encode()).hexdigest()
        keys.append(prior)
    return keys


def page_digests(hp: MHATokenToKVPoolHost, indices: torch.Tensor) -> list[str]:
    ptrs, sizes = hp.get_page_buffer_meta(indices)
    base = hp.kv_buffer.data_ptr()
    raw = hp.kv_buffer.reshape(-1).view(torch.uint8).numpy()
    return [xxhash.xxh3_64_hexdigest(raw[p - base : p - base + s]) for p, s in zip(ptrs, sizes, strict=True)]


def main() -> None:
    role, master, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="tiny-test",
        extra_config={
            "backend_name": "kvpool",
            "module_path": "kvpool.connectors.sglang.hicache",
            "class_name": "KvpoolHiCacheStorage",
            "interface_v1": 1,
            "master": master,
        },
    )
    hp = host_pool()
    backend = StorageBackendFactory.create_backend("dynamic", cfg, hp)
    backend.register_mem_pool_host(hp)  # as SGLang's cache controller does after construction
    keys = page_keys(n)
    out: dict = {"backend": type(backend).__name__}
    if role == "write":
        idx = hp.alloc(n * PAGE)
        g = torch.Generator().manual_seed(11)
        hp.kv_buffer.copy_(torch.randn(hp.kv_buffer.shape, generator=g).to(torch.bfloat16))
        out["before"] = backend.batch_exists(keys)
        out["set"] = backend.batch_set_v1(keys, idx)
        out["set_again"] = backend.batch_set_v1(keys, idx)  # already stored: still success
        out["exists"] = backend.batch_exists(keys)
        out["exists_with_gap"] = backend.batch_exists(keys[:3] + ["0" * 64] + keys[3:])
        out["digests"] = page_digests(hp, idx)
        # the legacy (copying) interface
        page = torch.randn(2, L, PAGE, H, D, generator=g).to(torch.bfloat16)
        out["legacy_set"] = backend.set("legacy-" + keys[0], page)
        got = torch.zeros_like(page)
        out["legacy_get"] = backend.get("legacy-" + keys[0], got) is not None and bool(torch.equal(got, page))
    else:
        hp.alloc(5 * PAGE)  # land in other host slots than the writer used
        idx = hp.alloc(n * PAGE)
        out["exists"] = backend.batch_exists(keys)
        out["get"] = backend.batch_get_v1(keys, idx)
        out["digests"] = page_digests(hp, idx)
        out["missing"] = backend.batch_get_v1(["f" * 64], hp.alloc(PAGE))
        # A host pool with another KV dtype (same tokens, same SGLang keys) shares nothing.
        hp2 = host_pool(torch.float16)
        other = StorageBackendFactory.create_backend("dynamic", cfg, hp2)
        other.register_mem_pool_host(hp2)
        out["other_layout_exists"] = other.batch_exists(keys)
        other.close()
        # A stored object shorter than the page half is a failed page, never a success.
        name = backend._names([keys[0]])[0]
        backend.store.remove(name, force=True)
        backend.store.put(name, b"\x01" * 64)
        out["short"] = backend.batch_get_v1(keys[:2], hp.alloc(2 * PAGE))
    backend.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
