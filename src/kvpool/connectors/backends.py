"""The vLLM servers behind ``kvpool proxy`` and the proxy's connections to them.

:class:`Backend` is one server with its health and counters; :class:`BackendPool` hands out the
backends of one role round-robin, skipping unhealthy ones; :class:`BackendClient` owns the one aiohttp
session: it sends a request to the next healthy backend of a pool (a refused connection marks that one
down and tries the next: the request never left), reads whole answers into 502/504
:class:`BackendError` s, and polls every backend's ``/health``. All of it runs on the proxy's event
loop (:class:`kvpool.connectors.proxy.PDProxy`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvpool.connectors.openai_api import BodyParts, error_text, snippet
from kvpool.errors import InvalidArgument

__all__ = ["Backend", "BackendClient", "BackendError", "BackendPool", "learn_peer"]

_log = logging.getLogger("kvpool.connectors.proxy")

# Connection errors that prove the request never reached the backend: mark it down, try another one.
CONNECT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientConnectorError,) + (
    (aiohttp.ConnectionTimeoutError,) if hasattr(aiohttp, "ConnectionTimeoutError") else ()
)


#: How long an idle backend connection is kept for reuse: below uvicorn's (so vLLM's and SGLang's)
#: default ``timeout_keep_alive`` of 5 s, so the proxy drops an idle connection before the server does.
#: A request the server closes unanswered anyway is sent once more (``BackendClient.request``).
KEEPALIVE_S = 4.0

#: Largest non-streamed answer (a completion, ``/v1/models``) read from a backend.
DEFAULT_MAX_REPLY_BYTES = 32 * 1024 * 1024
#: Largest prefill answer read (a one-token completion with its ``kv_transfer_params``).
DEFAULT_MAX_PREFILL_REPLY_BYTES = 4 * 1024 * 1024


@dataclass
class Backend:
    """One vLLM server behind the proxy, with its health and counters."""

    role: str
    """``"prefill"`` or ``"decode"``."""
    url: str
    """Base URL without a trailing slash, e.g. ``http://127.0.0.1:8100``."""
    healthy: bool = True
    last_error: str | None = None
    requests: int = 0
    failures: int = 0
    in_flight: int = 0
    kv_peer: dict[str, Any] | None = None
    """Prefill: its KV side channel, from its last ``kv_transfer_params`` (streaming P/D)."""

    def mark_down(self, reason: str) -> None:
        """Take the backend out of rotation until a health check succeeds."""
        if self.healthy:
            _log.warning("%s backend %s marked unhealthy: %s", self.role, self.url, reason)
        self.healthy = False
        self.last_error = reason

    def mark_up(self) -> None:
        """Put the backend back into rotation."""
        if not self.healthy:
            _log.info("%s backend %s is healthy again", self.role, self.url)
        self.healthy = True
        self.last_error = None

    def describe(self) -> str:
        """``URL`` or ``URL (last error)`` for messages."""
        return f"{self.url} ({self.last_error})" if self.last_error else self.url

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly state, as shown by ``GET /health``."""
        return {
            "url": self.url,
            "healthy": self.healthy,
            "last_error": self.last_error,
            "requests": self.requests,
            "failures": self.failures,
            "in_flight": self.in_flight,
        }


class BackendPool:
    """Backends of one role, handed out round-robin, skipping unhealthy ones."""

    def __init__(self, role: str, urls: Sequence[str]) -> None:
        if not urls:
            raise InvalidArgument(f"at least one {role} URL is required")
        self.role = role
        self.backends = [Backend(role, normalize_url(u)) for u in urls]
        self._next = 0

    def pick(self, exclude: Sequence[Backend] = (), prefer: Backend | None = None) -> Backend | None:
        """``prefer`` when it is healthy and not in ``exclude``, else the next healthy backend not in
        ``exclude``, or None when there is none."""
        if prefer is not None and prefer.healthy and prefer not in exclude:
            return prefer
        n = len(self.backends)
        for i in range(n):
            idx = (self._next + i) % n
            b = self.backends[idx]
            if b.healthy and b not in exclude:
                self._next = (idx + 1) % n
                return b
        return None

    def any_healthy(self) -> bool:
        return any(b.healthy for b in self.backends)

    def unavailable_reason(self) -> str:
        down = ", ".join(b.describe() for b in self.backends)
        return f"no healthy {self.role} backend: {down}"


class BackendError(Exception):
    """A request to a backend failed in a way the client sees as a proxy error (502/503/504)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_at_most(resp: aiohttp.ClientResponse, limit: int, deadline_s: float) -> bytes:
    """Up to ``limit + 1`` bytes of ``resp``'s body (more than ``limit`` means it is larger), read
    within one deadline of ``deadline_s`` for all of it: a backend dripping a byte at a time cannot
    hold the caller past it.  Raises :class:`asyncio.TimeoutError` past the deadline and what
    aiohttp raises when the connection fails."""

    async def chunks() -> bytes:
        parts: list[bytes] = []
        got = 0
        while got <= limit:
            part = await resp.content.readany()  # as received: read(n) joins what is buffered
            if not part:
                break
            part = part[: limit + 1 - got]
            parts.append(part)
            got += len(part)
        # bytes.join copies without the GIL when large: in a thread, the event loop runs meanwhile
        return b"".join(parts) if got <= 1 << 20 else await asyncio.to_thread(b"".join, parts)

    return await asyncio.wait_for(chunks(), deadline_s)


async def _taken(pieces: AsyncIterator[memoryview], whole: list[bool]) -> AsyncIterator[memoryview]:
    """``pieces``; sets ``whole[0]`` once aiohttp asks past the last one (it has written them
    all to the connection)."""
    async for piece in pieces:
        yield piece
    whole[0] = True


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url


def learn_peer(backend: Backend, params: dict[str, Any]) -> None:
    """Keep a prefill's KV side channel (host, port, engine id, TP size) from its answer."""
    if params.get("remote_host") is not None and params.get("remote_port") is not None:
        backend.kv_peer = {
            k: params.get(k) for k in ("remote_host", "remote_port", "remote_engine_id", "tp_size")
        }


class BackendClient:
    """The proxy's one aiohttp session to its backends, with their health polling.

    Args:
        timeout_s: longest wait for a backend to send anything (an answer's headers, its body, the next
            streamed chunk).
        connect_timeout_s: longest wait to open a connection to a backend.
        health_interval_s: seconds between health polls; 0 disables polling (and then a backend is
            never marked down: nothing would bring it back).
        max_connections: total connections kept by the session.
        max_reply_bytes: largest non-streamed answer body :meth:`read` accepts from a backend.

    :meth:`open` and :meth:`close` are called by the proxy's start and close; everything else by its
    request handlers, on its event loop.
    """

    def __init__(
        self,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        health_interval_s: float,
        max_connections: int,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
    ) -> None:
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise InvalidArgument("timeouts must be > 0")
        if health_interval_s < 0:
            raise InvalidArgument("health_interval_s must be >= 0")
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.health_interval_s = float(health_interval_s)
        self.max_connections = int(max_connections)
        if max_reply_bytes <= 0:
            raise InvalidArgument("max_reply_bytes must be > 0")
        self.max_reply_bytes = int(max_reply_bytes)
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None  # one connection per request: resends
        self._health_task: asyncio.Task[None] | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The open session (RuntimeError before :meth:`open`)."""
        if self._session is None:
            raise RuntimeError("proxy not started")
        return self._session

    async def open(self) -> None:
        """Create the session (connections kept alive for :data:`KEEPALIVE_S`), and the one that
        resends a request on a new connection (none kept)."""
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.connect_timeout_s, sock_read=self.timeout_s
        )
        connector = aiohttp.TCPConnector(
            limit=self.max_connections, limit_per_host=0, keepalive_timeout=KEEPALIVE_S
        )
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=True)
        fresh = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0, force_close=True)
        self._fresh = aiohttp.ClientSession(connector=fresh, timeout=timeout, auto_decompress=True)

    def start_polling(self, backends: Callable[[], list[Backend]]) -> None:
        """Poll the health of ``backends()`` every ``health_interval_s`` seconds (when not 0)."""
        if self.health_interval_s > 0 and self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop(backends), name="kvpool-proxy-health")

    async def close(self) -> None:
        """Stop polling and close every connection."""
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
            self._health_task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._fresh is not None:
            await self._fresh.close()
            self._fresh = None

    # -- health --------------------------------------------------------------------------------------

    async def check_health(self, backends: Sequence[Backend]) -> None:
        """Poll ``GET {url}/health`` of every backend once; mark each healthy (200) or unhealthy."""
        await asyncio.gather(*(self._check_one(b) for b in backends))

    async def _check_one(self, backend: Backend) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, min(self.health_interval_s, 10.0)))
        try:
            async with self.session.get(f"{backend.url}/health", timeout=timeout) as resp:
                await resp.read()
                if resp.status == 200:
                    backend.mark_up()
                else:
                    backend.mark_down(f"health check answered {resp.status}")
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            backend.mark_down(f"health check failed: {error_text(exc)}")

    async def _health_loop(self, backends: Callable[[], list[Backend]]) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_health(backends())
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the poller die
                _log.exception("health check round failed")

    # -- requests ------------------------------------------------------------------------------------

    async def send(
        self,
        pool: BackendPool,
        method: str,
        path: str,
        body: dict[str, Any] | bytes | BodyParts | None,
        headers: dict[str, str],
        prefer: Backend | None = None,
    ) -> tuple[aiohttp.ClientResponse, Backend]:
        """Send to the next healthy backend of ``pool``; on a connection failure mark it down and try the
        next one. ``body`` is a JSON object, or one encoded already (``openai_api.encode_body``, or
        its pieces: sent a piece at a time, made again for each try).
        Returns the response with its headers read (and ``backend.in_flight`` raised: the caller
        lowers it and releases the response) or raises :class:`BackendError` (5xx answers
        included)."""
        tried: list[Backend] = []
        failures: list[str] = []
        while True:
            backend = pool.pick(exclude=tried, prefer=prefer)
            if backend is None:
                if failures:
                    raise BackendError(502, f"cannot reach {pool.role} backend " + "; ".join(failures))
                raise BackendError(503, pool.unavailable_reason())
            tried.append(backend)
            backend.requests += 1
            try:
                resp = await self.request(method, backend, path, body, headers)
            except CONNECT_ERRORS as exc:
                backend.failures += 1
                reason = error_text(exc)
                if self.health_interval_s > 0:  # only the poller can bring it back
                    backend.mark_down(reason)
                failures.append(f"{backend.url}: {reason}")
                continue
            except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
                raise self.failure(backend, exc, "answer", "") from exc
            if resp.status >= 500:
                backend.failures += 1
                try:  # only what the message quotes, within the deadline: never the whole body
                    data = await asyncio.wait_for(resp.content.read(4096), self.timeout_s)
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    data = b""
                finally:
                    resp.close()  # the rest is not read: this connection is not reused
                raise BackendError(
                    502, f"{pool.role} backend {backend.url} answered {resp.status}: {snippet(data)}"
                )
            backend.in_flight += 1
            return resp, backend

    async def request(
        self,
        method: str,
        backend: Backend,
        path: str,
        body: dict[str, Any] | bytes | BodyParts | None,
        headers: dict[str, str],
    ) -> aiohttp.ClientResponse:
        """One request to ``backend`` (``body``: a JSON object, or one encoded already, whole or in
        pieces: a body of tens of MiB handed to aiohttp whole is copied into the socket's buffer on
        the event loop, ~50 ms per 33 MiB), sent once more, on a new connection, when the first
        try cannot have reached the server's handler:

        * the connection is closed before any answer: a kept-alive connection the server closed
          (its keep-alive timeout) as the request went out looks just like that;
        * the connection fails (reset, broken pipe) before aiohttp has taken the last piece of a
          body sent in pieces: the server never had all of the body (a request whose whole body
          was sent is not sent again: the server may be running it)."""
        kw: dict[str, Any] = {"json": body, "headers": headers}
        whole = [True]  # False until aiohttp has taken the last piece of a body sent in pieces
        if isinstance(body, bytes):
            kw = {"data": body, "headers": {**headers, "Content-Type": "application/json"}}
        elif isinstance(body, BodyParts):
            length = {"Content-Type": "application/json", "Content-Length": str(body.size)}
            data = body.payload()
            if not isinstance(data, bytes):
                whole[0] = False
                data = _taken(data, whole)
            kw = {"data": data, "headers": {**headers, **length}}
        try:
            return await self.session.request(method, backend.url + path, **kw)
        except aiohttp.ServerDisconnectedError:
            _log.info(
                "%s backend %s closed the connection unanswered; sending once more", backend.role, backend.url
            )
        except (aiohttp.ClientConnectorError, asyncio.TimeoutError):
            raise
        except aiohttp.ClientConnectionError as exc:
            if whole[0]:  # the server may have all of it
                raise
            _log.info(
                "%s backend %s: the connection failed while the request's body was sent (%s); sending "
                "once more on a new connection",
                backend.role, backend.url, error_text(exc),
            )  # fmt: skip
        if isinstance(body, BodyParts):  # the pieces again (the first try took some or all)
            kw["data"] = body.payload()
        assert self._fresh is not None
        return await self._fresh.request(method, backend.url + path, **kw)

    async def read(self, resp: aiohttp.ClientResponse, backend: Backend, limit: int | None = None) -> bytes:
        """The whole body of ``resp``, read within one deadline of ``timeout_s`` and at most ``limit``
        bytes (default ``max_reply_bytes``), or :class:`BackendError`: 504 past the deadline, 502 for
        a larger body or a failed connection (the connection is then dropped, not reused)."""
        limit = self.max_reply_bytes if limit is None else int(limit)
        try:
            data = await read_at_most(resp, limit, self.timeout_s)
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
            resp.close()
            raise self.failure(backend, exc, "finish its answer", " while answering") from exc
        if len(data) > limit:
            resp.close()
            backend.failures += 1
            raise BackendError(
                502, f"{backend.role} backend {backend.url} answered more than {limit} bytes (the limit)"
            )
        return data

    def failure(self, backend: Backend, exc: BaseException, waiting_for: str, during: str) -> BackendError:
        """Count a failed exchange with ``backend``: 504 for a timeout, 502 for anything else."""
        backend.failures += 1
        if isinstance(exc, asyncio.TimeoutError):
            return BackendError(
                504,
                f"{backend.role} backend {backend.url} did not {waiting_for} within {self.timeout_s:g} s "
                f"({error_text(exc)})",
            )
        return BackendError(502, f"{backend.role} backend {backend.url} failed{during}: {error_text(exc)}")
