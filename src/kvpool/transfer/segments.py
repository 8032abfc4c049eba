"""Segments of :class:`~kvpool.transfer.engine.TransferEngine`, mixed into it: fetch a peer's
descriptor (from the peer itself, or a metadata store, checked against the cluster secret), pick
the transport that reaches it, attach it (again after the peer restarted, moved or registered
more memory), and close it. ``open_segment`` is called by any thread before it transfers, as
often as it likes (a cached handle is one dict read); the refreshes by the engine's submit path.
A descriptor is fetched by one thread at a time per segment, and not again for a while after a
fetch failed (:class:`RefetchGate`): a hung or dead peer costs its callers one connect timeout,
not one per call.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpool import _native
from kvpool.errors import (
    AuthenticationError,
    InvalidArgument,
    KvpoolError,
    ProtocolUnavailable,
    SegmentNotFound,
)
from kvpool.transfer.transport import Transport
from kvpool.transfer.types import SegmentDescriptor, SegmentHandle

if TYPE_CHECKING:
    from kvpool.config import TransferConfig
    from kvpool.transfer.metadata import MetadataBackend

__all__ = ["RefetchGate", "Segments", "split_host_port"]


def split_host_port(name: str) -> tuple[str, int]:
    """Parse ``host:port`` or ``[v6]:port``; raise :class:`InvalidArgument` otherwise."""
    host, sep, port = name.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"segment name {name!r} is not host:port")
    return host.strip("[]"), int(port)


class _Flight:
    """One fetch (and attach) of a segment in progress: its result, for the threads that waited."""

    __slots__ = ("done", "error", "handle")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.handle: SegmentHandle | None = None
        self.error: BaseException | None = None


class _Backoff:
    """A segment's fetch state: the fetch in progress, and the last failure's error and window."""

    __slots__ = ("delay", "error", "flight", "until")

    def __init__(self) -> None:
        self.flight: _Flight | None = None
        self.error: KvpoolError | None = None  # copied, without the traceback (frames) it had
        self.until = 0.0
        self.delay = 0.0


def _again(err: BaseException, note: str) -> BaseException:
    """A copy of ``err`` (same type and message) to raise in another thread, with ``note``."""
    try:
        e = copy.copy(err)
    except Exception:  # noqa: BLE001 - an error that cannot be copied: say what it said
        e = SegmentNotFound(str(err))
    e.__notes__ = [*getattr(err, "__notes__", []), note]
    return e


class RefetchGate:
    """Fetches of segment descriptors, per segment name: one thread fetches at a time (the
    others wait for its result, bounded by the fetch's own timeout), and after a failed fetch
    the calls within a window fail at once with the same typed error instead of fetching again.
    The window is ``min(1 s, connect_timeout_s)``, doubled on a further failure up to twice
    that (a longer one would only delay reaching a peer that came back), and forgotten on a
    success. Used by :meth:`Segments._open`, in the caller's thread;
    no lock is held across a fetch."""

    MAX_NAMES = 4096  # names remembered (failed, or being fetched); see _make_room

    def __init__(self, connect_timeout_s: float, fetch_bound_s: float | None = None) -> None:
        self.base_s = min(1.0, connect_timeout_s)
        self.cap_s = 2 * self.base_s
        # a follower's wait: the leader's fetch ends within its own timeout; this is a backstop
        self.wait_s = fetch_bound_s if fetch_bound_s is not None else 2 * connect_timeout_s + 1.0
        self._mu = threading.Lock()  # guards _state; never held across a fetch
        self._state: dict[str, _Backoff] = {}

    def run(self, name: str, fetch: Callable[[], SegmentHandle], fresh: bool = False) -> SegmentHandle:
        """``fetch()`` for ``name`` unless another thread is running it (then its result) or
        it failed within the window (then its error, at once). A fetch that another thread's
        interrupt (KeyboardInterrupt) or a non-kvpool error ended is not that thread's to share:
        a caller that waited for it fetches itself. ``fresh``: a descriptor fetched after this
        call began (the caller saw the cached one lack a range): a fetch in flight then is waited
        for, not taken (it may have read the descriptor before the owner registered that range)."""
        begun = fresh  # a fetch in flight now began before this call
        while True:
            with self._mu:
                st = self._state.get(name)
                if st is None:
                    if len(self._state) >= self.MAX_NAMES:
                        self._make_room()
                    st = self._state[name] = _Backoff()
                flight = st.flight
                if flight is None:
                    left = st.until - time.monotonic()
                    if st.error is not None and left > 0:
                        raise _again(
                            st.error,
                            f"(the segment's descriptor could not be fetched {st.delay - left:.2f} s ago; "
                            f"it is not asked for again for {left:.2f} s)",
                        )
                    flight = st.flight = _Flight()
                    break
            if not flight.done.wait(self.wait_s):
                raise SegmentNotFound(
                    f"segment {name!r}: another thread has been fetching its descriptor for "
                    f"{self.wait_s:.1f} s; try again"
                )
            if begun and flight.error is None:
                begun = False
                continue  # waited out; now fetched again (or the result of a fetch begun since)
            begun = False
            if flight.error is None:
                assert flight.handle is not None
                return flight.handle
            if isinstance(flight.error, KvpoolError):
                raise _again(flight.error, "(raised by the fetch of another thread this call waited for)")
        try:
            flight.handle = fetch()
            return flight.handle
        except BaseException as e:
            flight.error = e
            raise
        finally:
            self._finish(name, st, flight)

    def _finish(self, name: str, st: _Backoff, flight: _Flight) -> None:
        err = flight.error
        with self._mu:
            st.flight = None  # (an entry with a flight is never forgotten: st is still _state[name])
            if isinstance(err, KvpoolError) and not isinstance(err, InvalidArgument):
                st.delay = self.base_s if st.error is None else min(self.cap_s, 2 * st.delay)
                st.error = copy.copy(err)
                st.until = time.monotonic() + st.delay
                self._state[name] = self._state.pop(name, st)  # last: _make_room forgets the oldest first
            elif err is None or st.error is None:
                self._state.pop(name, None)  # fetched: the next failure starts a new window
        flight.done.set()

    def _make_room(self) -> None:
        """Called with ``_mu`` held when ``MAX_NAMES`` names are remembered (a peer's or a
        hostile metadata store's flood of names that fail): forget those whose window ended,
        then, while over three quarters of ``MAX_NAMES``, those that failed longest ago (their
        window cut short: such a name is fetched again sooner), so that memory stays bounded
        and a full scan happens once per ``MAX_NAMES // 4`` new names. Never a fetch in flight:
        its callers wait for it (there are at most as many as threads fetching)."""
        now = time.monotonic()
        for k in [k for k, v in self._state.items() if v.flight is None and v.until <= now]:
            del self._state[k]
        excess = len(self._state) - self.MAX_NAMES * 3 // 4
        if excess > 0:
            for k in [k for k, v in self._state.items() if v.flight is None][:excess]:
                del self._state[k]


class Segments:
    """The segment cache and routes; state set up by ``TransferEngine.__init__``."""

    config: TransferConfig
    _lock: threading.RLock
    _meta: MetadataBackend | None
    _native: _native.NativeEngine
    _preferred: list[Transport]
    _segments: dict[str, tuple[SegmentHandle, SegmentDescriptor]]
    _handles: dict[int, str]
    _routes: dict[int, Transport]
    _refetch: RefetchGate

    def _fetch(self, name: str) -> SegmentDescriptor:
        if not isinstance(name, str) or not name:
            raise InvalidArgument("segment name must be a non-empty string")
        timeout_ms = int(self.config.connect_timeout_s * 1000)
        if self._meta is None:
            host, port = split_host_port(name)
            _, blob = _native.fetch_descriptor(host, port, self.config.secret or "", timeout_ms)
            return SegmentDescriptor.from_bytes(blob, self.config.secret)
        blob = self._meta.get(name)
        if blob is None:
            raise SegmentNotFound(f"segment {name!r} is not published in {self.config.metadata}")
        # Signed (when there is a secret) and checked before anyone acts on it.
        desc = SegmentDescriptor.from_bytes(blob, self.config.secret)
        if desc.name != name:
            raise AuthenticationError(
                f"the descriptor stored under {name!r} describes segment {desc.name!r} (copied from "
                "another key?); refusing it: check who writes the metadata store"
            )
        return desc

    def _pick(self, name: str, desc: SegmentDescriptor) -> Transport:
        """The first transport, in order of preference, that reaches the segment."""
        for t in self._preferred:
            if t.reaches(desc):
                return t
        mine = [t.name for t in self._preferred]
        raise ProtocolUnavailable(
            f"no transport reaches segment {name!r}: this engine (protocol={self.config.protocol!r}) "
            f"initiates over {mine}, the segment's engine offers {desc.protocols} on host {desc.host_id}; "
            "use protocol='auto', or run both engines with the same transports"
        )

    def open_segment(self, name: str) -> SegmentHandle:
        """Open (or return the cached handle of) the segment ``name``; re-fetches after a peer restart."""
        cached = self._segments.get(name)  # one dict read (atomic): no lock on the hot path
        if cached is not None and not self._native.peer_stale(cached[0].id):
            route = self._routes.get(cached[0].id)
            if route is None or not route.peer_gone(cached[0].id):
                return cached[0]
        return self._open(name)

    def _open(self, name: str, fresh: bool = False) -> SegmentHandle:
        """Fetch ``name``'s descriptor and (re)attach the segment to the transport that reaches it:
        one thread at a time per segment, and not again within a while after a failed fetch (the
        calls then raise its error at once: see :class:`RefetchGate`; ``fresh``: its ``run``'s)."""
        return self._refetch.run(name, lambda: self._attach(name), fresh)

    def _attach(self, name: str) -> SegmentHandle:
        desc = self._fetch(name)
        transport = self._pick(name, desc)
        with self._lock:
            cached = self._segments.get(name)
            regions = desc.remote_regions()
            pid = transport.peer_pid(desc)  # one update per refresh: a pid change reopens its pidfd
            if cached is not None:
                handle = cached[0]
                # A restarted segment may listen elsewhere (a logical name in a metadata store)
                self._native.set_peer_address(handle.id, desc.hostname, desc.port)
                self._native.update_peer(handle.id, desc.incarnation, pid, regions)
            else:
                hid = self._native.add_peer(desc.hostname, desc.port, desc.incarnation, 0, regions)
                if pid:  # add_peer opens no pidfd; update_peer does (on a pid change)
                    self._native.update_peer(hid, desc.incarnation, pid, regions)
                handle = SegmentHandle(hid, name)
                self._handles[hid] = name
            old = self._routes.get(handle.id)
            if old is not None and old is not transport:
                old.detach(handle.id)
            transport.attach(handle.id, name, desc)
            self._routes[handle.id] = transport
            self._segments[name] = (handle, desc)
        return handle

    def get_segment_descriptor(self, name_or_handle: str | SegmentHandle) -> SegmentDescriptor:
        """The (cached, refreshed when stale) descriptor of an opened segment."""
        name = name_or_handle.name if isinstance(name_or_handle, SegmentHandle) else name_or_handle
        self.open_segment(name)
        with self._lock:
            return self._segments[name][1]

    def close_segment(self, handle: SegmentHandle | int) -> None:
        """Forget a segment: its connections are closed and its queued transfers canceled."""
        hid = int(handle)
        with self._lock:
            name = self._handles.pop(hid, None)
            if name is None:
                raise SegmentNotFound("unknown segment handle (already closed?)")
            self._segments.pop(name, None)
            route = self._routes.pop(hid, None)
        if route is not None:
            route.detach(hid)
        self._native.remove_peer(hid)

    def release_exited_peers(self) -> int:
        """Let go of the memory mapped from peers whose process exited (see
        :meth:`Transport.release_exited`); how many. Called by a store client's heartbeat
        thread; cheap (one poll per same-host peer)."""
        with self._lock:
            return sum(len(t.release_exited()) for t in set(self._routes.values()))

    def uses_same_host_path(self, handle: SegmentHandle | int) -> bool:
        """True when transfers to this segment take the same-host single-copy path."""
        return bool(self._native.peer_same_host(int(handle)))

    def shared_buffers_mapped(self, handle: SegmentHandle | int) -> int:
        """How many of the segment's shared-memory buffers are mapped here (same host only)."""
        return int(self._native.peer_shm_count(int(handle)))

    def _route(self, hid: int) -> Transport:
        t = self._routes.get(hid)
        if t is None:
            raise SegmentNotFound(f"unknown segment handle {hid}; call open_segment first")
        return t

    def _view_changed(self, handles: set[int]) -> bool:
        """Re-fetch the descriptors of ``handles``; True when any changed (another process, other
        buffers). Called after a request named a remote range outside a cached descriptor: the
        owner may have registered it since, or restarted elsewhere; only its descriptor says."""
        changed = False
        for hid in handles:
            name = self._handles.get(hid)
            cached = self._segments.get(name) if name is not None else None
            if cached is None:
                continue
            old = cached[1]
            try:
                self._open(name, fresh=True)  # type: ignore[arg-type]
            except KvpoolError:
                continue  # unreachable now: the retried request fails with its own reason
            new = self._segments[name][1]  # type: ignore[index]
            if new.incarnation != old.incarnation or new.remote_regions() != old.remote_regions():
                changed = True
        return changed

    def _refresh_stale(self, handles: set[int]) -> None:
        for hid in handles:
            try:
                stale = self._native.peer_stale(hid)
            except SegmentNotFound:
                continue  # reported by the submit with its own message
            if stale:
                name = self._handles.get(hid)
                if name is not None:
                    try:
                        self.open_segment(name)
                    except SegmentNotFound:
                        pass  # the peer is down: submit fails its requests with the reason
