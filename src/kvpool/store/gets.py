"""The store client's get path (:class:`GetPath`, a base of :class:`kvpool.store.client.Store`).

A get reads objects whose location this client knows (location cache, :mod:`.locations`) without
the master, checked by header and checksum after the bytes landed; the rest are looked up at the
master under a lease and read from one replica (others on failure, then the SSD copy). Ended
leases are reported in batches on the main connection. Called from the public ``get*`` methods
of ``Store`` in the caller's thread (``_flush_releases_idle`` from its heartbeat thread).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from kvpool._rpc import RpcClient
from kvpool.errors import InvalidArgument, KvpoolError, ObjectNotFound, ProtocolError, StoreError, late_batch
from kvpool.store.client_base import ClientBase, _err
from kvpool.store.datapath import ReadJob
from kvpool.store.layout import HEADER_SIZE, checksum, header_mismatch, key_hash
from kvpool.store.locations import LOCAL, SEEN, Loc
from kvpool.store.ssd import read_ssd_file
from kvpool.store.staging import copy_out, host_view
from kvpool.transfer.types import OpCode

log = logging.getLogger("kvpool.store")

# A get reads objects known only by this client's own checksum (location cache kind LOCAL) without
# the master when they are all it reads and total at most this: xxh3 of 8 MiB (~130 us) costs
# about one master round trip.
LOCAL_READ_MAX = 8 << 20


_U64 = 1 << 64


def _host_memory() -> int:
    """Bytes of this host's physical memory: a value larger can never be held here."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return _U64


# A get into new bytes of an object larger than this fails that key with a StoreError before
# anything is allocated: the size is the master's word (a hostile or buggy one could name any).
HOST_MEMORY = _host_memory()


def _u64(x: Any) -> bool:
    return type(x) is int and 0 <= x < _U64


def is_place(r: Any) -> bool:
    """A replica's place in a master answer: ``[segment name, address, ...]`` (what
    :func:`_bad_info` checks inline for each replica of a get, and ``Store.change_replica`` for
    the places of a ``replica_start`` answer)."""
    return type(r) is list and len(r) >= 2 and type(r[0]) is str and _u64(r[1])


def _bad_info(code: Any, info: Any) -> str | None:
    """Why one ``[code, info]`` of a master's get reply cannot be used (None: it can). Every
    field the read uses is checked before it is used: one of another type failed the get with
    a TypeError (a checksum that is no int, compared with the value's) or a struct.error (a
    generation past 64 bits, packed into the location cache), not a kvpool error. Once per key
    of a get (batch gets of small objects: keep it cheap, no generators or calls per field)."""
    if code is not None:
        return None if type(code) is str and type(info) is str else "an error that is no code and message"
    if type(info) is not dict:
        return "an answer that is no map"
    size, gen, csum = info.get("size"), info.get("gen"), info.get("checksum")
    if not (type(size) is int and type(gen) is int and 0 <= size < _U64 and 0 <= gen < _U64):
        return "a size or generation that is no int in [0, 2**64)"
    if csum is not None and not (type(csum) is int and 0 <= csum < _U64):
        return "a checksum that is neither None nor an int in [0, 2**64)"
    reps = info.get("replicas")
    if type(reps) is not list:
        return "replicas that are not [[segment, address, ...]]"
    for r in reps:  # is_place, inline: once per replica of every key
        if not (
            type(r) is list and len(r) >= 2 and type(r[0]) is str and type(r[1]) is int and 0 <= r[1] < _U64
        ):
            return "replicas that are not [[segment, address, ...]]"
    ssd = info.get("ssd")
    if ssd is not None and not (type(ssd) is list and len(ssd) == 3 and all(type(x) is str for x in ssd)):
        return "an SSD copy that is not [path, host, checksum]"
    return None


class GetPath(ClientBase):
    """Get machinery of the store client."""

    def _promote(self, key: str, gen: int, data: bytes) -> None:
        raise NotImplementedError  # Store._promote: an SSD hit (of generation gen) copied back to memory

    def _report_read(self, segment: str, kind: str, fields: dict[str, Any]) -> None:
        """Tell the master, one-way, that a segment is unreachable or a replica corrupt, with
        ``fields`` naming what was read (epoch, mount, replica id, and a corrupt one's key,
        generation and address); called by the data path (:class:`DataPath`, its ``report``)
        in the reading thread when a transfer fails or its bytes do."""
        try:
            self._rpc.send("report", segment=segment, kind=kind, **fields)
        except KvpoolError as exc:
            log.debug("report to the master failed: %s", exc)

    def _get_cached(self, key: str, loc: Loc) -> bytes | None:
        """One small object through its cached location: one engine READ of header + value into
        the staging slot, checked there (the common case of :meth:`_get`, without its lists)."""
        st = self._staging
        if st.small_off is None or not st.small_lock.acquire(blocking=False):
            return None
        try:
            off, n = st.small_off, HEADER_SIZE + loc.size
            seg, raddr = loc.replicas[0][0], loc.replicas[0][1]
            try:
                self.engine.transfer_sync(seg, st.base + off, raddr, n, OpCode.READ)
            except KvpoolError:
                self._loc.forget(key)
                return None
            view = st.view[off : off + n]
            if header_mismatch(view, loc.epoch, loc.gen, key_hash(key), loc.size, loc.csum) is not None or (
                checksum(view[HEADER_SIZE:]) != loc.csum
            ):
                self._loc.forget(key)
                return None
            return bytes(view[HEADER_SIZE:])
        finally:
            st.small_lock.release()

    def _lookup(self, keys: Sequence[str]) -> tuple[list[list[Any]], int, float]:
        """Master lookups (leases taken): per-key [code, info], the epoch, and the local time by
        which reads must have landed."""
        t0 = time.monotonic()
        results: list[list[Any]] = []
        epoch = self.master_incarnation or 0
        lease_s = self._lease_s
        for a, b in self._chunks(len(keys)):
            reply = self._call("get", keys=list(keys[a:b]))
            got, epoch, lease_s = reply.get("results"), reply.get("epoch"), reply.get("lease_s")
            if not (
                isinstance(got, list)
                and len(got) == b - a
                and all(isinstance(x, list) and len(x) == 2 for x in got)
                and _u64(epoch)
                and type(lease_s) in (int, float)
                and 0 < lease_s < 1e9  # a NaN fails too
            ):
                raise ProtocolError("the store master's get reply is malformed (results, epoch, lease_s)")
            results += got
        return results, epoch, t0 + lease_s * 0.99

    def _get(
        self, keys: Sequence[str], dests: list[tuple[int, int] | None]
    ) -> list[bytes | int | KvpoolError]:
        """Read objects into ``dests`` (addr, capacity) or, for None, into new bytes."""
        n = len(keys)
        out: list[bytes | int | KvpoolError] = [ObjectNotFound("")] * n
        todo = list(range(n))
        cached: list[tuple[int, ReadJob]] = []
        epoch = self.master_incarnation or 0
        local_bytes = 0
        for i in todo:
            loc = self._loc.get(keys[i], self.master_incarnation)
            if loc is None or loc.kind == SEEN:
                continue
            dest = dests[i]
            if dest is not None and (
                dest[1] < loc.size or (loc.kind == LOCAL and self.engine.is_gpu_memory(dest[0], loc.size))
            ):
                continue  # too small (the master's answer says so); GPU: no copy back for a checksum
            if loc.kind == LOCAL:
                local_bytes += loc.size
            cached.append((i, ReadJob(keys[i], loc.size, loc.gen, loc.csum, loc.replicas, dest, float("inf"),
                                      local_csum=loc.kind == LOCAL, cached=True)))  # fmt: skip
        if local_bytes and (len(cached) < n or local_bytes > LOCAL_READ_MAX):
            # Objects known by this client's own checksum are read without the master only when
            # that saves the round trip and checksumming them costs less than it does.
            cached = [(i, j) for i, j in cached if not j.local_csum]
        if cached:
            self._data.read(epoch, [j for _, j in cached])
            done = set()
            for i, j in cached:
                if j.error is None:
                    out[i] = j.result  # type: ignore[assignment]
                    done.add(i)
                else:
                    self._loc.forget(keys[i])  # stale: ask the master
            todo = [i for i in todo if i not in done]
        for attempt in range(self.config.get_retries + 1):
            if not todo:
                break
            todo = self._get_from_master(keys, dests, todo, out, last=attempt == self.config.get_retries)
        return out

    def _get_from_master(self, keys: Sequence[str], dests: list[tuple[int, int] | None], todo: list[int],
                         out: list[Any], last: bool) -> list[int]:  # fmt: skip
        """One lookup + read round for keys ``todo``; returns the keys to try again."""
        infos, epoch, deadline = self._lookup([keys[i] for i in todo])
        jobs: list[tuple[int, ReadJob, dict[str, Any]]] = []
        bad: set[int] = set()
        for i, (code, info) in zip(todo, infos, strict=True):
            why = _bad_info(code, info)
            if why is not None:
                out[i] = ProtocolError(f"the store master's answer for {keys[i]!r} is malformed: {why}")
                bad.add(i)
                continue
            if code is not None:
                out[i] = _err(code, info)
                continue
            size, dest = info["size"], dests[i]
            if dest is not None and dest[1] < size:
                out[i] = InvalidArgument(
                    f"buffer of {dest[1]} bytes is too small for {keys[i]!r} ({size} bytes)"
                )
            elif dest is None and size > HOST_MEMORY:
                out[i] = StoreError(f"{keys[i]!r} is {size} bytes: more than this host's memory")
            else:
                jobs.append((i, ReadJob(keys[i], size, info["gen"], info["checksum"], info["replicas"], dest,
                                        deadline), info))  # fmt: skip
        # [key, gen, lease epoch]: a release the master can tell from a later reader's lease
        leases = [[keys[i], info["gen"], info.get("lease")]
                  for i, (code, info) in zip(todo, infos, strict=True)
                  if code is None and i not in bad]  # fmt: skip
        try:
            self._data.read(epoch, [j for _, j, _ in jobs])
        except KvpoolError as exc:
            bid = late_batch(exc)
            with self._release_lock:
                if bid is None:
                    self._releases += leases  # nothing of the read still runs
                elif leases:
                    # Its copies may still read the objects' memory: the leases keep it from
                    # being evicted or reused until the engine says the copies ended.
                    self._late_releases.append((bid, deadline, leases))
            raise
        # Objects without a committed checksum are remembered only from gets small enough to be
        # read without the master later (see _get): no checksum is computed for nothing.
        local_ok = sum(j.size for _, j, _ in jobs) <= LOCAL_READ_MAX
        again: list[int] = []
        for i, j, info in jobs:
            if j.error is None:
                out[i] = j.result
                if j.served_by is not None and (local_ok or j.csum is not None):
                    self._remember_read(j, epoch)
            elif j.retry and not last:
                again.append(i)
            elif info["ssd"] is not None and not j.retry and not j.oom:
                out[i] = self._get_from_ssd(keys[i], info, dests[i])
            else:
                out[i] = j.error
        self._end_leases(leases)
        return again

    def _end_leases(self, leases: list[list[Any]]) -> None:
        """Reads under ``leases`` are done: they end with this client's next request (or
        heartbeat); a thousand pending are sent at once."""
        if leases:
            with self._release_lock:
                self._releases += leases
                flush = len(self._releases) >= 1024
            if flush:
                self._flush_releases(self._rpc)

    def _remember_read(self, j: ReadJob, epoch: int) -> None:
        """Keep the location of an object read through the master (see :mod:`.locations`): with its
        committed checksum; else noted on the first read and checksummed here on the second (the
        bytes were read under a lease and header-checked: they are the object's)."""
        segs = [r[0] for r in j.replicas]
        if j.csum is not None:
            self._loc.remember(j.key, epoch, j.gen, j.size, j.csum, segs, j.replicas)
            return
        prev = self._loc.get(j.key, epoch)
        if prev is None or prev.gen != j.gen:
            self._loc.remember_read(j.key, epoch, j.gen, j.size, None, segs, j.replicas)
        elif prev.kind == SEEN:
            if isinstance(j.result, bytes):
                value: Any = j.result
            elif j.dest is not None and not self.engine.is_gpu_memory(j.dest[0], j.size):
                value = host_view(self.engine, j.dest[0], j.size)
            else:
                return  # a GPU destination: not copied back to host for a checksum
            self._loc.remember_read(j.key, epoch, j.gen, j.size, checksum(value), segs, j.replicas)

    def _flush_releases_idle(self) -> None:
        """The heartbeat thread: report ended read leases on the *main* connection when it is idle
        (never on its own connection: the master could then see this client's next ``remove`` of
        the object before the release and answer ObjectBusy); when busy, the caller's next request
        carries them (``_call``). Leases of reads whose late copies ended are ended first
        (:meth:`_settle_late_releases`)."""
        if self._late_releases:
            self._settle_late_releases()
        with self._release_lock:
            leases, self._releases = self._releases, []
        if not leases:
            return
        sent = 0
        for a in range(0, len(leases), 4 * self._max_batch):
            if not self._rpc.try_send("release", leases=leases[a : a + 4 * self._max_batch]):
                break
            sent = a + 4 * self._max_batch
        if sent < len(leases):
            with self._release_lock:
                self._releases = leases[sent:] + self._releases

    def _settle_late_releases(self) -> None:
        """The heartbeat thread: leases of reads that raised a TransferTimeout whose copies
        may still read the objects (``_late_releases``: batch, lease deadline, leases) end once
        ``batch_settled`` says the copies ended (never before: the master could evict the object
        and reuse its space under them). Those past their deadline are dropped: the master wrote
        them off (a release of them is ignored), so the list stays bounded by the leases alive."""
        now = time.monotonic()
        with self._release_lock:
            late, self._late_releases = self._late_releases, []
        keep, ended = [], []
        for bid, deadline, leases in late:
            if deadline <= now:
                continue
            try:
                settled = self.engine.batch_settled(bid)
            except KvpoolError as exc:  # e.g. the engine closed: the leases end at their deadline
                log.debug("late read batch %s: %s", bid, exc)
                continue
            if settled:
                ended += leases
            else:
                keep.append((bid, deadline, leases))
        with self._release_lock:
            self._late_releases[:0] = keep
            self._releases += ended

    def _flush_releases(self, rpc: RpcClient) -> None:
        with self._release_lock:
            leases, self._releases = self._releases, []
        for a in range(0, len(leases), 4 * self._max_batch):
            rpc.send("release", leases=leases[a : a + 4 * self._max_batch])

    def _get_from_ssd(
        self, key: str, info: dict[str, Any], dest: tuple[int, int] | None
    ) -> bytes | int | KvpoolError:
        if info["ssd"] is None:
            return ObjectNotFound(f"object {key!r} has no readable copy")
        path, host, checksum = info["ssd"]
        why: list[str] = []
        try:
            data = read_ssd_file(path, key, info["size"], checksum, why)
        except MemoryError:
            return StoreError(f"no memory for the {info['size']} bytes of {key!r} on this client")
        if data is None:
            # The copy's own host read it and it is bad: the master lets go of it (else the key
            # stayed taken by an object nobody can read: every put of it was refused). Missing,
            # or off its host (the directory may not be shared here): the copy's client checks
            # the file (ssd_missing), and reports it when it is bad
            bad = why == ["corrupt"] and host == self.host_id
            try:
                self._rpc.send("report", segment="", kind="ssd_corrupt" if bad else "ssd_missing",
                               key=key, gen=info["gen"], path=path)  # fmt: skip
            except KvpoolError as exc:
                log.debug("report to the master failed: %s", exc)
            return ObjectNotFound(f"SSD copy of {key!r} is missing or corrupt (treated as a miss)")
        if self.config.promote_on_hit:
            try:
                self._promote(key, info["gen"], data)
            except KvpoolError as exc:
                log.debug("promotion of %s failed: %s", key, exc)
        if dest is None:
            return data
        copy_out(self.engine, dest[0], data)
        return len(data)
