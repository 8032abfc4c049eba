"""The store client's put path (:class:`PutPath`, a base of :class:`kvpool.store.client.Store`).

A put asks the master for allocations (``put_start``: epoch, generation, replicas) or takes them
from this client's reservations, writes header + value through the data path
(:mod:`kvpool.store.datapath`) and commits (``put_end`` / ``commit``). Values of one size and
config in a batch go through reservations with one ``commit`` round trip (which also brings the
next batch's reservations); anything a reservation cannot carry is put the normal way. Called from
the public ``put*`` methods of ``Store``, in the caller's thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvpool.errors import Fenced, InvalidArgument, InvalidType, KvpoolError, TransferError, late_batch
from kvpool.store.client_base import ClientBase, _err
from kvpool.store.datapath import WriteJob
from kvpool.store.reservations import RESERVE_BATCH_MAX, RESERVE_BYTES, mounts_of
from kvpool.store.staging import DIRECT_MIN

if TYPE_CHECKING:
    from kvpool.store.client import ReplicateConfig


class PutPath(ClientBase):
    """Put machinery of the store client."""

    def _put(
        self,
        keys: Sequence[str],
        sources: list[tuple[int, int] | memoryview],
        config: ReplicateConfig | None,
        reserve: int = 0,
    ) -> list[KvpoolError | None]:
        sizes = [s[1] if isinstance(s, tuple) else s.nbytes for s in sources]
        for i, n in enumerate(sizes):
            if not isinstance(n, int) or isinstance(n, bool):
                raise InvalidType(f"size of {keys[i]!r} must be an int, not {type(n).__name__}")
            if n <= 0:
                what = "is empty" if n == 0 else f"has a negative size ({n})"
                raise InvalidArgument(f"value of {keys[i]!r} {what}: sizes must be more than 0 bytes")
        out: list[KvpoolError | None] = []
        for a, b in self._chunks(len(keys)):
            out += self._put_chunk(list(keys[a:b]), sources[a:b], sizes[a:b], config, reserve)
        return out

    def _put_chunk(self, keys: list[str], sources: list[Any], sizes: list[int],
                   config: ReplicateConfig | None, reserve: int,
                   batch_reserved: bool = True) -> list[KvpoolError | None]:  # fmt: skip
        if batch_reserved and reserve == 0 and 2 <= len(keys) <= RESERVE_BATCH_MAX and len(set(sizes)) == 1:
            if sizes[0] * len(keys) <= RESERVE_BYTES:
                done = self._put_batch_reserved(keys, sources, sizes[0], config)
                if done is not None:
                    return done
                reserve = len(keys)  # space for the next batch of this shape comes with this one
        cfg = None if config is None else config.wire()
        t0 = time.monotonic()
        reply = self._call("put_start", keys=keys, sizes=sizes, config=cfg, reserve=reserve)
        epoch, results, mounts = reply["epoch"], reply["results"], mounts_of(reply)
        gens = [val[0] for code, val in results if code is None]
        self._writes.begin(epoch, gens)
        if reply.get("reserved"):
            deadline = t0 + self._write_window_s
            self._resv.add(self._resv_key(sizes[0], config), epoch, reply["reserved"], deadline,
                           self.master_incarnation, mounts)  # fmt: skip
        out: list[KvpoolError | None] = [None] * len(keys)
        jobs: list[tuple[int, WriteJob]] = []
        late: int | None = None  # the batch of a write whose GPU copies may still run
        try:
            for i, (code, val) in enumerate(results):
                if code is not None:
                    out[i] = _err(code, val)
                else:
                    jobs.append((i, WriteJob(keys[i], sizes[i], sources[i], val[0], val[1], val[2],
                                             mounts=mounts)))  # fmt: skip
            if time.monotonic() > t0 + self._write_window_s:
                late = [[j.gen, False] for _, j in jobs]
                self._call("put_revoke", items=late, epoch=epoch)
                for i, _ in jobs:
                    out[i] = Fenced(f"put of {keys[i]!r} could not start writing within put_timeout_s / 2")
                return out
            try:
                self._data.write(epoch, [j for _, j in jobs])
            except KvpoolError as exc:
                late = self._revoke_late(epoch, exc, [j.gen for _, j in jobs])
                raise
            items = [[j.key, j.gen, j.csum, j.written] for _, j in jobs if j.written]
            revoke = [[j.gen, True] for _, j in jobs if not j.written]
            for i, j in jobs:
                if not j.written:
                    out[i] = TransferError(f"writing {keys[i]!r} to its replicas failed")
            if revoke:
                self._call("put_revoke", items=revoke, epoch=epoch)
            if items:
                committed = [(i, j) for i, j in jobs if j.written]
                try:
                    ends = self._call("put_end", items=items, epoch=epoch)["results"]
                except Fenced as exc:  # the master restarted since put_start: nothing was committed
                    ends = [["STALE", str(exc)]] * len(items)
                known = []
                for (i, j), (code, msg) in zip(committed, ends, strict=True):
                    if code is not None:
                        out[i] = _err(code, msg)
                    else:
                        known.append((j.key, j.gen, j.size, j.csum, j.written, j.replicas))
                self._loc.remember_many(epoch, known)
        finally:
            self._end_writes(epoch, gens, late)
        return out

    def _put_batch_reserved(self, keys: list[str], sources: list[Any], size: int,
                            config: ReplicateConfig | None) -> list[KvpoolError | None] | None:  # fmt: skip
        """A batch of equal-sized values through reservations: write them all, then one ``commit``
        that also asks for the next batch's reservations (one round trip per batch instead of
        two). None when too few reservations are held or the master restarted meanwhile: nothing
        was committed, the caller puts the normal way. Keys whose write failed, or whose
        reservation the master took back before the commit, are put the normal way here."""
        ck = self._resv_key(size, config)
        got = self._resv.take_many(ck, len(keys))
        if got is None:
            return None
        entries, left = got
        epoch = entries[0].epoch
        gens = [e.gen for e in entries]
        out: list[KvpoolError | None] = [None] * len(keys)
        reply: dict[str, Any] | None = None
        late: int | None = None
        try:
            if any(e.epoch != epoch for e in entries):
                return None
            jobs = [WriteJob(k, size, src, e.gen, e.verify, e.replicas, mounts=e.mounts)
                    for k, src, e in zip(keys, sources, entries, strict=True)]  # fmt: skip
            try:
                self._data.write(epoch, jobs)
            except KvpoolError as exc:
                late = self._revoke_late(epoch, exc, gens)
                raise
            retry = [i for i, j in enumerate(jobs) if len(j.written) < len(j.replicas)]
            if retry:
                self._revoke_failed(epoch, [(jobs[i].gen, jobs[i].replicas, jobs[i].written) for i in retry])
            todo = [i for i, j in enumerate(jobs) if len(j.written) == len(j.replicas)]
            if todo:
                cfg = None if config is None else config.wire()
                want = len(keys) if left < len(keys) else 0
                t0 = time.monotonic()
                items = [[keys[i], jobs[i].gen, jobs[i].csum] for i in todo]
                reply = self._call("commit", items=items, epoch=epoch, reserve=want, size=size, config=cfg)
        except Fenced:
            return None  # the master restarted: nothing of this batch was committed
        finally:
            self._end_writes(epoch, gens, late)
        if reply is not None:
            if reply.get("reserved"):
                deadline = t0 + self._write_window_s
                mounts = mounts_of(reply)
                self._resv.add(ck, epoch, reply["reserved"], deadline, self.master_incarnation, mounts)
            known, unused = [], []
            for i, (code, msg) in zip(todo, reply["results"], strict=True):
                j = jobs[i]
                if code is None:
                    known.append((j.key, j.gen, size, j.csum, j.written, j.replicas))
                elif code == "NOT_FOUND":
                    retry.append(i)  # the reservation expired meanwhile
                else:
                    unused.append([j.gen, False])  # e.g. ObjectExists; the write is over: free at once
                    out[i] = _err(code, msg)
            if unused:
                self._call("put_revoke", items=unused, epoch=epoch)
            self._loc.remember_many(epoch, known)
        if retry:
            again = self._put_chunk([keys[i] for i in retry], [sources[i] for i in retry],
                                    [size] * len(retry), config, 0, batch_reserved=False)  # fmt: skip
            for i, err in zip(retry, again, strict=True):
                out[i] = err
        return out

    def _revoke_late(self, epoch: int, exc: KvpoolError, gens: list[int]) -> int | None:
        """A write of allocations ``gens`` raised ``exc``. Where that is a TransferTimeout whose
        GPU copies may still run (its ``batch_id``, returned), nothing of it is committed: the
        allocations are taken back fenced (their space is reused only once this client's floor
        passed them: :meth:`_end_writes`). The caller raises ``exc`` on."""
        bid = late_batch(exc)
        if bid is not None:
            try:
                for a, b in self._chunks(len(gens)):
                    self._call("put_revoke", items=[[g, True] for g in gens[a:b]], epoch=epoch)
            except KvpoolError:
                # Nothing leaks and no late copy can land in reused space: the master takes the
                # allocations back at its put_timeout_s, fenced as a revoke would (freed once
                # quarantine_s passed and this client's floor, held below them until the copies
                # ended, passed them). Only the key stays taken until then. Test:
                # test_a_late_gpu_put_whose_revoke_failed_is_fenced_by_the_masters_put_timeout.
                pass
        return bid

    def _end_writes(self, epoch: int, gens: list[int], late: int | None) -> None:
        """The writes into ``gens`` are over, or (``late``: the batch of a TransferTimeout) will be
        once the engine says its copies ended: the floor stays at or below them until then."""
        if late is None:
            self._writes.end(epoch, gens)
        else:
            self._writes.end_when(epoch, gens, lambda: self.engine.batch_settled(late))

    def _revoke_failed(self, epoch: int, failed: list[tuple[int, list[list[Any]], list[str]]]) -> None:
        """Writes into reservations failed (``failed``: generation, replicas, segments written):
        revoke them (fenced: bytes may still land) and, freed at once, the pool's unused
        reservations on the segments that failed, which would fail the same way."""
        bad = {r[0] for _, reps, written in failed for r in reps if r[0] not in written}
        items = [[gen, True] for gen, _, _ in failed]
        items += [[e.gen, False] for e in self._resv.drop_on(bad) if e.epoch == epoch]
        for a, b in self._chunks(len(items)):
            self._call("put_revoke", items=items[a:b], epoch=epoch)

    @staticmethod
    def _view(value: Any) -> memoryview:
        try:
            mv = memoryview(value)
        except TypeError:
            raise InvalidArgument(f"value must be bytes-like, got {type(value).__name__}") from None
        if not mv.c_contiguous:
            mv = memoryview(mv.tobytes())
        return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv

    def _resv_key(self, size: int, config: ReplicateConfig | None) -> tuple[Any, ...]:
        return (size, None if config is None else tuple(config.wire().values()))

    def _put_reserved(self, key: str, view: memoryview, config: ReplicateConfig | None) -> bool:
        """Put through a reservation: write, then one `commit`. False when none is usable."""
        if not isinstance(key, str) or not key:
            return False  # the master explains what is wrong with the key
        size = view.nbytes
        entry = self._resv.take(self._resv_key(size, config), size, config)
        if entry is None:
            return False
        replicas = entry.replicas
        small = len(replicas) == 1 and size <= DIRECT_MIN  # the common case, with fewer layers
        try:
            if small:
                seg, raddr = replicas[0][0], replicas[0][1]
                mount = entry.mounts.get(seg)
                csum = self._data.write_small(entry.epoch, key, entry.gen, view, seg, raddr, mount)
                written = [] if csum is None else [seg]
            else:
                job = WriteJob(key, size, view, entry.gen, entry.verify, replicas, mounts=entry.mounts)
                self._data.write(entry.epoch, [job])
                csum, written = job.csum, job.written
            if len(written) < len(replicas):
                self._revoke_failed(entry.epoch, [(entry.gen, replicas, written)])
                return False  # e.g. the segment's server died: the master places the put anew
            res = self._call("commit", items=[[key, entry.gen, csum]], epoch=entry.epoch)
            code, msg = res["results"][0]
        except Fenced:
            return False  # the master restarted meanwhile: put the normal way
        finally:
            self._writes.end(entry.epoch, [entry.gen])
        if code == "NOT_FOUND":
            return False  # the reservation expired meanwhile: put the normal way
        if code is not None:
            # e.g. ObjectExists. The write finished (nothing of it is still on its way): the
            # reservation's space can be given back at once.
            self._call("put_revoke", items=[[entry.gen, False]], epoch=entry.epoch)
            raise _err(code, msg)
        self._loc.remember(key, entry.epoch, entry.gen, size, csum, written, replicas)
        return True
