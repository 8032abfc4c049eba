"""SGLang HiCache with the kvpool backend in a plain process (run by the SGLang interpreter):
SGLang's real host pools (MHATokenToKVPoolHost, MLATokenToKVPoolHost) and StorageBackendFactory
("dynamic"), kvpool's KvpoolHiCacheStorage against a kvpool master in another process. Prints one
JSON line.

    python tests/sglang_hicache_proc.py write|read <master> <n_pages>
    python tests/sglang_hicache_proc.py pages-write|pages-read <master> <n_pages> mha|mla <layout> \
        <tp_rank> <tp_size> [<start_layer> <pp_rank> <pp_size> <cp_rank> <cp_size> [<dcp_rank> <dcp_size>]]
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import xxhash
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

L, PAGE, H, D = 4, 16, 2, 64
LORA, ROPE = 32, 16  # MLA: latent and rope widths of one token's row


def pool_args(layout: str) -> tuple:
    """Positional arguments every SGLang host pool takes: host/device ratio 2, no fixed host
    size, the page size, the layout."""
    return (2.0, 0, PAGE, layout)


def pool_kwargs(tokens: int, start_layer: int = 0) -> dict:
    """Keyword arguments every SGLang host pool of these tests takes: plain CPU memory, L layers
    from ``start_layer`` (a pipeline stage's first layer)."""
    return {
        "pin_memory": False,
        "device": "cpu",
        "device_capacity_tokens": tokens,
        "start_layer": start_layer,
        "end_layer": start_layer + L,
    }


def host_pool(
    dtype: torch.dtype = torch.bfloat16, layout: str = "page_first", start_layer: int = 0
) -> MHATokenToKVPoolHost:
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
    return MHATokenToKVPoolHost(info, *pool_args(layout), **pool_kwargs(tokens, start_layer))


def mla_pool(layout: str) -> MLATokenToKVPoolHost:
    """SGLang's MLA host pool over L layers of one latent row (LORA + ROPE) per token."""
    tokens = 64 * PAGE
    rows = tuple(torch.zeros(tokens + PAGE, 1, LORA + ROPE, dtype=torch.bfloat16) for _ in range(L))
    info = MLABufferInfo(
        buffers=rows,
        data_ptrs=torch.tensor([r.data_ptr() for r in rows], dtype=torch.uint64),
        layer_indices=tuple(range(L)),
        device_layer_num=L,
        page_size=PAGE,
        kv_lora_rank=LORA,
        qk_rope_head_dim=ROPE,
        kv_cache_dim=LORA + ROPE,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    return MLATokenToKVPoolHost(info, *pool_args(layout), **pool_kwargs(tokens), target_layer_num=L)


def page_keys(n: int) -> list[str]:
    """SHA-256 chain per page, as SGLang names storage pages."""
    keys, prior = [], ""
    for i in range(n):
        prior = hashlib.sha256(f"{prior}:{i}".encode()).hexdigest()
        keys.append(prior)
    return keys


def page_digests(hp: MHATokenToKVPoolHost | MLATokenToKVPoolHost, indices: torch.Tensor) -> list[str]:
    ptrs, sizes = hp.get_page_buffer_meta(indices)
    base = hp.kv_buffer.data_ptr()
    raw = hp.kv_buffer.reshape(-1).view(torch.uint8).numpy()
    return [xxhash.xxh3_64_hexdigest(raw[p - base : p - base + s]) for p, s in zip(ptrs, sizes, strict=True)]


def storage_config(
    master: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    page_first: bool = True,
    pp: tuple[int, int] = (0, 1),
    cp: tuple[int, int] = (0, 1),
    dcp: tuple[int, int] = (0, 1),
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp[0],
        pp_size=pp[1],
        attn_cp_rank=cp[0],
        attn_cp_size=cp[1],
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=page_first,
        model_name="tiny-test",
        dcp_rank=dcp[0],
        dcp_size=dcp[1],
        logical_page_size=PAGE * dcp[1],
        extra_config={
            "backend_name": "kvpool",
            "module_path": "kvpool.connectors.sglang.hicache",
            "class_name": "KvpoolHiCacheStorage",
            "interface_v1": 1,
            "master": master,
        },
    )


def pages(
    role: str,
    master: str,
    n: int,
    kind: str,
    layout: str,
    tp_rank: int,
    tp_size: int,
    start_layer: int = 0,
    pp: tuple[int, int] = (0, 1),
    cp: tuple[int, int] = (0, 1),
    dcp: tuple[int, int] = (0, 1),
) -> dict:
    """One rank of a TP group (of pipeline stage ``pp`` = (rank, size), its layers from
    ``start_layer``, MHA only; of attention context-parallel group ``cp`` = (rank, size)) writes or
    reads ``n`` pages through the v1 interface."""
    hp = mla_pool(layout) if kind == "mla" else host_pool(layout=layout, start_layer=start_layer)
    cfg = storage_config(master, tp_rank, tp_size, kind == "mla", layout.startswith("page"), pp, cp, dcp)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, hp)
    backend.register_mem_pool_host(hp)
    keys = page_keys(n)
    out: dict = {"parts": list(backend._parts), "before": backend.batch_exists(keys)}
    if role == "pages-write":
        idx = hp.alloc(n * PAGE)
        g = torch.Generator().manual_seed(7 + tp_rank)
        hp.kv_buffer.copy_(torch.randn(hp.kv_buffer.shape, generator=g).to(hp.kv_buffer.dtype))
        out["set"] = backend.batch_set_v1(keys, idx)
    else:
        hp.alloc(3 * PAGE)  # other host slots than the writer's
        idx = hp.alloc(n * PAGE)
        out["get"] = backend.batch_get_v1(keys, idx)
    out["exists"] = backend.batch_exists(keys)
    out["digests"] = page_digests(hp, idx)
    out["objects"] = len(backend._names(keys))
    backend.close()
    return out


def outage(master: str) -> dict:
    """Store a page, then (once the test killed the master: a line on stdin) use every interface:
    misses and failed writes, never an exception into SGLang."""
    hp = host_pool()
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(master), hp)
    backend.register_mem_pool_host(hp)
    keys = page_keys(2)
    idx = hp.alloc(2 * PAGE)
    page = torch.randn(2, L, PAGE, H, D).to(torch.bfloat16)
    out: dict = {
        "set_before": backend.batch_set_v1(keys, idx),
        "legacy_set_before": backend.set("legacy", page),
    }
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    got = torch.zeros_like(page)
    hit = backend.get("legacy", got) is not None  # a client's cached location may still serve it
    out.update(
        legacy_get="miss" if not hit else "right bytes" if torch.equal(got, page) else "WRONG BYTES",
        legacy_set=backend.set("legacy-2", page),
        legacy_exists=backend.exists("legacy"),
        exists=backend.batch_exists(keys),
        get=backend.batch_get_v1(keys, hp.alloc(2 * PAGE)),
        set=backend.batch_set_v1(page_keys(3)[2:], hp.alloc(PAGE)),
    )
    return out


def main() -> None:
    role, master, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if role == "outage":
        print(json.dumps(outage(master)), flush=True)
        return
    if role.startswith("pages-"):
        kind, layout, rank, size = sys.argv[4], sys.argv[5], int(sys.argv[6]), int(sys.argv[7])
        start, pp_rank, pp_size, cp_rank, cp_size = (int(a) for a in (sys.argv[8:13] or (0, 0, 1, 0, 1)))
        dcp_rank, dcp_size = (int(a) for a in (sys.argv[13:15] or (0, 1)))
        pp, cp, dcp = (pp_rank, pp_size), (cp_rank, cp_size), (dcp_rank, dcp_size)
        got = pages(role, master, n, kind, layout, rank, size, start, pp, cp, dcp)
        print(json.dumps(got), flush=True)
        return
    if role == "prefixes":  # the key prefix for each model name given
        prefixes = []
        for name in sys.argv[4:]:
            cfg = storage_config(master)
            cfg.model_name = name
            b = StorageBackendFactory.create_backend("dynamic", cfg, host_pool())
            prefixes.append(b._base)
            b.close()
        print(json.dumps({"prefixes": prefixes}), flush=True)
        return
    cfg = storage_config(master)
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
