"""KvpoolHiCacheStorage: SGLang HiCache L3 storage backend over the kvpool store.

``--enable-hierarchical-cache --hicache-storage-backend dynamic
--hicache-storage-backend-extra-config '{"backend_name":"kvpool",
"module_path":"kvpool.connectors.sglang.hicache","class_name":"KvpoolHiCacheStorage",
"interface_v1":1,"master":"host:port"}'``

Extra-config keys of this backend (besides SGLang's): ``master`` (required: ``host:port`` of
``kvpool master``, or ``KVPOOL_MASTER``), ``hostname``, ``segment_size`` (DRAM this rank
contributes, default 0), ``buffer_size``, ``protocol``, ``secret``, ``key_tag`` (extra key prefix).

SGLang's page keys are SHA-256 chains over the tokens that already cover LoRA / ``extra_key`` and
``cache_salt`` (SGLang seeds the chain with ``storage_namespace_seed``), but not the KV layout;
objects are stored as ``kvpool/sgl/<tag>/<model>+ckpt-<digest>/<layout>/<key>_<tp_rank>of<tp_size>_k``
(the digest: :func:`~kvpool.connectors.checkpoint.checkpoint_tag` of the model path; and
``_v``; ``_pp<rank>`` for a pipeline stage, ``_cp<rank>of<size>`` for an attention context-parallel
rank, ``_dcp<rank>of<size>`` for a decode context-parallel one), one object per page and K/V
half, so ranks never collide. ``<layout>`` names the host pool's KV dtype, layout, page size
and bytes per token, and a pipeline stage's first layer unless 0 (set in
:meth:`register_mem_pool_host`): an fp8 pool, another head split, another page layout or a
stage holding other layers never reads these objects. Every read
checks each object's exact size; a shorter object is a failed page. The zero-copy v1 path moves
bytes straight between the host pool (registered once in :meth:`register_mem_pool_host`) and the
pool; ``batch_exists`` returns the leading run of pages whose objects all exist.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvpool.connectors.checkpoint import checkpoint_tag
from kvpool.errors import ConfigError, InvalidArgument, KvpoolError, ObjectExists
from kvpool.store.client import Store

log = logging.getLogger("kvpool.connectors.sglang")

_STORE_KEYS = ("hostname", "segment_size", "buffer_size", "protocol", "secret", "metadata")


def _model_path(name: str) -> str:
    """The model path in SGLang's storage model name: ``model_path``, or ``model_path-<tag>``
    where the host pool has a page format of its own (``storage_model_name``)."""
    if not os.path.exists(name) and "-" in name:
        head = name.rsplit("-", 1)[0]
        if os.path.exists(head):
            return head
    return name


def host_layout(hp: Any) -> str:
    """Namespace part naming a host pool's KV layout: dtype, layout, page size, bytes per token
    (covers head count x head dim x layers) and, for a pipeline stage that does not start at
    layer 0, its first layer (``-l<n>``): stages of other splits with as many layers hold other
    layers' KV."""
    dtype = str(getattr(hp, "dtype", "?")).replace("torch.", "")
    layout = str(getattr(hp, "layout", "?"))
    name = f"{dtype}-{layout}-p{getattr(hp, 'page_size', '?')}-t{getattr(hp, 'size_per_token', '?')}"
    start = getattr(hp, "start_layer", 0)
    return name if start == 0 else f"{name}-l{start}"


def page_parts(hp: Any, is_mla: bool) -> tuple[str, ...]:
    """Name suffixes of one page's objects: one per buffer the host pool gives for a page in
    ``get_page_buffer_meta`` (the v1 interface moves each buffer as one object). ``_k``/``_v``
    for the usual two (one for MLA's latent row in page-first layouts), ``_p<i>`` otherwise
    (layer-first layouts: a buffer per layer and half; MLA split layouts: latent, rope, index)."""
    page = int(getattr(hp, "logical_page_size", 0) or hp.page_size)
    try:
        n = len(hp.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))[0])
    except Exception as exc:  # noqa: BLE001 - a layout without zero-copy pages: the v1 calls fail as SGLang's do
        log.warning("kvpool HiCache: %s has no zero-copy page buffers (%s)", type(hp).__name__, exc)
        n = 1 if is_mla else 2
    if n == 1:
        return ("_k",)
    if n == 2 and not is_mla:
        return ("_k", "_v")
    return tuple(f"_p{i}" for i in range(n))


def _sizes_ok(res: list[Any], sizes: list[int]) -> list[bool]:
    """Per object: read without error and exactly ``sizes[i]`` bytes long."""
    return [not isinstance(r, KvpoolError) and r == n for r, n in zip(res, sizes, strict=True)]


class KvpoolHiCacheStorage(HiCacheStorage):
    """HiCache storage backend (SGLang ``dynamic`` backend, ``interface_v1``) on a kvpool store."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        master = extra.get("master") or os.environ.get("KVPOOL_MASTER")
        if not master:
            raise ConfigError(
                "KvpoolHiCacheStorage needs 'master' (host:port of `kvpool master`) in "
                "--hicache-storage-backend-extra-config or KVPOOL_MASTER"
            )
        opts = {k: extra[k] for k in _STORE_KEYS if k in extra}
        opts.setdefault("segment_size", 0)
        self.store = Store.connect(master=str(master), **opts)
        self.config = storage_config
        self.is_mla = bool(storage_config.is_mla_model)
        name = storage_config.model_name or "model"
        # the checkpoint's content (kvpool.connectors.checkpoint): a path or hub id alone lets a
        # redeployed or re-pointed checkpoint read another one's KV
        model = f"{name.replace('/', '_')}+ckpt-{checkpoint_tag(_model_path(name))}"
        tag = str(extra.get("key_tag") or "default")
        rank = "mla" if self.is_mla else f"{storage_config.tp_rank}of{storage_config.tp_size}"
        if getattr(storage_config, "pp_size", 1) > 1:
            rank += f"_pp{storage_config.pp_rank}"
        cp_size = int(getattr(storage_config, "attn_cp_size", 1) or 1)
        if cp_size > 1:  # each attention-CP rank holds its own slice of every page (NSA's CP)
            rank += f"_cp{storage_config.attn_cp_rank}of{cp_size}"
        dcp_size = int(getattr(storage_config, "dcp_size", 1) or 1)
        if dcp_size > 1:  # each decode-CP rank holds its own interleaved tokens of every page
            rank += f"_dcp{storage_config.dcp_rank}of{dcp_size}"
        self._base = f"kvpool/sgl/{tag}/{model}/"
        self.prefix = self._base + "nolayout/"  # until the host pool is registered
        self.suffix = f"_{rank}"
        self.mem_pool_host: Any = None
        self._registered = False
        # Objects per page of the legacy (copying) interface: its page tensors are split into
        # K and V halves (one latent part for MLA). The v1 path's parts come from the host pool.
        self._legacy_parts = ("_k",) if self.is_mla else ("_k", "_v")
        self._parts = self._legacy_parts

    # ------------------------------------------------------------------ memory
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Register the host KV pool once, so v1 gets/sets move bytes without staging copies."""
        super().register_mem_pool_host(mem_pool_host)
        buf = mem_pool_host.kv_buffer
        self.prefix = self._base + host_layout(mem_pool_host) + "/"
        self._parts = page_parts(mem_pool_host, self.is_mla)
        if not self._registered:
            self.store.register_buffer(buf.data_ptr(), buf.numel() * buf.element_size())
            self._registered = True

    def _names(self, keys: list[str], parts: tuple[str, ...] | None = None) -> list[str]:
        """Object names of ``keys``' pages: one per part (the v1 parts unless ``parts``)."""
        return [f"{self.prefix}{k}{self.suffix}{h}" for k in keys for h in parts or self._parts]

    @property
    def _per_page(self) -> int:
        return len(self._parts)

    def _meta(self, keys: list[str], host_indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """The host pool's (pointers, sizes) for ``keys``' pages: ``len(self._parts)`` per page,
        else InvalidArgument (nothing is read or written)."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) != len(keys) * self._per_page or len(sizes) != len(ptrs):
            raise InvalidArgument(
                f"host pool gave {len(ptrs)} buffers for {len(keys)} pages, "
                f"expected {self._per_page} per page"
            )
        return list(ptrs), list(sizes)

    # ------------------------------------------------------------------ v1 (zero copy)
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Number of leading pages whose objects all exist."""
        if not keys:
            return 0
        try:
            found = self.store.batch_exists(self._names(keys))
        except KvpoolError as exc:
            log.warning("kvpool HiCache: exists failed: %s", exc)
            return 0
        per = self._per_page
        for i in range(len(keys)):
            if not all(found[i * per : (i + 1) * per]):
                return i
        return len(keys)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Read pages into the host pool slots ``host_indices``; per page success."""
        if not keys:
            return []
        try:
            ptrs, sizes = self._meta(keys, host_indices)
            res = self.store.batch_get_into(self._names(keys), ptrs, sizes)
        except KvpoolError as exc:
            log.warning("kvpool HiCache: get failed: %s", exc)
            return [False] * len(keys)
        per = self._per_page
        ok = _sizes_ok(res, sizes)
        return [all(ok[i * per : (i + 1) * per]) for i in range(len(keys))]

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Write pages from the host pool slots ``host_indices``; pages already stored count as done."""
        if not keys:
            return []
        names = self._names(keys)
        try:
            ptrs, sizes = self._meta(keys, host_indices)
            have = self.store.batch_exists(names)
            todo = [i for i, h in enumerate(have) if not h]
            res: list[Any] = [None] * len(names)
            if todo:
                out = self.store.batch_put_from(
                    [names[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo]
                )
                for i, r in zip(todo, out, strict=True):
                    res[i] = r
        except KvpoolError as exc:
            log.warning("kvpool HiCache: set failed: %s", exc)
            return [False] * len(keys)
        per = self._per_page
        ok = [r is None or isinstance(r, ObjectExists) for r in res]
        return [all(ok[i * per : (i + 1) * per]) for i in range(len(keys))]

    # ------------------------------------------------------------------ legacy interface
    def exists(self, key: str) -> bool:
        """Legacy interface: whether the page stored through it (:meth:`set`) exists."""
        try:
            return all(self.store.batch_exists(self._names([key], self._legacy_parts)))
        except KvpoolError as exc:
            log.warning("kvpool HiCache: exists failed: %s", exc)
            return False

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """One page into ``target_location`` (a tensor or a host-pool index tensor)."""
        res = self.batch_get([key], [target_location] if target_location is not None else None)
        return res[0] if isinstance(res, list) else None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        """Legacy path: ``target_locations`` are flat tensors of one page each (K then V halves)."""
        if target_locations is None:
            return [None] * len(keys)
        names = self._names(keys, self._legacy_parts)
        views, sizes = [], []
        per = len(self._legacy_parts)
        for t in target_locations:
            flat = t.reshape(-1).view(torch.uint8)
            half = flat.numel() // per
            for h in range(per):
                views.append(flat[h * half : (h + 1) * half])  # registered for the call
                sizes.append(half)
        try:
            res = self.store.batch_get_into(names, views, sizes)
        except KvpoolError as exc:  # the master or a peer unreachable: misses, never an exception
            log.warning("kvpool HiCache: get failed: %s", exc)
            return [None] * len(keys)
        ok = _sizes_ok(res, sizes)
        return [t if all(ok[i * per : (i + 1) * per]) else None for i, t in enumerate(target_locations)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Legacy path: each value a tensor holding one page (K then V halves)."""
        if values is None:
            return False
        names, payloads = self._names(keys, self._legacy_parts), []
        per = len(self._legacy_parts)
        for t in values:
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            half = len(raw) // per
            payloads += [raw[h * half : (h + 1) * half] for h in range(per)]
        try:
            res = self.store.batch_put(names, payloads)
        except KvpoolError as exc:
            log.warning("kvpool HiCache: set failed: %s", exc)
            return False
        return all(r is None or isinstance(r, ObjectExists) for r in res)

    def clear(self) -> None:
        """No-op: the pool is shared with other instances, and the master's eviction reclaims
        space; removing objects here would take prefixes away from everyone."""
        return None

    def close(self) -> None:
        self.store.close()
