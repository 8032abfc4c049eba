"""OpenAI-compatible prefill/decode (P/D) disaggregation proxy for vLLM, shipped as ``kvpool proxy``.

Clients talk to the proxy as if it were one vLLM OpenAI server.  For each ``/v1/completions`` or
``/v1/chat/completions`` request the proxy

1. picks a prefill and a decode backend round-robin, skipping those marked unhealthy;
2. sends the prefill backend a copy of the request with ``max_tokens=1`` (``max_completion_tokens=1``
   too when the client set it), ``stream=false``, no ``stream_options`` or ``min_tokens``, and
   ``kv_transfer_params={"do_remote_decode": true, ...}`` so that vLLM's KV connector (e.g.
   ``NixlConnector``) keeps the computed KV blocks for a remote decoder;
3. takes the top-level ``kv_transfer_params`` of the prefill reply and sends the *original* request to
   the decode backend with those parameters, which pulls the KV blocks and generates;
4. returns the decode reply: SSE chunks are passed through as they arrive for ``"stream": true``,
   the JSON body otherwise.

The client's ``Authorization`` header is forwarded to both backends, and both get the same
``X-Request-Id`` (the client's, or a fresh UUID), which is also set on the reply.

With ``policy`` set (``kvpool proxy --policy round-robin|load|cache|conductor``) the backends are
chosen by a :class:`kvpool.conductor.live.LiveRouter` instead: the request is tokenized, its blocks
are looked up in the prefix index (fed by the engines' KV events, or approximately from what was
routed), and the policy picks the instances -- or refuses the request with 429 and a reason when
the SLO gate predicts it cannot meet its TTFT/TBT SLO (before any prefill runs). With no decode
URLs (``--backends``) every instance serves whole requests (no P/D split; the request is forwarded
unchanged to the chosen one).

A body that is not a JSON object, nests deeper than 64 levels, or gives ``prompt``/``messages`` of the
wrong shape gets 400 with a one-line reason (and one log line at most).

Errors come back in OpenAI's shape, ``{"error": {"message", "type", "code"}}``, naming the backend
(role and URL) and the cause: 502 when a backend cannot be reached, answers 5xx or answers garbage,
504 when it times out, 503 when a role has no healthy backend left (then nothing is tried).  A 4xx
from a backend (a bad request) is passed back unchanged.  A backend that refuses connections is marked
unhealthy at once; a background task polls ``GET {url}/health`` of every backend every
``health_interval_s`` seconds and marks each healthy or unhealthy from the answer.  A backend that could
not be connected to is also retried on the next healthy one of its role, since the request never left.

``GET /health`` answers 200 when at least one prefill and one decode backend are healthy and 503 (with
the reason) otherwise; ``GET /v1/models`` is forwarded to a decode backend; ``GET /metrics`` serves
Prometheus text counters.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpool.connectors.backends import (
    DEFAULT_MAX_PREFILL_REPLY_BYTES,
    DEFAULT_MAX_REPLY_BYTES,
    Backend,
    BackendClient,
    BackendError,
    BackendPool,
    learn_peer,
    read_at_most,
)
from kvpool.connectors.openai_api import (
    BodyParts,
    RawBody,
    encode_body_parts,
    encode_ids_parts,
    error_response,
    error_text,
    loads_off_loop,
    parse_raw_body,
    prefill_request_body,
    read_body_chunks,
    snippet,
)
from kvpool.connectors.proxy_stream import StreamHalves
from kvpool.errors import InvalidArgument

__all__ = ["Backend", "BackendError", "PDProxy"]

_log = logging.getLogger(__name__)

#: Largest client request body accepted (long prompts and base64 images exceed aiohttp's 1 MiB).
DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024


class PDProxy(StreamHalves):
    """An aiohttp server that splits OpenAI completion requests into a prefill and a decode request.

    Args:
        prefill_urls: base URLs of the prefill vLLM servers (``http://host:port``).
        decode_urls: base URLs of the decode vLLM servers.
        timeout_s: longest wait for a backend to send anything (the prefill reply, the non-streaming
            decode reply, or the next streamed chunk) before the client gets 504.
        connect_timeout_s: longest wait to open a connection to a backend.
        health_interval_s: seconds between health polls of every backend; 0 disables polling, and then
            backends are never marked unhealthy (nothing would bring them back).
        max_connections: total connections to backends kept by the shared client session.
        max_request_bytes: largest client request body accepted.
        max_reply_bytes: largest non-streamed backend answer (a completion, ``/v1/models``) read, each
            within one deadline of ``timeout_s`` for the whole body; larger is a 502.
        max_prefill_reply_bytes: the same for a prefill's answer.
        router: route with a :class:`kvpool.conductor.live.LiveRouter` of this configuration
            (policy, KV events, SLOs) instead of plain round-robin.
        stream_kv: send the prefill and the decode request at once with a ``transfer_id``: the
            decode reads each layer's KV while the prefill computes the next (KvpoolConnector's
            streaming P/D). A prefill whose side channel the proxy has not learnt yet (from one
            answer of it) is used the sequential way once.

    With no ``decode_urls`` the ``prefill_urls`` are aggregated instances that serve whole requests.

    Use :meth:`start` and :meth:`close` on a running event loop, or :func:`run_proxy` to block.
    """

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        *,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 10.0,
        health_interval_s: float = 5.0,
        max_connections: int = 1024,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
        max_prefill_reply_bytes: int = DEFAULT_MAX_PREFILL_REPLY_BYTES,
        router: Any = None,
        stream_kv: bool = False,
    ) -> None:
        self.client = BackendClient(
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            health_interval_s=health_interval_s,
            max_connections=max_connections,
            max_reply_bytes=max_reply_bytes,
        )
        if max_prefill_reply_bytes <= 0:
            raise InvalidArgument("max_prefill_reply_bytes must be > 0")
        self.max_prefill_reply_bytes = int(max_prefill_reply_bytes)
        self.aggregated = not decode_urls
        self.prefill = BackendPool("backend" if self.aggregated else "prefill", prefill_urls)
        self.decode = self.prefill if self.aggregated else BackendPool("decode", decode_urls)
        self.router: Any = None
        if router is not None:
            from kvpool.conductor.live import LiveRouter

            urls = [b.url for b in self.prefill.backends]
            roles = ["both"] * len(urls)
            if not self.aggregated:
                urls += [b.url for b in self.decode.backends]
                roles = ["prefill"] * len(roles) + ["decode"] * len(self.decode.backends)
            self.router = LiveRouter(urls, roles, router)
        self._by_url = {b.url: b for b in self.prefill.backends + self.decode.backends}
        self.stream_kv = bool(stream_kv)
        self.timeout_s = self.client.timeout_s
        self.max_request_bytes = int(max_request_bytes)
        self.host: str | None = None
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # background tasks (_keep)
        self._counts: dict[str, int] = {}
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)  # type: ignore[arg-type]  # collect() below
        self._started_at = time.time()

    # -- lifecycle -----------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://host:port`` of the listening proxy (after :meth:`start`)."""
        if self.port is None:
            raise RuntimeError("proxy not started")
        return f"http://{self.host}:{self.port}"

    @property
    def backends(self) -> list[Backend]:
        """All prefill backends, then all decode backends."""
        if self.aggregated:
            return list(self.prefill.backends)
        return self.prefill.backends + self.decode.backends

    @property
    def pools(self) -> list[BackendPool]:
        return [self.prefill] if self.aggregated else [self.prefill, self.decode]

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_request_bytes)
        app.router.add_post("/v1/completions", self._handle_generate)
        app.router.add_post("/v1/chat/completions", self._handle_generate)
        app.router.add_get("/v1/models", self._handle_models)
        app.router.add_get("/health", self._handle_health)
        app.router.add_get("/metrics", self._handle_metrics)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on ``host:port`` (0 = any free port), poll every backend's health once, start the
        background polling; return the bound port."""
        if self._runner is not None:
            raise RuntimeError("proxy already started")
        await self.client.open()
        runner = web.AppRunner(self._app(), access_log=None, handle_signals=False)
        try:
            if self.client.health_interval_s > 0:
                await self.check_health()  # begin with the real state (a refused connect answers at once)
            await runner.setup()
            await web.TCPSite(runner, host, port).start()
        except BaseException:
            await runner.cleanup()
            await self.client.close()
            raise
        self._runner = runner
        self.host = host
        self.port = int(runner.addresses[0][1])
        self.client.start_polling(lambda: self.backends)
        if self.router is not None:
            await self.router.start()
        _log.info("kvpool proxy listening on %s", self.url)
        return self.port

    async def close(self) -> None:
        """Stop listening, stop health polling and close backend connections."""
        for task in list(self._tasks):
            task.cancel()
        if self.router is not None:
            await self.router.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.client.close()

    def _keep(self, task: asyncio.Task[Any]) -> None:
        """Hold a background task (a hot-prefix copy, a streaming request's prefill half) until it
        is done; :meth:`close` cancels those still running."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def __aenter__(self) -> PDProxy:
        if self._runner is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def check_health(self) -> None:
        """Poll ``GET {url}/health`` of every backend once; mark each healthy (200) or unhealthy."""
        await self.client.check_health(self.backends)

    # -- handlers ------------------------------------------------------------------------------------

    def _count(self, key: str) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1

    async def _handle_health(self, request: web.Request) -> web.Response:
        reasons = [p.unavailable_reason() for p in self.pools if not p.any_healthy()]
        body: dict[str, Any] = {"status": "unavailable" if reasons else "ok"}
        if self.aggregated:
            body["backends"] = [b.as_dict() for b in self.prefill.backends]
        else:
            body["prefill"] = [b.as_dict() for b in self.prefill.backends]
            body["decode"] = [b.as_dict() for b in self.decode.backends]
        if self.router is not None:
            body["router"] = self.router.stats()
        if reasons:
            body["reason"] = "; ".join(reasons)
        return web.json_response(body, status=503 if reasons else 200)

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self._registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    def collect(self) -> Any:
        """Prometheus collector: request outcomes and per-backend health, load and failures."""
        outcomes = CounterMetricFamily("kvpool_proxy_requests", "Requests by outcome", labels=["outcome"])
        for k, v in sorted(self._counts.items()):
            outcomes.add_metric([k], v)
        yield outcomes
        for name, doc, family, attr in (
            (
                "kvpool_proxy_backend_healthy",
                "1 when the backend passes health checks",
                GaugeMetricFamily,
                "healthy",
            ),
            (
                "kvpool_proxy_backend_requests",
                "Requests sent to the backend",
                CounterMetricFamily,
                "requests",
            ),
            (
                "kvpool_proxy_backend_failures",
                "Failed requests to the backend",
                CounterMetricFamily,
                "failures",
            ),
            ("kvpool_proxy_backend_in_flight", "Requests in flight", GaugeMetricFamily, "in_flight"),
        ):
            m = family(name, doc, labels=["role", "url"])
            for b in self.backends:
                m.add_metric([b.role, b.url], int(getattr(b, attr)))
            yield m
        if self.router is not None:
            yield from self.router.metrics()

    def _backend_headers(self, request: web.Request, request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id}
        auth = request.headers.get("Authorization")
        if auth:
            headers["Authorization"] = auth
        return headers

    async def _handle_models(self, request: web.Request) -> web.StreamResponse:
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        headers = self._backend_headers(request, request_id)
        try:
            resp, backend = await self.client.send(self.decode, "GET", "/v1/models", None, headers)
            try:
                data = await self.client.read(resp, backend)
            finally:
                backend.in_flight -= 1
                resp.release()
        except BackendError as exc:
            return error_response(exc.status, exc.message, request_id)
        return web.Response(
            body=data,
            status=resp.status,
            content_type=resp.content_type or "application/json",
            headers={"X-Request-Id": request_id},
        )

    async def _read_body(self, request: web.Request, request_id: str) -> RawBody | web.Response:
        """The request's JSON object (with its text, to send it on), or the 400 reply saying in one
        line what is wrong with it."""
        chat = request.path.endswith("/chat/completions")

        def parse(chunks: list[bytes]) -> RawBody:
            raw = parse_raw_body(b"".join(chunks))
            if self.router is not None:  # the fields it reads (4.3M token ids: 0.2 s to check)
                from kvpool.conductor.live import request_text

                request_text(raw.obj, chat)
            return raw

        chunks, size = await read_body_chunks(request, self.max_request_bytes)
        try:
            return await asyncio.to_thread(parse, chunks) if size > 1 << 20 else parse(chunks)
        except ValueError as exc:
            self._count("bad_request")
            _log.info("request %s refused: %s", request_id, exc)
            return error_response(400, str(exc), request_id)

    async def _tokenize(self, payload: dict[str, Any], raw: RawBody | None = None) -> Any:
        """``POST /tokenize`` on a healthy backend (the router's tokenizer when none is local): its
        JSON answer, or None for another status or an answer over ``max_reply_bytes``, all read
        within 10 s (at most ``timeout_s``). ``payload`` is encoded by ``encode_body`` (the prompt
        or messages copied from the client's text ``raw``); a large answer is parsed in a thread.
        Called by ``LiveRouter.prompt_tokens``."""
        b = self.prefill.pick()
        if b is None:
            return None
        limit = self.client.max_reply_bytes
        deadline_s = min(self.timeout_s, 10.0)
        timeout = aiohttp.ClientTimeout(total=deadline_s)
        sent = BodyParts(encode_body_parts(payload, raw))
        headers = {"Content-Type": "application/json", "Content-Length": str(sent.size)}
        async with self.client.session.post(
            f"{b.url}/tokenize", data=sent.payload(), headers=headers, timeout=timeout
        ) as resp:
            if resp.status != 200:
                return None
            data = await read_at_most(resp, limit, deadline_s)
            if len(data) > limit:
                resp.close()  # the rest is never read: this connection is not reused
                _log.info("backend %s answered /tokenize with more than %d bytes", b.url, limit)
                return None
        return await loads_off_loop(data)  # millions of ids: an array('I')

    async def _route(
        self, raw: RawBody, path: str, rkey: str, request_id: str
    ) -> tuple[Any, Backend | None, Backend | None] | web.Response:
        """Ask the router: (decision, prefill backend, decode backend), or the 429/503 reply."""
        router = self.router
        body = raw.obj
        for b in self.backends:
            router.set_health(b.url, b.healthy)
        tokens = await router.prompt_tokens(
            raw.obj, path.endswith("/chat/completions"), lambda payload: self._tokenize(payload, raw)
        )
        d, req = router.decide(rkey, tokens, body, await router.prompt_hashes(tokens, body))
        if d.reject:
            status = 503 if d.reject == "no_instance" else 429
            self._count("rejected_" + d.reject)
            return error_response(status, f"request refused before prefill: {d.reject_reason}", request_id)
        router.dispatched(d, req)
        copy = router.plan_copy(d, req, tokens)
        if copy is not None:  # a hot prefix: warm a spare instance in the background
            task = asyncio.create_task(self._copy_prefix(*copy, body.get("model")), name="kvpool-hot-copy")
            self._keep(task)
        pb = self._by_url.get(d.prefill.url) if d.prefill is not None else None
        db = self._by_url.get(d.decode.url) if d.decode is not None else None
        return d, pb, db

    async def _copy_prefix(self, inst: Any, tokens: Sequence[int], n: int, rid: str, model: Any) -> None:
        """One hot-prefix copy (see ``LiveRouter.plan_copy``): a ``max_tokens=1`` completion of the
        prefix's token ids ``tokens[:n]`` on ``inst``, which then holds the prefix's blocks
        (computed, or loaded from the kvpool store by its ``KvpoolStoreConnector``). Runs as a
        background task; the body of a long prefix is encoded in a thread and sent in pieces. The
        answer (one token) is read within ``timeout_s`` and at most ``max_prefill_reply_bytes``: a
        larger one fails the copy (counted as ``hot_copies_failed``) and drops the connection."""
        ok = False
        head: dict[str, Any] = {"max_tokens": 1}
        if isinstance(model, str):
            head["model"] = model
        limit = self.max_prefill_reply_bytes
        try:
            if n > 1 << 16:
                parts = await asyncio.to_thread(encode_ids_parts, head, "prompt", tokens, n)
            else:
                parts = encode_ids_parts(head, "prompt", tokens, n)
            sent = BodyParts(parts)
            timeout = aiohttp.ClientTimeout(total=self.timeout_s, connect=self.client.connect_timeout_s)
            headers = {"X-Request-Id": rid, "Content-Type": "application/json"}
            headers["Content-Length"] = str(sent.size)
            url = f"{inst.url}/v1/completions"
            async with self.client.session.post(
                url, data=sent.payload(), timeout=timeout, headers=headers
            ) as resp:
                data = await read_at_most(resp, limit, self.timeout_s)
                if len(data) > limit:
                    resp.close()  # the rest is never read: this connection is not reused
                    raise aiohttp.ClientPayloadError(f"answer larger than {limit} bytes (the limit)")
                ok = resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            _log.info("hot-prefix copy %s to %s failed: %s", rid, inst.url, error_text(exc))
        finally:
            if self.router is not None:
                self.router.copy_done(rid, ok)

    async def _handle_generate(self, request: web.Request) -> web.StreamResponse:
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        path = request.path
        raw = await self._read_body(request, request_id)
        if isinstance(raw, web.Response):
            return raw
        # Refuse before doing anything when either side has nobody to serve.
        for pool in self.pools:
            if not pool.any_healthy():
                self._count("unavailable")
                return error_response(503, pool.unavailable_reason(), request_id)
        prefer_p = prefer_d = None
        rkey = uuid.uuid4().hex
        if self.router is not None:
            routed = await self._route(raw, path, rkey, request_id)
            if isinstance(routed, web.Response):
                return routed
            _, prefer_p, prefer_d = routed
        ok = False
        try:
            resp = await self._generate(request, raw, path, request_id, rkey, prefer_p, prefer_d)
            ok = resp.status < 400
            return resp
        finally:
            if self.router is not None:
                self.router.finished(rkey, ok)

    async def _generate(
        self, request: web.Request, raw: RawBody, path: str, request_id: str, rkey: str,
        prefer_p: Backend | None, prefer_d: Backend | None,
    ) -> web.StreamResponse:  # fmt: skip
        """Forward the client's request: the bodies sent are top-level copies of it with a few keys
        changed, encoded by ``encode_body_parts`` (the client's big values are copied as text) and
        sent a piece at a time (``BodyParts``)."""
        body = raw.obj
        headers = self._backend_headers(request, request_id)
        stream = bool(body.get("stream", False))
        router = self.router

        def first() -> None:
            if router is not None:
                router.first_token(rkey)

        ptask: asyncio.Task[str | None] | None = None
        try:
            if self.aggregated:
                # A client's own kv_transfer_params would make the backend's KV connector read from
                # a host and blocks the client names: never forwarded.
                sent = {k: v for k, v in body.items() if k != "kv_transfer_params"}
                dresp, dbackend = await self.client.send(
                    self.prefill,
                    "POST",
                    path,
                    BodyParts(encode_body_parts(sent, raw)),
                    headers,
                    prefer=prefer_p,
                )
            elif self.stream_kv and (pb := self.prefill.pick(prefer=prefer_p)) is not None and pb.kv_peer:
                # Streaming P/D: both at once; the decode reads the KV while the prefill computes it.
                tid = uuid.uuid4().hex
                pbody = prefill_request_body(body)
                pbody["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": tid}
                decode_body = dict(body)
                decode_body["kv_transfer_params"] = {
                    "do_remote_prefill": True,
                    "transfer_id": tid,
                    **pb.kv_peer,
                }
                psent = BodyParts(encode_body_parts(pbody, raw))
                dsent = BodyParts(encode_body_parts(decode_body, raw))
                ptask = asyncio.create_task(self._prefill_streamed(pb, path, psent, headers, request_id))
                self._keep(ptask)
                dresp, dbackend = await self._decode_beside(ptask, pb, path, dsent, headers, prefer_d)
                if dresp.status >= 400:  # the decode will not read the KV: stop the prefill too
                    ptask.cancel()
            else:
                # 1. Prefill.
                psent = BodyParts(encode_body_parts(prefill_request_body(body), raw))
                presp, pbackend = await self.client.send(
                    self.prefill, "POST", path, psent, headers, prefer=prefer_p
                )
                try:
                    pdata = await self.client.read(presp, pbackend, self.max_prefill_reply_bytes)
                finally:
                    pbackend.in_flight -= 1
                    presp.release()
                if presp.status >= 400:  # 4xx: the client's fault; pass it back as is
                    self._count("prefill_rejected")
                    return web.Response(
                        body=pdata,
                        status=presp.status,
                        content_type=presp.content_type or "application/json",
                        headers={"X-Request-Id": request_id},
                    )
                first()
                try:
                    pjson = await loads_off_loop(pdata)
                except (ValueError, RecursionError):
                    pbackend.failures += 1
                    raise BackendError(
                        502,
                        f"prefill backend {pbackend.url} answered {presp.status} with a body that is not "
                        f"JSON: {snippet(pdata)}",
                    ) from None
                kv_params = pjson.get("kv_transfer_params") if isinstance(pjson, dict) else None
                if not isinstance(kv_params, dict):
                    kv_params = None  # a backend's garbage: the decode recomputes the prompt
                decode_body = dict(body)
                if kv_params is None:
                    _log.warning(
                        "prefill backend %s returned no kv_transfer_params for request %s; decode will "
                        "recompute the prompt (is the KV connector configured with kv_role "
                        "kv_producer/kv_both?)",
                        pbackend.url,
                        request_id,
                    )
                    decode_body.pop("kv_transfer_params", None)
                else:
                    decode_body["kv_transfer_params"] = kv_params
                    learn_peer(pbackend, kv_params)

                # 2. Decode.
                dresp, dbackend = await self.client.send(
                    self.decode,
                    "POST",
                    path,
                    BodyParts(encode_body_parts(decode_body, raw)),
                    headers,
                    prefer=prefer_d,
                )
        except BackendError as exc:
            self._count("error")
            if ptask is not None:
                ptask.cancel()
            return error_response(exc.status, exc.message, request_id)

        try:
            if not stream or dresp.status != 200:
                try:
                    ddata = await self.client.read(dresp, dbackend)
                except BackendError as exc:
                    self._count("error")
                    return error_response(exc.status, exc.message, request_id)
                first()
                self._count("ok" if dresp.status < 400 else "decode_rejected")
                return web.Response(
                    body=ddata,
                    status=dresp.status,
                    content_type=dresp.content_type or "application/json",
                    headers={"X-Request-Id": request_id},
                )
            return await self._stream_back(request, dresp, dbackend, request_id, on_first=first)
        finally:
            dbackend.in_flight -= 1
            dresp.release()
