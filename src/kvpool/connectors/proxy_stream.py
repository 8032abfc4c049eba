"""Parts of :class:`kvpool.connectors.proxy.PDProxy` that stream, mixed into it: the decode
half of a streaming P/D request sent beside its prefill (``--stream-kv``), the prefill half that
only feeds the side channel, and the copy of a decode's SSE stream to the client. Called on the
proxy's event loop, once per request; nothing here blocks it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
from aiohttp import web

from kvpool.connectors.backends import (
    Backend,
    BackendClient,
    BackendError,
    BackendPool,
    learn_peer,
    read_at_most,
)
from kvpool.connectors.openai_api import (
    ERROR_TYPES,
    BodyParts,
    error_response,
    error_text,
    loads_off_loop,
    snippet,
)

_log = logging.getLogger("kvpool.connectors.proxy")

# Errors writing to a client that went away.
_CLIENT_GONE: tuple[type[BaseException], ...] = (ConnectionResetError,) + (
    (aiohttp.ClientConnectionResetError,) if hasattr(aiohttp, "ClientConnectionResetError") else ()
)


class StreamHalves:
    """Streaming halves of P/D requests; state set up by ``PDProxy.__init__``."""

    client: BackendClient
    decode: BackendPool
    timeout_s: float
    max_prefill_reply_bytes: int

    def _count(self, key: str) -> None:
        raise NotImplementedError

    async def _decode_beside(
        self, ptask: asyncio.Task[str | None], pb: Backend, path: str, body: BodyParts,
        headers: dict[str, str], prefer: Backend | None,
    ) -> tuple[aiohttp.ClientResponse, Backend]:  # fmt: skip
        """Send the decode half of a streaming P/D request while its prefill half ``ptask`` runs.
        A failed prefill never sends the KV: the decode request is then dropped (vLLM aborts it),
        before its answer (502 naming the prefill) or during it (the answer is cut off)."""
        dtask = asyncio.ensure_future(
            self.client.send(self.decode, "POST", path, body, headers, prefer=prefer)
        )
        await asyncio.wait((ptask, dtask), return_when=asyncio.FIRST_COMPLETED)
        why = ptask.result() if ptask.done() and not ptask.cancelled() else None
        if why is not None:
            dtask.cancel()
            try:
                dresp, dbackend = await dtask
                dbackend.in_flight -= 1
                dresp.close()
            except (asyncio.CancelledError, BackendError):
                pass
            raise BackendError(502, f"prefill backend {pb.url} failed: {why}")
        dresp, dbackend = await dtask
        ptask.add_done_callback(lambda t: dresp.close() if not t.cancelled() and t.result() else None)
        return dresp, dbackend

    async def _prefill_streamed(
        self, backend: Backend, path: str, body: BodyParts, headers: dict[str, str], request_id: str
    ) -> str | None:
        """The prefill half of a streaming P/D request, next to its decode: its answer only updates
        the backend's side channel. Returns why it failed (the decode's answer is then cut off: its
        KV never comes) or None."""
        backend.requests += 1
        backend.in_flight += 1
        try:
            resp = await self.client.request("POST", backend, path, body, headers)
            try:
                data = await read_at_most(resp, self.max_prefill_reply_bytes, self.timeout_s)
                if len(data) > self.max_prefill_reply_bytes:
                    raise aiohttp.ClientPayloadError(
                        f"answer larger than {self.max_prefill_reply_bytes} bytes"
                    )
            finally:
                resp.release()  # a body not read to its end closes the connection
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
            backend.failures += 1
            _log.warning("prefill backend %s failed request %s: %s", backend.url, request_id, error_text(exc))
            return error_text(exc)
        finally:
            backend.in_flight -= 1
        if resp.status >= 400:
            if resp.status >= 500:
                backend.failures += 1
            _log.warning("prefill backend %s answered %d for request %s: %s",
                         backend.url, resp.status, request_id, snippet(data))  # fmt: skip
            return f"prefill answered {resp.status}"
        try:
            params = (await loads_off_loop(data)).get("kv_transfer_params")
        except (ValueError, RecursionError, AttributeError):
            params = None
        if isinstance(params, dict):
            learn_peer(backend, params)
        return None

    async def _stream_back(
        self,
        request: web.Request,
        dresp: aiohttp.ClientResponse,
        dbackend: Backend,
        request_id: str,
        on_first: Any = None,
    ) -> web.StreamResponse:
        """Copy the decode SSE stream to the client chunk by chunk.

        The first chunk is awaited before the reply headers go out, so a decode backend that fails or
        times out before sending anything still gets the client a proper 502/504."""
        chunks = dresp.content.iter_any().__aiter__()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            dbackend.failures += 1
            self._count("error")
            code = 504 if isinstance(exc, asyncio.TimeoutError) else 502
            what = f"sent nothing within {self.timeout_s:g} s" if code == 504 else "failed"
            return error_response(
                code, f"decode backend {dbackend.url} {what}: {error_text(exc)}", request_id
            )
        out = web.StreamResponse(
            status=dresp.status,
            headers={
                "Content-Type": dresp.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
                "X-Request-Id": request_id,
            },
        )
        if on_first is not None:
            on_first()
        await out.prepare(request)
        try:
            if first:
                await out.write(first)
            async for chunk in chunks:
                await out.write(chunk)
        except _CLIENT_GONE:
            self._count("client_disconnected")
            _log.info("client went away during the stream of request %s", request_id)
            return out
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            # Headers are gone already: end the stream with an error event clients can show.
            dbackend.failures += 1
            self._count("error")
            kind = "timed out" if isinstance(exc, asyncio.TimeoutError) else "failed"
            message = f"decode backend {dbackend.url} {kind} during the stream: {error_text(exc)}"
            _log.warning("%s (request %s)", message, request_id)
            code = 504 if isinstance(exc, asyncio.TimeoutError) else 502
            event = {"error": {"message": message, "type": ERROR_TYPES[code], "code": code}}
            try:
                await out.write(f"data: {json.dumps(event)}\n\n".encode())
                await out.write_eof()
            except _CLIENT_GONE:
                pass
            return out  # counted as an error only
        self._count("ok")
        try:
            await out.write_eof()
        except _CLIENT_GONE:
            pass
        return out
