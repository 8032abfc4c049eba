"""``kvpool proxy`` (kvpool.connectors.proxy) against fake vLLM servers on loopback.

``FakeVllm`` is a test double of a vLLM OpenAI server: it records every body and header it gets and
answers canned completions; as a prefill it returns ``kv_transfer_params`` naming itself, as a decode
it answers SSE (several ``data:`` chunks, then ``data: [DONE]``) or JSON.  Each test runs the fakes,
the proxy and an aiohttp client on one event loop (``asyncio.run``); the CLI test starts the proxy as
a real subprocess.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import sys
import time
from array import array
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from kvpool.child import free_port
from kvpool.connectors.proxy import PDProxy

CHUNKS = ["Hello", ",", " world", "!"]


class FakeVllm:
    """Test double of one vLLM OpenAI server (role ``"prefill"`` or ``"decode"``).

    ``status`` makes the generation routes answer that status with an error body; ``delay_s`` delays
    their answer; ``chunk_delay_s`` spaces the SSE chunks; ``kv_params=False`` leaves
    ``kv_transfer_params`` out of the prefill answer; ``healthy=False`` makes ``/health`` answer 503;
    ``drop_next`` closes the connection of that many next generation requests unanswered (as uvicorn
    does to a kept-alive connection whose timeout ends as a request arrives).
    """

    def __init__(
        self,
        name: str,
        role: str,
        *,
        status: int = 200,
        delay_s: float = 0.0,
        chunk_delay_s: float = 0.0,
        kv_params: bool = True,
    ) -> None:
        self.name = name
        self.role = role
        self.status = status
        self.delay_s = delay_s
        self.chunk_delay_s = chunk_delay_s
        self.kv_params = kv_params
        self.healthy = True
        self.drop_next = 0
        self.dropped = 0
        self.bodies: list[dict[str, Any]] = []
        self.raw: list[bytes] = []  # the bodies as they came
        self.headers: list[CIMultiDict[str]] = []
        self.paths: list[str] = []
        self.arrivals: list[float] = []
        self.last_chunk_sent_at: float | None = None
        self.url = ""
        self._runner: web.AppRunner | None = None

    def kv_transfer_params(self, n: int) -> dict[str, Any]:
        """What this fake prefill returns for its ``n``-th request."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"engine-{self.name}",
            "remote_block_ids": [n, n + 1, n + 2],
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
        }

    async def start(self) -> str:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/tokenize", self._tokenize)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.paths.append(request.path)
        words = str(body.get("prompt", "")).split()
        return web.json_response({"tokens": [sum(map(ord, w)) for w in words], "count": len(words)})

    async def _models(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        self.headers.append(request.headers.copy())
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "owned_by": self.name}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        if self.drop_next > 0 and request.transport is not None:
            self.drop_next -= 1
            self.dropped += 1
            await request.read()  # all of it: a body larger than the socket buffers is not reset
            request.transport.close()
            raise asyncio.CancelledError  # nothing more on this connection
        body = await request.json()
        self.raw.append(await request.read())
        n = len(self.bodies)
        self.arrivals.append(time.monotonic())
        self.bodies.append(body)
        self.headers.append(request.headers.copy())
        self.paths.append(request.path)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.status != 200:
            return web.json_response(
                {"error": {"message": f"{self.name} says no", "code": self.status}}, status=self.status
            )
        chat = request.path.endswith("/chat/completions")
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i, text in enumerate(CHUNKS):
                delta = {"delta": {"content": text}} if chat else {"text": text}
                chunk = {"id": f"{self.name}-{n}", "seq": i, "choices": [{"index": 0, **delta}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.last_chunk_sent_at = time.monotonic()
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        text = "".join(CHUNKS[: body.get("max_tokens") or len(CHUNKS)])
        choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        out: dict[str, Any] = {"id": f"{self.name}-{n}", "served_by": self.name, "choices": [choice]}
        if self.role == "prefill" and self.kv_params:
            out["kv_transfer_params"] = self.kv_transfer_params(n)
        return web.json_response(out)


@asynccontextmanager
async def running(
    prefills: list[FakeVllm], decodes: list[FakeVllm], down: tuple[str, ...] = (), **proxy_kw: Any
) -> AsyncIterator[tuple[PDProxy, aiohttp.ClientSession]]:
    """Start the fakes and a proxy in front of them (plus closed-port URLs ``down`` as decode
    backends); yield the proxy and a client session."""
    for f in prefills + decodes:
        await f.start()
    proxy_kw.setdefault("health_interval_s", 60.0)
    proxy = PDProxy([f.url for f in prefills], [f.url for f in decodes] + list(down), **proxy_kw)
    await proxy.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
            yield proxy, client
    finally:
        await proxy.close()
        for f in prefills + decodes:
            await f.stop()


def run(coro_fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 15))


def sse_events(raw: str) -> list[str]:
    return [line[len("data: ") :] for line in raw.split("\n") if line.startswith("data: ")]


def test_completions_non_streaming() -> None:
    async def go() -> None:
        p, d = FakeVllm("p0", "prefill"), FakeVllm("d0", "decode")
        async with running([p], [d]) as (proxy, client):
            req = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream_options": {"x": 1}, "min_tokens": 2}
            hdrs = {"Authorization": "Bearer sk-test", "X-Request-Id": "req-42"}
            async with client.post(f"{proxy.url}/v1/completions", json=req, headers=hdrs) as r:
                assert r.status == 200
                assert r.headers["X-Request-Id"] == "req-42"
                out = await r.json()
            assert out["served_by"] == "d0"
            assert out["choices"][0]["text"] == "Hello, world"

            (pb,) = p.bodies
            assert pb["max_tokens"] == 1 and pb["stream"] is False
            assert "stream_options" not in pb and "min_tokens" not in pb
            assert pb["kv_transfer_params"] == {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            }
            assert pb["prompt"] == "hi"
            (db,) = d.bodies
            assert db["kv_transfer_params"] == p.kv_transfer_params(0)
            assert db["max_tokens"] == 3 and db["stream_options"] == {"x": 1} and db["min_tokens"] == 2
            assert db["prompt"] == "hi" and "stream" not in db
            for h in (p.headers[0], d.headers[0]):
                assert h["Authorization"] == "Bearer sk-test"
                assert h["X-Request-Id"] == "req-42"

    run(go)


def test_completions_streaming_chunks_flow_in_order() -> None:
    async def go() -> None:
        p, d = FakeVllm("p0", "prefill"), FakeVllm("d0", "decode", chunk_delay_s=0.15)
        async with running([p], [d]) as (proxy, client):
            req = {"model": "m", "prompt": "hi", "max_tokens": 8, "stream": True}
            arrivals: list[float] = []
            raw = b""
            async with client.post(f"{proxy.url}/v1/completions", json=req) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/event-stream")
                rid = r.headers["X-Request-Id"]
                async for chunk in r.content.iter_any():
                    arrivals.append(time.monotonic())
                    raw += chunk
            events = sse_events(raw.decode())
            assert events[-1] == "[DONE]"
            parsed = [json.loads(e) for e in events[:-1]]
            assert [e["seq"] for e in parsed] == list(range(len(CHUNKS)))
            assert "".join(e["choices"][0]["text"] for e in parsed) == "".join(CHUNKS)
            # Passed through as they came: the first bytes arrived before the fake sent its last chunk.
            assert d.last_chunk_sent_at is not None and arrivals[0] < d.last_chunk_sent_at
            assert len(arrivals) >= 2

            (pb,) = p.bodies
            assert pb["stream"] is False and pb["max_tokens"] == 1
            (db,) = d.bodies
            assert db["stream"] is True and db["max_tokens"] == 8
            assert db["kv_transfer_params"] == p.kv_transfer_params(0)
            assert p.headers[0]["X-Request-Id"] == d.headers[0]["X-Request-Id"] == rid
            assert len(rid) >= 32  # generated

    run(go)


def test_chat_completions_streaming_and_not() -> None:
    async def go() -> None:
        p, d = FakeVllm("p0", "prefill"), FakeVllm("d0", "decode")
        async with running([p], [d]) as (proxy, client):
            msgs = [{"role": "user", "content": "hi"}]
            req = {"model": "m", "messages": msgs, "max_completion_tokens": 50, "max_tokens": 50}
            async with client.post(f"{proxy.url}/v1/chat/completions", json=req) as r:
                assert r.status == 200
                out = await r.json()
            assert out["choices"][0]["message"]["content"] == "".join(CHUNKS)
            pb = p.bodies[0]
            assert pb["max_completion_tokens"] == 1 and pb["max_tokens"] == 1
            assert pb["messages"] == msgs
            assert d.bodies[0]["max_completion_tokens"] == 50
            assert p.paths == d.paths == ["/v1/chat/completions"]

            req = {"model": "m", "messages": msgs, "stream": True, "stream_options": {"include_usage": True}}
            async with client.post(f"{proxy.url}/v1/chat/completions", json=req) as r:
                assert r.status == 200
                events = sse_events(await r.text())
            assert events[-1] == "[DONE]"
            got = "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1])
            assert got == "".join(CHUNKS)
            assert "max_completion_tokens" not in p.bodies[1] and p.bodies[1]["max_tokens"] == 1
            assert "stream_options" not in p.bodies[1]
            assert d.bodies[1]["stream_options"] == {"include_usage": True}
            assert d.bodies[1]["kv_transfer_params"] == p.kv_transfer_params(1)

    run(go)


def test_stream_kv_sends_prefill_and_decode_at_once_with_one_transfer_id() -> None:
    async def go() -> None:
        p, d = FakeVllm("p0", "prefill"), FakeVllm("d0", "decode")
        async with running([p], [d], stream_kv=True) as (proxy, client):
            req = {"model": "m", "prompt": "hi", "max_tokens": 3}
            async with client.post(f"{proxy.url}/v1/completions", json=req) as r:
                assert r.status == 200  # the first one is sequential: it teaches the prefill's side channel
            assert d.bodies[0]["kv_transfer_params"] == p.kv_transfer_params(0)
            p.delay_s = 0.5
            async with client.post(f"{proxy.url}/v1/completions", json=req) as r:
                assert r.status == 200
                assert (await r.json())["served_by"] == "d0"
            pp, dp = p.bodies[1]["kv_transfer_params"], d.bodies[1]["kv_transfer_params"]
            assert pp == {"do_remote_decode": True, "transfer_id": dp["transfer_id"]}
            assert len(dp["transfer_id"]) == 32
            assert dp == {"do_remote_prefill": True, "transfer_id": pp["transfer_id"],
                          "remote_host": "127.0.0.1", "remote_port": 5600, "remote_engine_id": "engine-p0",
                          "tp_size": None}  # fmt: skip
            assert d.arrivals[1] < p.arrivals[1] + 0.4  # the decode did not wait for the prefill's answer
            # A prefill that fails never sends the KV: the decode's answer is cut off, no hang.
            p.delay_s, p.status, d.delay_s = 0.0, 500, 5.0
            t0 = time.monotonic()
            async with client.post(f"{proxy.url}/v1/completions", json=req) as r:
                assert r.status == 502
                assert "prefill backend" in (await r.json())["error"]["message"]
            assert time.monotonic() - t0 < 3
            # ... and so is a streamed answer that already began.
            p.delay_s, d.delay_s, d.chunk_delay_s = 0.3, 0.0, 1.0
            t0 = time.monotonic()
            async with client.post(f"{proxy.url}/v1/completions", json={**req, "stream": True}) as r:
                assert r.status == 200
                raw = await r.text()
            assert "[DONE]" not in raw and time.monotonic() - t0 < 3

    run(go)


def test_round_robin_across_two_prefill_and_two_decode() -> None:
    async def go() -> None:
        ps = [FakeVllm("p0", "prefill"), FakeVllm("p1", "prefill")]
        ds = [FakeVllm("d0", "decode"), FakeVllm("d1", "decode")]
        async with running(ps, ds) as (proxy, client):
            served = []
            for i in range(4):
                req = {"model": "m", "prompt": f"q{i}", "max_tokens": 2}
                async with client.post(f"{proxy.url}/v1/completions", json=req) as r:
                    assert r.status == 200
                    served.append((await r.json())["served_by"])
            assert served == ["d0", "d1", "d0", "d1"]
            assert [b["prompt"] for b in ps[0].bodies] == ["q0", "q2"]
            assert [b["prompt"] for b in ps[1].bodies] == ["q1", "q3"]
            # Each decode got the kv_transfer_params of the prefill that served the same request.
            assert [b["kv_transfer_params"]["remote_engine_id"] for b in ds[0].bodies] == ["engine-p0"] * 2
            assert [b["kv_transfer_params"]["remote_engine_id"] for b in ds[1].bodies] == ["engine-p1"] * 2
            assert all(b.in_flight == 0 and b.requests == 2 for b in proxy.backends)

    run(go)


def test_decode_going_down_gives_502_naming_it_then_503_without_trying() -> None:
    async def go() -> None:
        p, d = FakeVllm("p0", "prefill"), FakeVllm("d0", "decode")
        async with running([p], [d]) as (proxy, client):
            await d.stop()  # its port is closed now; the proxy's next health poll is a minute away
            t0 = time.monotonic()
            async with client.post(f"{proxy.url}/v1/completions", json={"prompt": "x", "max_tokens": 4}) as r:
                assert r.status == 502
                err = (await r.json())["error"]
            assert time.monotonic() - t0 < 5
            assert d.url in err["message"] and "decode" in err["message"]
            assert err["code"] == 502 and err["type"] == "bad_gateway"

            async with client.get(f"{proxy.url}/health") as r:
                assert r.status == 503
                h = await r.json()
            assert "decode" in h["reason"] and d.url in h["reason"]
            assert h["decode"][0]["healthy"] is False and h["prefill"][0]["healthy"] is True

            async with client.post(f"{proxy.url}/v1/completions", json={"prompt": "y"}) as r:
                assert r.status == 503
                err = (await r.json())["error"]
            assert d.url in err["message"] and err["type"] == "service_unavailable"
            assert len(p.bodies) == 1  # the second request was refused before prefill

    run(go)


def test_closed_port_decode_is_unhealthy_from_the_start() -> None:
    async def go() -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        p = FakeVllm("p0", "prefill")
        async with running([p], [], down=(dead,)) as (proxy, client):
            async with client.get(f"{proxy.url}/health") as r:
                assert r.status == 503
                assert dead in (await r.json())["reason"]
            t0 = time.monotonic()
            async with client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 503
                assert dead in (await r.json())["error"]["message"]
            assert time.monotonic() - t0 < 5
            assert p.bodies == []

    run(go)


def test_connection_failure_fails_over_to_other_decode() -> None:
    async def go() -> None:
        p = FakeVllm("p0", "prefill")
        d0, d1 = FakeVllm("d0", "decode"), FakeVllm("d1", "decode")
        async with running([p], [d0, d1]) as (proxy, client):
            await d1.stop()  # refuses connections from now on
            for i in range(3):
                async with client.post(f"{proxy.url}/v1/completions", json={"prompt": f"q{i}"}) as r:
                    assert r.status == 200
                    assert (await r.json())["served_by"] == "d0"
            assert len(d0.bodies) == 3 and len(p.bodies) == 3
            async with client.get(f"{proxy.url}/health") as r:
                assert r.status == 200
                states = {b["url"]: b["healthy"] for b in (await r.json())["decode"]}
            assert states == {d0.url: True, d1.url: False}

    run(go)


@pytest.mark.parametrize("prompt", ["hi", "word " * 400_000])
def test_request_closed_unanswered_on_a_kept_alive_connection_is_sent_once_more(prompt: str) -> None:
    """A server may close an idle kept-alive connection just as the proxy sends on it (uvicorn after
    5 s): the request is sent once more on a new connection, not failed with 502.  Twice in a row is
    a failure (502 naming the backend), not a loop. A body over 1 MiB (sent a piece at a time) is
    sent whole again."""

    async def go() -> None:
        p, d = FakeVllm("p0", "prefill"), FakeVllm("d0", "decode")
        async with running([p], [d]) as (proxy, client):
            req = {"model": "m", "prompt": prompt, "max_tokens": 2}
            for _ in range(2):  # the second request goes out on the kept-alive connections
                async with client.post(f"{proxy.url}/v1/completions", json=req) as r:
                    assert r.status == 200, await r.text()
            p.drop_next = d.drop_next = 1
            async with client.post(f"{proxy.url}/v1/completions", json=req) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["served_by"] == "d0"
            assert p.dropped == d.dropped == 1
            assert len(p.bodies) == len(d.bodies) == 3  # each request handled once
            assert p.bodies[2]["prompt"] == d.bodies[2]["prompt"] == prompt
            p.drop_next = 2
            async with client.post(f"{proxy.url}/v1/completions", json=req) as r:
                assert r.status == 502
                assert p.url in (await r.json())["error"]["message"]
            assert p.dropped == 3 and len(p.bodies) == 3 and len(d.bodies) == 3  # no third try

    run(go)


class ResettingBackend:
    """A backend on a real socket (asyncio streams, HTTP/1.1 keep-alive) that answers every
    ``POST`` with a one-token completion, except that on its first connection the request
    numbered ``reset_at`` (1-based) is reset (RST, ``SO_LINGER`` 0) after ``read_before_reset``
    bytes of its body; ``bodies`` has (connection number, whole body) of every request it read
    whole."""

    def __init__(self, reset_at: int, read_before_reset: int) -> None:
        self.reset_at = reset_at
        self.read_before_reset = read_before_reset
        self.conns = 0
        self.resets = 0
        self.bodies: list[tuple[int, bytes]] = []
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import re
        import socket
        import struct

        self.conns += 1
        conn, n = self.conns, 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n += 1
                m = re.search(rb"(?i)content-length: *(\d+)", head)
                length = int(m.group(1)) if m else 0
                if conn == 1 and n == self.reset_at:
                    await reader.readexactly(min(length, self.read_before_reset))
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.resets += 1
                    writer.transport.abort()
                    return
                self.bodies.append((conn, await reader.readexactly(length)))
                out = json.dumps({"choices": [{"text": "x"}], "conn": conn}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(out)).encode() + b"\r\n\r\n" + out)  # fmt: skip
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def test_a_kept_alive_connection_reset_while_a_large_body_is_sent_is_resent_once_on_a_new_one() -> None:
    """A kept-alive backend connection reset while a 16 MiB body is being written (the backend
    read 64 KiB of it) made aiohttp raise ClientOSError, which was not resent: the client got
    502. The backend never had the whole body, so the request is sent once more on a new
    connection and served. A reset after the backend read the whole body is not resent (it may
    be running the request): 502, and the backend had it once."""

    async def go() -> None:
        prompt = "word " * ((16 << 20) // 5)
        req = {"model": "m", "prompt": prompt, "max_tokens": 1}
        for read_before_reset, status in ((1 << 16, 200), (1 << 30, 502)):
            backend = ResettingBackend(reset_at=2, read_before_reset=read_before_reset)
            url = await backend.start()
            proxy = PDProxy([url], [], health_interval_s=0)
            await proxy.start("127.0.0.1", 0)
            try:
                async with aiohttp.ClientSession() as client:
                    small = {"model": "m", "prompt": "hi", "max_tokens": 1}
                    async with client.post(f"{proxy.url}/v1/completions", json=small) as r:
                        assert r.status == 200 and (await r.json())["conn"] == 1
                    async with client.post(f"{proxy.url}/v1/completions", json=req) as r:
                        assert r.status == status, await r.text()
                        if status == 200:
                            assert (await r.json())["conn"] == 2  # a new connection
                        else:
                            assert url in (await r.json())["error"]["message"]
                assert backend.resets == 1
                big = [c for c, body in backend.bodies if len(body) > 1 << 20]
                assert big == ([2] if status == 200 else [])
                if status == 200:
                    assert json.loads(backend.bodies[-1][1])["prompt"] == prompt
            finally:
                await proxy.close()
                await backend.close()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_health_follows_backend_health_checks() -> None:
    async def go() -> None:
        p, d = FakeVllm("p0", "prefill"), FakeVllm("d0", "decode")
        async with running([p], [d], health_interval_s=0.1) as (proxy, client):

            async def health_status(want: int) -> dict[str, Any]:
                deadline = time.monotonic() + 5
                while True:
                    async with client.get(f"{proxy.url}/health") as r:
                        if r.status == want or time.monotonic() > deadline:
                            assert r.status == want
                            return await r.json()
                    await asyncio.sleep(0.05)

            assert (await health_status(200))["status"] == "ok"
            p.healthy = False
            h = await health_status(503)
            assert "prefill" in h["reason"] and p.url in h["reason"]
            async with client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 503
                assert "prefill" in (await r.json())["error"]["message"]
            p.healthy = True
            await health_status(200)
            async with client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200
            async with client.get(f"{proxy.url}/metrics") as r:
                assert r.status == 200
                text = await r.text()
                assert 'kvpool_proxy_backend_healthy{role="prefill",url="' in text
                assert 'kvpool_proxy_requests_total{outcome="ok"} 1' in text

    run(go)


def test_prefill_4xx_is_passed_back_and_5xx_is_502(caplog: Any) -> None:
    import logging

    async def go() -> None:
        p, d = FakeVllm("p0", "prefill", status=400), FakeVllm("d0", "decode")
        async with running([p], [d]) as (proxy, client):
            async with client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 400
                assert (await r.json())["error"]["message"] == "p0 says no"
            p.status = 500
            with caplog.at_level(logging.WARNING, logger="kvpool.connectors.proxy"):
                async with client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"}) as r:
                    assert r.status == 502
                    msg = (await r.json())["error"]["message"]
                    rid = r.headers["X-Request-Id"]
            assert "prefill" in msg and p.url in msg and "500" in msg
            # The operator sees what the client saw (the 400 above is not logged as a failure).
            logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert logged == [f"request {rid} answered 502: {msg}"], logged
            assert d.bodies == []
            async with client.post(f"{proxy.url}/v1/completions", data=b"{not json") as r:
                assert r.status == 400

    run(go)


def test_decode_timeout_is_504_and_missing_kv_params_still_decodes() -> None:
    async def go() -> None:
        p = FakeVllm("p0", "prefill", kv_params=False)
        d = FakeVllm("d0", "decode", delay_s=2.0)
        async with running([p], [d], timeout_s=0.3) as (proxy, client):
            t0 = time.monotonic()
            async with client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 504
                msg = (await r.json())["error"]["message"]
            assert time.monotonic() - t0 < 1.5
            assert "decode" in msg and d.url in msg
            # The prefill sent no kv_transfer_params: decode was still asked, without them.
            assert "kv_transfer_params" not in d.bodies[0]
            # Streaming, nothing sent yet when the time is up: still a proper 504 reply.
            async with client.post(f"{proxy.url}/v1/completions", json={"prompt": "x", "stream": True}) as r:
                assert r.status == 504
                assert d.url in (await r.json())["error"]["message"]
            d.delay_s = 0.0
            async with client.post(f"{proxy.url}/v1/completions", json={"prompt": "x", "stream": True}) as r:
                assert r.status == 200
                assert sse_events(await r.text())[-1] == "[DONE]"
            assert all(b.in_flight == 0 for b in proxy.backends)

    run(go)


def test_models_forwarded_to_decode() -> None:
    async def go() -> None:
        p, d = FakeVllm("p0", "prefill"), FakeVllm("d0", "decode")
        async with running([p], [d]) as (proxy, client):
            async with client.get(f"{proxy.url}/v1/models", headers={"Authorization": "Bearer k"}) as r:
                assert r.status == 200
                assert (await r.json())["data"][0]["owned_by"] == "d0"
            assert d.headers[0]["Authorization"] == "Bearer k"
            assert p.paths == []

    run(go)


def test_cli_subprocess_end_to_end() -> None:
    async def go() -> None:
        p, d = FakeVllm("p0", "prefill"), FakeVllm("d0", "decode")
        await p.start()
        await d.start()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # The console script is `kvpool`; `python -m kvpool.cli` is the same entry point.
        cmd = [sys.executable, "-m", "kvpool.cli", "proxy", "--prefill", p.url, "--decode", d.url]
        cmd += ["--port", "0", "--timeout-s", "10", "--health-interval-s", "0.5"]
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 10)
            info = json.loads(line)
            assert info["ready"] is True and info["port"] > 0
            url = f"http://127.0.0.1:{info['port']}"
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
                async with client.get(f"{url}/health") as r:
                    assert r.status == 200
                req = {"prompt": "hi", "max_tokens": 5, "stream": True}
                async with client.post(f"{url}/v1/completions", json=req) as r:
                    assert r.status == 200
                    events = sse_events(await r.text())
            assert events[-1] == "[DONE]" and len(events) == len(CHUNKS) + 1
            assert p.bodies[0]["max_tokens"] == 1
            assert d.bodies[0]["kv_transfer_params"] == p.kv_transfer_params(0)
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 10) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await p.stop()
            await d.stop()

    run(go)


# -- malformed bodies (issue 12 deliverable 6) and routing policies (issue 13) ------------------------


def test_malformed_bodies_get_400_with_one_line_and_one_log_line(caplog: Any) -> None:
    import logging

    from kvpool.conductor.live import RouterConfig

    deep = b'{"prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    medium = b'{"prompt": "x", "extra": ' + b"[" * 300 + b"]" * 300 + b"}"  # parses; too deep to re-encode
    dicts = b'{"prompt": "x", "e": ' + b'{"a": ' * 80 + b"1" + b"}" * 80 + b"}"
    bodies = [
        (b"not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (deep, "nests deeper than 64"),
        (medium, "nests deeper than 64"),
        (dicts, "nests deeper than 64"),
        (b'{"prompt": "\xff\xfe"}', "not UTF-8"),
        (b'{"prompt": "hi", "stream": "yes"}', "'stream' must be a bool"),
        (b'{"prompt": "hi", "max_tokens": "many"}', "'max_tokens' must be a int"),
        (b'{"prompt": {"text": "hi"}}', "'prompt' must be a string or a list of token ids"),
        (b'{"prompt": "hi"}', None),  # fine
    ]

    async def go() -> None:
        b0 = FakeVllm("b0", "decode")
        async with running([b0], [], router=RouterConfig(policy="load")) as (proxy, client):
            caplog.clear()
            with caplog.at_level(logging.DEBUG):
                for raw, reason in bodies:
                    hdr = {"Content-Type": "application/json"}
                    async with client.post(f"{proxy.url}/v1/completions", data=raw, headers=hdr) as r:
                        text = await r.text()
                        if reason is None:
                            assert r.status == 200, text
                            continue
                        assert r.status == 400, (raw[:60], r.status, text[:300])
                        msg = json.loads(text)["error"]["message"]
                        assert reason in msg and "\n" not in msg and len(msg) < 300, msg
            assert len(b0.bodies) == 1  # only the good one reached the backend
            records = [r for r in caplog.records if r.levelno >= logging.INFO]
            assert len(records) <= len(bodies) - 1, [r.getMessage() for r in records]
            assert not any(r.exc_info for r in caplog.records)
            assert all("\n" not in r.getMessage() for r in records)

    run(go)


def test_plain_pd_proxy_refuses_deep_json_too() -> None:
    async def go() -> None:
        p, d = FakeVllm("p0", "prefill"), FakeVllm("d0", "decode")
        async with running([p], [d]) as (proxy, client):
            raw = b'{"prompt": "x", "e": ' + b"[" * 5000 + b"]" * 5000 + b"}"
            async with client.post(f"{proxy.url}/v1/completions", data=raw) as r:
                assert r.status == 400
                assert "nests deeper" in (await r.json())["error"]["message"]
            assert not p.bodies and not d.bodies

    run(go)


def _who(out: dict[str, Any]) -> str:
    return str(out["served_by"])


def test_router_policies_on_aggregated_backends() -> None:
    from kvpool.conductor.live import RouterConfig

    async def go() -> None:
        fakes = [FakeVllm(f"b{k}", "decode") for k in range(3)]
        # round-robin through the router: every backend in turn.
        async with running(fakes, [], router=RouterConfig(policy="round-robin", block_size=4)) as (
            proxy,
            client,
        ):
            seen = []
            for k in range(6):
                async with client.post(
                    f"{proxy.url}/v1/completions", json={"prompt": list(range(k, k + 40))}
                ) as r:
                    assert r.status == 200
                    seen.append(_who(await r.json()))
            assert seen == ["b0", "b1", "b2", "b0", "b1", "b2"]
        for f in fakes:
            f.bodies.clear()
        # cache: repeated prefixes follow the instance that computed them (approximate mode, no events).
        async with running(fakes, [], router=RouterConfig(policy="cache", block_size=4)) as (proxy, client):
            first: dict[int, str] = {}
            for rnd in range(3):
                for conv in range(3):
                    prompt = [1000 * conv + i for i in range(64)] + [rnd] * 9
                    async with client.post(f"{proxy.url}/v1/completions", json={"prompt": prompt}) as r:
                        assert r.status == 200
                        who = _who(await r.json())
                    first.setdefault(conv, who)
                    assert who == first[conv], (rnd, conv, who, first)
            # Text prompts are tokenized by a backend's /tokenize.
            for _ in range(2):
                async with client.post(f"{proxy.url}/v1/completions", json={"prompt": "a b c " * 30}) as r:
                    assert r.status == 200
            assert any("/tokenize" in f.paths for f in fakes)
            async with client.get(f"{proxy.url}/health") as r:
                st = (await r.json())["router"]
            assert st["policy"] == "cache" and st["index_blocks"] > 0 and st["tokenize_failed"] == 0
            async with client.get(f"{proxy.url}/metrics") as r:
                text = await r.text()
            assert 'kvpool_conductor_decisions_total{policy="cache"} 11.0' in text

    run(go)


def test_router_slo_gate_refuses_with_429_before_any_backend_work() -> None:
    from kvpool.conductor.live import RouterConfig

    async def go() -> None:
        b0 = FakeVllm("b0", "decode")
        cfg = RouterConfig(policy="conductor", ttft_slo_s=1e-6)
        async with running([b0], [], router=cfg) as (proxy, client):
            async with client.post(f"{proxy.url}/v1/completions", json={"prompt": list(range(100))}) as r:
                assert r.status == 429
                msg = (await r.json())["error"]["message"]
            assert "refused before prefill" in msg and "exceeds the SLO" in msg
            assert b0.bodies == []
            async with client.get(f"{proxy.url}/metrics") as r:
                assert 'kvpool_conductor_rejections_total{reason="ttft_slo"} 1.0' in await r.text()

    run(go)


def test_conductor_copies_a_hot_prefix_to_one_spare_instance_once() -> None:
    """A prefix asked for again and again becomes hot: the conductor warms one spare instance with
    a background ``max_tokens=1`` request of exactly the prefix's full blocks, once (the spare then
    holds it: two holders are enough); with P/D roles nothing is copied."""
    from kvpool.conductor.live import RouterConfig

    prompt = [7000 + i for i in range(66)]  # 16 full blocks of 4, and 2 tokens more

    async def go() -> None:
        fakes = [FakeVllm(f"b{k}", "decode") for k in range(3)]
        async with running(fakes, [], router=RouterConfig(policy="conductor", block_size=4)) as (
            proxy,
            client,
        ):
            served = []
            for _ in range(14):
                async with client.post(
                    f"{proxy.url}/v1/completions", json={"prompt": prompt, "model": "m"}
                ) as r:
                    assert r.status == 200
                    served.append(_who(await r.json()))
            for _ in range(100):  # the copy runs in the background
                async with client.get(f"{proxy.url}/health") as r:
                    st = (await r.json())["router"]
                if st["hot_copies"] and not st["hot_copies_in_flight"]:
                    break
                await asyncio.sleep(0.05)
            copies = [(f.name, b) for f in fakes for b in f.bodies if b.get("max_tokens") == 1]
            assert len(copies) == 1, copies
            name, body = copies[0]
            assert body == {"prompt": prompt[:64], "max_tokens": 1, "model": "m"}
            assert name != served[0]  # a spare, not the holder
            assert st["hot_copies"] == 1 and st["hot_copies_failed"] == 0
            async with client.get(f"{proxy.url}/metrics") as r:
                assert 'kvpool_conductor_hot_copies_total{outcome="started"} 1.0' in await r.text()
        # P/D: a prefill instance would hold the copy's blocks for a decode that never comes
        pre = [FakeVllm(f"p{k}", "prefill") for k in range(3)]
        dec = [FakeVllm("d0", "decode")]
        async with running(pre, dec, router=RouterConfig(policy="conductor", block_size=4)) as (
            proxy,
            client,
        ):
            for _ in range(14):
                async with client.post(f"{proxy.url}/v1/completions", json={"prompt": prompt}) as r:
                    assert r.status == 200
            async with client.get(f"{proxy.url}/health") as r:
                assert (await r.json())["router"]["hot_copies"] == 0
            assert sum(len(f.bodies) for f in pre) == 14

    run(go)


async def _flood(request: web.Request, fake: Any, tail: bytes = b"") -> web.StreamResponse:
    """Answer 200 with ``fake.flood`` bytes of whitespace (then ``tail``), counting in ``fake.sent``
    what got out before the proxy hung up."""
    resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    chunk = b" " * (256 << 10)
    try:
        while fake.sent < fake.flood:
            await resp.write(chunk)
            fake.sent += len(chunk)
        await resp.write(tail)
    except (ConnectionError, RuntimeError):
        pass  # the proxy hung up
    return resp


class FloodingCopies(FakeVllm):
    """A :class:`FakeVllm` that answers a ``max_tokens=1`` request (a hot-prefix copy) with a
    200 whose body streams ``flood`` bytes, counting in ``sent`` what it got out."""

    flood = 64 << 20

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.sent = 0

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()  # cached: the base class reads it again
        if body.get("max_tokens") != 1:
            return await super()._generate(request)
        self.bodies.append(body)
        return await _flood(request, self)


def test_hot_prefix_copy_answered_by_a_flood_fails_at_the_reply_cap() -> None:
    """A hot-prefix copy's answer (one token) is read up to ``max_prefill_reply_bytes``: a backend
    streaming a huge body fails the copy (``hot_copies_failed``) and is cut off (the whole body was
    read into memory, however large, and the copy counted a success)."""
    from kvpool.conductor.live import RouterConfig

    prompt = [7000 + i for i in range(66)]

    async def go() -> None:
        fakes = [FloodingCopies(f"b{k}", "decode") for k in range(3)]
        cfg = RouterConfig(policy="conductor", block_size=4)
        async with running(fakes, [], router=cfg, max_prefill_reply_bytes=1 << 20) as (proxy, client):
            for _ in range(14):
                async with client.post(f"{proxy.url}/v1/completions", json={"prompt": prompt}) as r:
                    assert r.status == 200
            for _ in range(100):  # the copy runs in the background
                async with client.get(f"{proxy.url}/health") as r:
                    st = (await r.json())["router"]
                if st["hot_copies"] and not st["hot_copies_in_flight"]:
                    break
                await asyncio.sleep(0.05)
            assert st["hot_copies"] == 1 and st["hot_copies_failed"] == 1, st
            sent = sum(f.sent for f in fakes)
            assert 1 << 20 < sent < FloodingCopies.flood, sent

    run(go)


class FloodingTokenizer(FakeVllm):
    """A :class:`FakeVllm` whose ``/tokenize`` answers 200 with ``flood`` bytes of whitespace before
    a valid answer, counting in ``sent`` what it got out."""

    flood = 64 << 20

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.sent = 0

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        self.paths.append(request.path)
        return await _flood(request, self, b'{"tokens": [1, 2, 3], "count": 3}')


def test_a_tokenize_answer_larger_than_the_reply_cap_is_a_failed_tokenization() -> None:
    """The router's ``/tokenize`` answer is read up to ``max_reply_bytes``: a flood is cut off and
    counts as ``tokenize_failed`` (the request is routed without its tokens) instead of being read
    into memory whole."""
    from kvpool.conductor.live import RouterConfig

    async def go() -> None:
        fakes = [FloodingTokenizer("b0", "decode"), FloodingTokenizer("b1", "decode")]
        cfg = RouterConfig(policy="cache", block_size=4)
        async with running(fakes, [], router=cfg, max_reply_bytes=1 << 20) as (proxy, client):
            async with client.post(f"{proxy.url}/v1/completions", json={"prompt": "a b c " * 30}) as r:
                assert r.status == 200
            async with client.get(f"{proxy.url}/health") as r:
                st = (await r.json())["router"]
            assert st["tokenize_failed"] == 1, st
            sent = sum(f.sent for f in fakes)
            assert 1 << 20 < sent < FloodingTokenizer.flood, sent

    run(go)


def test_router_follows_kv_events_published_over_zmq() -> None:
    import msgpack
    import zmq

    from kvpool.conductor.live import RouterConfig

    async def go() -> None:
        fakes = [FakeVllm(f"b{k}", "decode") for k in range(3)]
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        cfg = RouterConfig(policy="cache", block_size=4, kv_events=[None, f"tcp://127.0.0.1:{port}", None])
        prompt = list(range(500, 540))
        ev = {"type": "BlockStored", "block_hashes": list(range(1, 11)), "parent_block_hash": None,
              "token_ids": prompt, "block_size": 4, "lora_id": None, "medium": "GPU",
              "lora_name": None}  # fmt: skip
        try:
            async with running(fakes, [], router=cfg) as (proxy, client):
                seq = 0
                for _ in range(100):  # the subscriber connects asynchronously: publish until seen
                    pub.send_multipart(
                        [b"", seq.to_bytes(8, "big"), msgpack.packb([time.time(), [ev], None])]
                    )
                    seq += 1
                    await asyncio.sleep(0.05)
                    if proxy.router.stats()["index_blocks"] >= 10:
                        break
                st = proxy.router.stats()
                assert st["per_instance_blocks"][fakes[1].url] == 10
                for _ in range(3):
                    async with client.post(
                        f"{proxy.url}/v1/completions", json={"prompt": prompt + [1, 2]}
                    ) as r:
                        assert _who(await r.json()) == "b1"
                rm = {"type": "BlockRemoved", "block_hashes": list(range(1, 11)), "medium": "GPU"}
                pub.send_multipart([b"", seq.to_bytes(8, "big"), msgpack.packb([time.time(), [rm], None])])
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    if proxy.router.stats()["per_instance_blocks"][fakes[1].url] == 0:
                        break
                assert proxy.router.stats()["per_instance_blocks"][fakes[1].url] == 0
        finally:
            pub.close(0)

    run(go)


def test_client_and_backend_garbage_never_reaches_the_wrong_place() -> None:
    """Aggregated backends never get a client's own kv_transfer_params (they name a host and
    blocks for the backend's KV connector to read); token ids outside uint32 are a 400 with the
    router on, not a plain-text 500; a prefill answering a kv_transfer_params that is not an
    object makes the decode recompute (it was a plain-text 500)."""
    from kvpool.conductor.live import RouterConfig

    async def go() -> None:
        agg = FakeVllm("a0", "decode")
        async with running([agg], [], router=RouterConfig(policy="round-robin", block_size=4)) as (
            proxy,
            client,
        ):
            evil = {"do_remote_prefill": True, "remote_host": "attacker.invalid", "remote_block_ids": [1]}
            body = {"prompt": list(range(40)), "kv_transfer_params": evil}
            async with client.post(f"{proxy.url}/v1/completions", json=body) as r:
                assert r.status == 200
            assert "kv_transfer_params" not in agg.bodies[-1]
            for bad in ([-1, 2, 3], [1 << 40, 2]):
                async with client.post(f"{proxy.url}/v1/completions", json={"prompt": bad}) as r:
                    assert r.status == 400 and (await r.json())["error"]["code"] == 400
        p, d = FakeVllm("p", "prefill"), FakeVllm("d", "decode")
        p.kv_transfer_params = lambda n: "not an object"  # type: ignore[method-assign]
        async with running([p], [d]) as (proxy, client):
            async with client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200
            assert "kv_transfer_params" not in d.bodies[-1]

    run(go)


def test_a_backend_dripping_a_5xx_body_does_not_hold_the_client() -> None:
    """A prefill backend answers 500 and then drips its body a byte at a time, forever: the
    client gets the 502 at once (the proxy read the whole error body, each byte restarting its
    read timeout, and held the client as long as the backend kept dripping)."""

    async def drip(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=500, headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        while True:
            await resp.write(b"x")
            await asyncio.sleep(0.1)

    async def go() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", drip)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        d = FakeVllm("d", "decode")
        await d.start()
        proxy = PDProxy([f"http://127.0.0.1:{port}"], [d.url], timeout_s=30.0, health_interval_s=0)
        await proxy.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as client:
                t0 = time.monotonic()
                async with client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"}) as r:
                    assert r.status == 502 and "answered 500" in (await r.json())["error"]["message"]
                assert time.monotonic() - t0 < 5.0
        finally:
            await proxy.close()
            await d.stop()
            await runner.cleanup()

    run(go)


def test_a_backend_dripping_or_flooding_a_reply_does_not_hold_the_client() -> None:
    """Non-streamed answers (the prefill's, a completion, ``/v1/models``) are read within one
    deadline for the whole body and up to a size cap: a backend dripping a byte at a time is a 504
    after ``timeout_s`` (each byte restarted the read timeout: the client was held for as long as
    the backend dripped), and one larger than the cap is a 502 (the size was unbounded)."""

    async def drip(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        while True:
            await resp.write(b" ")
            await asyncio.sleep(0.05)

    async def flood(request: web.Request) -> web.StreamResponse:
        return web.Response(body=b" " * (2 << 20) + b"{}", content_type="application/json")

    async def go() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", drip)
        app.router.add_get("/v1/models", drip)
        app.router.add_post("/big/v1/completions", flood)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        d = FakeVllm("d", "decode")
        await d.start()
        proxies = [
            PDProxy([url], [], timeout_s=1.0, health_interval_s=0),  # aggregated: the completion drips
            PDProxy([url], [d.url], timeout_s=1.0, health_interval_s=0),  # the prefill drips
            PDProxy([url + "/big"], [], health_interval_s=0, max_reply_bytes=1 << 20),
            PDProxy([url + "/big"], [d.url], health_interval_s=0, max_prefill_reply_bytes=1 << 20),
        ]
        for proxy in proxies:
            await proxy.start("127.0.0.1", 0)
        try:
            limit = aiohttp.ClientTimeout(total=10.0)
            async with aiohttp.ClientSession(timeout=limit) as client:
                for proxy in proxies[:2]:
                    t0 = time.monotonic()
                    async with client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"}) as r:
                        assert r.status == 504, await r.text()
                    assert time.monotonic() - t0 < 5.0
                async with client.get(f"{proxies[0].url}/v1/models") as r:
                    assert r.status == 504
                for proxy in proxies[2:]:
                    async with client.post(f"{proxy.url}/v1/completions", json={"prompt": "x"}) as r:
                        assert r.status == 502, await r.text()
                        assert "more than 1048576 bytes" in (await r.json())["error"]["message"]
        finally:
            for proxy in proxies:
                await proxy.close()
            await d.stop()
            await runner.cleanup()

    run(go)


def test_kv_events_in_pd_mode_feed_the_prefill_index() -> None:
    """In P/D mode ``--kv-events`` names one endpoint per prefill instance (the CLI counts those): the
    router took it as one per instance, prefills and decodes together, and refused to start; now a
    prefill's events feed the index and its prefixes route to it."""
    import msgpack
    import zmq

    from kvpool.conductor.cli import add_proxy_options, router_config

    async def go() -> None:
        pre = [FakeVllm(f"p{k}", "prefill") for k in range(2)]
        dec = FakeVllm("d", "decode")
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        px = argparse.ArgumentParser()
        add_proxy_options(px)  # kvpool proxy's own routing flags
        args = px.parse_args(["--policy", "cache", "--kv-events", f"none,tcp://127.0.0.1:{port}",
                              "--block-size", "4", "--no-hot"])  # fmt: skip
        cfg = router_config(args, n_instances=len(pre))
        prompt = list(range(500, 540))
        ev = {"type": "BlockStored", "block_hashes": list(range(1, 11)), "parent_block_hash": None,
              "token_ids": prompt, "block_size": 4, "lora_id": None, "medium": "GPU",
              "lora_name": None}  # fmt: skip
        try:
            async with running(pre, [dec], router=cfg) as (proxy, client):
                for seq in range(100):  # the subscriber connects asynchronously: publish until seen
                    pub.send_multipart(
                        [b"", seq.to_bytes(8, "big"), msgpack.packb([time.time(), [ev], None])]
                    )
                    await asyncio.sleep(0.05)
                    if proxy.router.stats()["index_blocks"] >= 10:
                        break
                assert proxy.router.stats()["per_instance_blocks"][pre[1].url] == 10
                for _ in range(3):
                    async with client.post(
                        f"{proxy.url}/v1/completions", json={"prompt": prompt + [1, 2]}
                    ) as r:
                        assert r.status == 200
                assert len(pre[1].bodies) == 3 and not pre[0].bodies
        finally:
            pub.close(0)

    run(go)


def test_bad_reply_caps_and_timeouts_are_typed_errors() -> None:
    from kvpool.errors import InvalidArgument

    for kw in ({"max_reply_bytes": 0}, {"max_prefill_reply_bytes": -1}, {"timeout_s": 0}):
        with pytest.raises(InvalidArgument):
            PDProxy(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], **kw)


# A client body whose text json.dumps would not write back as it is: a "\/" escape, "1.50", spaces.
SPLICED_PROMPT = '"see http:\\/\\/x.example \\u00e9 caf\u00e9 \U0001f600"'
CLIENT_TEXT = (
    '{ "model" : "m", "prompt":' + SPLICED_PROMPT + ', "max_tokens": 3, "stream_options": {"x": 1},'
    ' "logit_bias": {"50256": -1.50e0}, "kv_transfer_params": {"remote_host": "10.0.0.66"}}'
)


def test_bodies_sent_on_copy_the_clients_values_as_text_and_parse_to_what_was_sent_before() -> None:
    """The bodies sent to prefill and decode parse to exactly the top-level copies the proxy built
    before (prefill: ``prefill_request_body``; decode: the client's with the prefill's
    ``kv_transfer_params``; aggregated: without them), in every mode; the client's values are
    copied from its text instead of being encoded again (a 33 MiB prompt took the loop 0.1-0.4 s
    per copy), except when a top-level key repeats (then all of it is encoded, one key each)."""
    from kvpool.connectors.openai_api import prefill_request_body

    client_obj = json.loads(CLIENT_TEXT)
    headers = {"Content-Type": "application/json"}

    async def post(client: aiohttp.ClientSession, url: str, text: str) -> None:
        async with client.post(f"{url}/v1/completions", data=text.encode(), headers=headers) as r:
            assert r.status == 200, await r.text()

    async def go() -> None:
        # P/D, sequential then streaming (stream_kv: the first request teaches the side channel).
        p, d = FakeVllm("p0", "prefill"), FakeVllm("d0", "decode")
        async with running([p], [d], stream_kv=True) as (proxy, client):
            await post(client, proxy.url, CLIENT_TEXT)
            await post(client, proxy.url, CLIENT_TEXT)
        for i in range(2):
            want_p = prefill_request_body(client_obj)
            want_d = {**client_obj, "kv_transfer_params": d.bodies[i]["kv_transfer_params"]}
            if i == 1:  # streaming P/D: the proxy's transfer id
                want_p["kv_transfer_params"] = p.bodies[1]["kv_transfer_params"]
            else:
                assert want_d["kv_transfer_params"] == p.kv_transfer_params(0)
            assert json.loads(p.raw[i]) == want_p and list(json.loads(p.raw[i])) == list(want_p)
            assert json.loads(d.raw[i]) == want_d and list(json.loads(d.raw[i])) == list(want_d)
            for raw in (p.raw[i], d.raw[i]):
                assert b'"prompt": ' + SPLICED_PROMPT.encode() in raw, raw
                assert b'"logit_bias": {"50256": -1.50e0}' in raw
        # Aggregated: the client's kv_transfer_params never go on.
        b = FakeVllm("b0", "decode")
        async with running([b], []) as (proxy, client):
            await post(client, proxy.url, CLIENT_TEXT)
            want = {k: v for k, v in client_obj.items() if k != "kv_transfer_params"}
            assert json.loads(b.raw[0]) == want and b'"prompt": ' + SPLICED_PROMPT.encode() in b.raw[0]
            # A repeated key: which one counts is the parser's call, so all of it is encoded again.
            twice = CLIENT_TEXT[:-1] + ', "prompt": "the last one"}'
            await post(client, proxy.url, twice)
            want = {**want, "prompt": "the last one"}
            assert json.loads(b.raw[1]) == want and b.raw[1].count(b'"prompt"') == 1

    run(go)


@pytest.mark.parametrize(
    "text",
    [
        CLIENT_TEXT,
        "{}",
        " \t\r\n{ } \n",
        '{"a":1,"b":[1,2,{"c":null}],"d":true,"e":false,"f":NaN,"g":-Infinity,"h":1e400,"i":-0}',
        '{"k\\u00e9y": "v", "\\ud83d\\ude00": "\\ud800", "": ""}',
        '{"a": 1, "a": 2}',
        '{"a":1,}',
        '{"a":1} x',
        '{"a" 1}',
        '{"a":1 "b":2}',
        '{"a":}',
        '{"a":"x',
        "\ufeff{}",
        '{"a":"\x01"}',
        "[1, 2]",
        '"text"',
        "",
        '{"a": ' + "[" * 60 + "]" * 60 + "}",
    ],
)
def test_body_parsing_is_json_loads_and_encoding_parses_back(text: str) -> None:
    """``parse_raw_body`` (json's C scanner, one top-level value at a time, to know where each
    lies) accepts and refuses exactly what ``json.loads`` does, with the same object; and
    ``encode_body`` of a changed top-level copy parses to that copy."""
    from kvpool.connectors.openai_api import encode_body, parse_body, parse_raw_body

    try:
        want = json.loads(text)
    except (ValueError, RecursionError):
        want = None
    if not isinstance(want, dict):
        with pytest.raises(ValueError):
            parse_body(text.encode())
        return
    raw = parse_raw_body(text.encode())
    assert _same(raw.obj, want) and list(raw.obj) == list(want)
    out = {k: v for k, v in raw.obj.items() if k != "b"}
    out["max_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True}
    got = json.loads(encode_body(out, raw))
    assert _same(got, out) and list(got) == list(out)
    assert _same(json.loads(encode_body(dict(raw.obj), raw)), want)


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values (NaN equal to NaN)."""
    from kvpool.connectors.proxy_json import jsonable

    return json.dumps(a, sort_keys=True, default=jsonable) == json.dumps(b, sort_keys=True, default=jsonable)


#: A vLLM ``/tokenize`` double in its own process (its reading and writing of tens of MiB must
#: not count as the proxy's loop time): it answers ``argv[2]`` token ids when the body is the
#: expected ``{"prompt": "word " * argv[1], "model": "m"}``, else 400.
BIG_TOKENIZER = """
import json, sys
from aiohttp import web
words, n = int(sys.argv[1]), int(sys.argv[2])
reply = json.dumps({"count": n, "tokens": list(range(1 << 20, (1 << 20) + n))}).encode()
async def tokenize(request):
    body = json.loads(await request.content.read())
    ok = body == {"prompt": "word " * words, "model": "m"}
    return web.Response(body=reply if ok else b"{}", status=200 if ok else 400,
                        content_type="application/json")
async def health(request):
    return web.Response()
app = web.Application()
app.router.add_post("/tokenize", tokenize)
app.router.add_get("/health", health)
import socket
sock = socket.socket()
sock.bind(("127.0.0.1", 0))  # its own port, printed: no race for a port picked by the test
web.run_app(app, sock=sock, print=lambda *a: print("up", sock.getsockname()[1], flush=True))
"""


def test_a_large_tokenize_request_and_answer_leave_the_event_loop_free() -> None:
    """With the router on, a 33 MiB text prompt's ``/tokenize`` body is the client's text spliced
    (not JSON-encoded on the loop: ~0.1 s) and the 22 MiB answer is parsed in a thread a piece at
    a time (``json.loads`` on the loop, or of one whole array in a thread: ~0.25 s); a ticker on
    the loop never waits long. Both parse to what was meant."""
    from kvpool.conductor.live import RouterConfig
    from kvpool.connectors.openai_api import parse_raw_body

    words, n = (33 << 20) // 5, 2_500_000
    raw = parse_raw_body(json.dumps({"model": "m", "prompt": ["word " * words], "max_tokens": 4}).encode())

    async def go() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", BIG_TOKENIZER, str(words), str(n), stdout=asyncio.subprocess.PIPE
        )
        assert proc.stdout is not None
        proxy = None
        try:
            up = (await asyncio.wait_for(proc.stdout.readline(), 60)).split()
            assert up[0] == b"up", up
            port = int(up[1])
            cfg = RouterConfig(policy="cache", block_size=4)
            url = f"http://127.0.0.1:{port}"
            proxy = PDProxy([url], [url], router=cfg, max_reply_bytes=32 << 20, health_interval_s=60.0)
            await proxy.start("127.0.0.1", 0)
            gaps: list[float] = []
            stop = asyncio.Event()

            async def ticker() -> None:
                last = time.perf_counter()
                while not stop.is_set():
                    await asyncio.sleep(0.001)
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now

            tick = asyncio.create_task(ticker())
            await asyncio.sleep(0.05)
            assert proxy.router is not None
            got = await proxy.router.prompt_tokens(raw.obj, False, lambda p: proxy._tokenize(p, raw))
            stop.set()
            await tick
            assert isinstance(got, array) and got == array("I", range(1 << 20, (1 << 20) + n))
            assert max(gaps) < 0.1, f"the event loop stalled {max(gaps) * 1e3:.0f} ms"
        finally:
            if proxy is not None:
                await proxy.close()
            proc.kill()
            await proc.wait()

    run(go)


@pytest.mark.parametrize(
    "text",
    [
        "[" + ", ".join(str(i) for i in range(60000)) + "]",
        "[" + ", ".join(str(i) for i in range(60000)) + ",]",
        "[" + ",".join(str(i) for i in range(60000)) + ",,1]",
        "[" + ", ".join('"a,b]"' for _ in range(40000)) + "]",
        "[" + ", ".join('{"a": 1, "b": [2, 3]}' for _ in range(30000)) + "]",
        "[" + ", ".join('{"a": 1, "b": "c,d"}' for _ in range(30000)) + "]",
        "[" + ", ".join("1.5e3, -2, NaN, true, null" for _ in range(20000)) + "]",
        " [ " + " , ".join(str(i) for i in range(60000)) + " ] ",
    ],
)
def test_replies_parse_in_pieces_to_what_json_loads_says(text: str) -> None:
    """``loads_ids`` (long flat arrays cut at commas, a piece per C call) is ``json.loads``:
    the same value, the same refusals, whatever the pieces hold."""
    from kvpool.connectors.proxy_json import loads_ids

    data = ('{"x": 1, "tokens": ' + text + ', "y": [1]}').encode()
    assert len(text) > 1 << 18  # longer than a piece
    try:
        want = json.loads(data)
    except ValueError:
        with pytest.raises(ValueError):
            loads_ids(data)
        return
    assert _same(loads_ids(data), want)


def gil_hold(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` in this thread while a 1 ms ticker thread runs: (its result, the most CPU time
    this thread spent between two ticks). A C call holding the GIL keeps the ticker (and an event
    loop) waiting all along; the thread's own CPU time does not count the machine's load."""
    import threading

    clock = time.pthread_getcpuclockid(threading.get_ident())
    worst = 0.0
    stop = threading.Event()

    def tick() -> None:
        nonlocal worst
        last = time.clock_gettime(clock)
        while not stop.is_set():
            time.sleep(0.001)
            now = time.clock_gettime(clock)
            worst = max(worst, now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.01)
    try:
        out = fn()
    finally:
        stop.set()
        ticker.join()
    return out, worst


def test_large_bodies_parse_a_piece_at_a_time_to_what_json_loads_says(monkeypatch: Any) -> None:
    """``parse_big`` (bodies over 1 MiB: strings decoded and flat arrays parsed a piece per C
    call, containers walked with a stack) is ``json.loads``: the same object, key order and
    top-level spans, the same refusals, wherever the pieces are cut (3-17 characters here:
    inside escapes, surrogate pairs and numbers), and deep nesting refused as it goes."""
    import random

    from kvpool.connectors import proxy_json
    from kvpool.connectors.proxy_json import BodyTooDeep, parse_big

    rnd = random.Random(7)
    chars = 'ab\n\\"\u00e9\U0001f600\x01 x1fu[]{},:/\ud83d'
    bad = ["\\x", "\\u12", "\\ud83d\\ude00", "\\u00e9", ",]", ",}", "01", "1.", "[", "]", "{", ":", "\x01"]

    def rs() -> str:
        return "".join(rnd.choice(chars) for _ in range(rnd.randint(0, 40)))

    def rv(d: int = 0) -> Any:
        r = rnd.random()
        if d > 4 or r < 0.4:
            return rs()
        if r < 0.55:
            return rnd.choice([1, -2.5, float("nan"), True, None, 10**30])
        if r < 0.8:
            return [rv(d + 1) for _ in range(rnd.randint(0, 5))]
        return {rs(): rv(d + 1) for _ in range(rnd.randint(0, 5))}

    refused = repeated = 0
    for piece in (3, 8, 17):
        monkeypatch.setattr(proxy_json, "PIECE", piece)
        for _ in range(1500):
            text = json.dumps({rs(): rv() for _ in range(rnd.randint(0, 5))},
                              ensure_ascii=rnd.random() < 0.5, indent=rnd.choice([None, 1]))  # fmt: skip
            if rnd.random() < 0.2 and text.rstrip().endswith("}"):  # a top-level key again
                again = rnd.choice([*json.loads(text), rs()])
                text = text.rstrip()[:-1].rstrip() + f", {json.dumps(again)}: {json.dumps(rv())}}}"
                text = text.replace("{, ", "{", 1)
                repeated += 1
            if rnd.random() < 0.3:  # a small change that json.loads may refuse
                k = rnd.randrange(len(text) + 1)
                text = text[:k] + rnd.choice(bad) + text[k + rnd.randint(0, 2) :]
            try:
                want = json.loads(text)
            except ValueError:
                want = None
            if not isinstance(want, dict):
                refused += 1
                with pytest.raises(ValueError):
                    parse_big(text, 64)
                continue
            got, spans = parse_big(text, 64)
            assert _same(got, want) and list(got) == list(want), text
            assert list(spans) == list(want)  # a repeated key: its last value's span
            assert all(_same(json.loads(text[a:b]), want[k]) for k, (a, b) in spans.items())
    assert refused > 500 and repeated > 500
    parse_big('{"a": ' + "[" * 63 + "]" * 63 + "}", 64)
    for deep in ('{"a": ' + "[" * 64 + "]" * 64 + "}", '{"a": ' + '{"b": ' * 64 + "1" + "}" * 65):
        with pytest.raises(BodyTooDeep):
            parse_big(deep, 64)


def test_a_33_mib_prompt_string_is_parsed_without_holding_the_gil_long() -> None:
    """A 33 MiB prompt string (plain, in a one-string list, as a chat message's content): json's
    scanner decoded it in one GIL-holding call and the depth check ran one regex over the whole
    body (80-500 ms), so the thread parsing it stalled the proxy's event loop as long. Now the
    body is parsed a bounded piece per C call: between two ticks of a 1 ms ticker thread, the
    parsing thread spends under 50 ms of CPU time (its own CPU time: the machine's load does not
    count; what is left are two ~15 ms copies). The result is ``json.loads``'s."""
    from kvpool.connectors.openai_api import parse_raw_body

    words = (33 << 20) // 5
    for body in (
        {"model": "m", "prompt": "word " * words, "max_tokens": 4},
        {"model": "m", "prompt": ["word\n " * (words // 2)], "max_tokens": 4},
        {"model": "m", "messages": [{"role": "user", "content": "w\u00f6rd\n " * (words // 2)}]},
    ):
        data = json.dumps(body).encode()
        raw, worst = gil_hold(lambda: parse_raw_body(data))  # noqa: B023
        assert raw.obj == body
        assert worst < 0.05, f"parsing held the GIL {worst * 1e3:.0f} ms at a time"


def test_an_invalid_33_mib_body_is_refused_without_holding_the_gil_long() -> None:
    """An invalid body or backend answer of 33 MiB (a bad escape, a missing bracket at the very
    end): its error came from ``json.loads`` over the whole text (one GIL-holding call, 0.1 s and
    more); now ``parse_big``'s own one-line reason, a bounded piece per C call all along."""
    from kvpool.connectors.openai_api import parse_raw_body
    from kvpool.connectors.proxy_json import loads_ids

    words = (33 << 20) // 5
    prompt = json.dumps("word " * words)
    for text in (
        '{"model": "m", "prompt": ' + prompt[:-1] + '\\x"}',
        '{"model": "m", "prompt": ' + prompt + ', "max_tokens": 4',
        '{"tokens": [' + ", ".join(["12345"] * (words // 2)) + "}",
    ):
        data = text.encode()
        for parse in (parse_raw_body, loads_ids):  # loads_off_loop parses answers by loads_ids
            err, worst = gil_hold(lambda: pytest.raises(ValueError, parse, data))  # noqa: B023
            assert len(str(err.value).splitlines()) == 1, err.value
            assert worst < 0.05, f"{parse.__name__} held the GIL {worst * 1e3:.0f} ms at a time"


def test_a_long_answer_that_is_not_an_object_is_none_without_parsing_it() -> None:
    """A backend answering a prefill or ``/tokenize`` request with 20 MiB of JSON array (or a
    string): every caller wants an object, so it is None — not parsed by ``json.loads`` in one
    GIL-holding call (0.1 s and more: the proxy's event loop waited meanwhile, thread or not).
    A short non-object answer is None too; invalid JSON still raises ValueError."""
    from kvpool.connectors.openai_api import loads_off_loop
    from kvpool.connectors.proxy_json import loads_ids

    n = (20 << 20) // 8
    for data in (
        ("[" + ", ".join(["1234567"] * n) + "]").encode(),
        json.dumps("word " * (n * 2)).encode(),
    ):
        got, worst = gil_hold(lambda: loads_ids(data))  # noqa: B023
        assert got is None
        assert worst < 0.05, f"held the GIL {worst * 1e3:.0f} ms at a time"
        assert asyncio.run(loads_off_loop(data)) is None
    assert asyncio.run(loads_off_loop(b"[1, 2, 3]")) is None
    assert asyncio.run(loads_off_loop(b'{"tokens": [1]}')) == {"tokens": [1]}
    with pytest.raises(ValueError):
        asyncio.run(loads_off_loop(b'{"tokens": [1'))


#: A vLLM double in its own process for prompts of millions of token ids (its parsing must not
#: count as the proxy's loop time): ``/v1/completions`` answers 200 when the prompt is
#: ``range(argv[1], argv[1] + len)`` or ``"word " * (len / 5)`` and prints ``len keys...`` of each
#: body, else 400; it answers ``argv[3]`` seconds after printing.
BIG_COMPLETIONS = """
import asyncio, json, sys
from aiohttp import web
first, delay = int(sys.argv[1]), float(sys.argv[3])
async def completions(request):
    body = json.loads(await request.content.read())
    prompt = body.get("prompt")
    ok = prompt == "word " * (len(prompt) // 5) or (
        isinstance(prompt, list) and prompt == list(range(first, first + len(prompt)))
    )
    print(len(prompt) if ok else -1, *sorted(body), flush=True)
    await asyncio.sleep(delay)
    return web.json_response({"choices": [{"text": "x"}]}, status=200 if ok else 400)
async def health(request):
    return web.Response()
app = web.Application(client_max_size=1 << 27)
app.router.add_post("/v1/completions", completions)
app.router.add_get("/health", health)
import socket
sock = socket.socket()
sock.bind(("127.0.0.1", 0))  # its own port, printed: no race for a port picked by the test
web.run_app(app, sock=sock, print=lambda *a: print("up", sock.getsockname()[1], flush=True))
"""

#: The 33 MiB prompt of token ids: 3.8M ids of 7 digits.
BIG_IDS_FIRST, BIG_IDS_N = 1 << 20, (33 << 20) // 9


@asynccontextmanager
async def big_backend(delay_s: float = 0.0) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """A ``BIG_COMPLETIONS`` process: (its URL, the process, whose stdout prints each body)."""
    args = (str(BIG_IDS_FIRST), "0", str(delay_s))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", BIG_COMPLETIONS, *args, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        up = (await asyncio.wait_for(proc.stdout.readline(), 60)).split()
        assert up[0] == b"up", up
        yield f"http://127.0.0.1:{int(up[1])}", proc
    finally:
        proc.kill()
        await proc.wait()


@asynccontextmanager
async def loop_gaps() -> AsyncIterator[tuple[list[float], list[float]]]:
    """While the block runs, a 1 ms ticker on the running loop: (the wall-clock gaps between its
    ticks, the loop thread's CPU time in each gap). The CPU time is what the loop itself spent on
    work between two ticks (waiting for the GIL or for a CPU does not count), so it measures the
    code under test and not the machine's load; the cyclic GC (whose pauses with lists of
    millions of items are CPython's, ~50 ms) is off meanwhile."""
    gaps: list[float] = []
    cpu: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last, last_cpu = time.perf_counter(), time.thread_time()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now, now_cpu = time.perf_counter(), time.thread_time()
            gaps.append(now - last)
            cpu.append(now_cpu - last_cpu)
            last, last_cpu = now, now_cpu

    gc.collect()
    gc.disable()
    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    try:
        yield gaps, cpu
    finally:
        stop.set()
        await tick
        gc.enable()


def test_routing_and_hot_copying_a_prompt_of_millions_of_token_ids_leave_the_event_loop_free() -> None:
    """A 33 MiB prompt of 3.8M token ids: checking it (0.2 s), hashing its blocks (0.05-0.18 s),
    recording them as routed (approximate mode, 0.5 s) and encoding a hot-prefix copy of it
    (``json=``, 0.25 s) all took the proxy's event loop; now each runs in a thread a piece at a
    time: the loop never works 20 ms between two ticks of a ticker (its wall-clock gaps, up to
    0.2 s on a loaded machine, are not asserted). The router sees every block, and the copy
    sends exactly the prefix."""
    from kvpool.conductor.live import RouterConfig
    from kvpool.connectors.openai_api import parse_raw_body

    ids = list(range(BIG_IDS_FIRST, BIG_IDS_FIRST + BIG_IDS_N))
    raw = parse_raw_body(json.dumps({"model": "m", "prompt": ids, "max_tokens": 4}).encode())
    assert len(raw.data) > 32 << 20

    async def go() -> None:
        async with big_backend() as (url, proc):
            cfg = RouterConfig(policy="cache", block_size=16)
            proxy = PDProxy([url], [], router=cfg, health_interval_s=60.0)
            await proxy.start("127.0.0.1", 0)
            try:
                router = proxy.router
                assert router is not None
                async with loop_gaps() as (gaps, cpu):
                    routed = await proxy._route(raw, "/v1/completions", "r1", "req-1")
                    assert not isinstance(routed, web.Response)
                    inst = router.cluster.by_name[url]
                    n = BIG_IDS_N - 5
                    await proxy._copy_prefix(inst, ids, n, "copy-1", "m")
                    for _ in range(500):  # the blocks are recorded in a thread
                        if len(router.approx) == BIG_IDS_N // 16:
                            break
                        await asyncio.sleep(0.01)
                assert len(router.approx) == BIG_IDS_N // 16
                assert router.index.match(router.index.hash_tokens(ids))[inst.gpu.id] == BIG_IDS_N // 16
                assert proc.stdout is not None
                assert (await proc.stdout.readline()).split() == [
                    str(n).encode(),
                    b"max_tokens",
                    b"model",
                    b"prompt",
                ]
                assert "hot_copy_failed" not in router.counts
                assert max(cpu) < 0.02, f"the event loop worked {max(cpu) * 1e3:.0f} ms between ticks"
            finally:
                await proxy.close()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_33_mib_request_is_read_and_sent_to_prefill_and_decode_in_pieces_leaving_the_event_loop_free() -> (
    None
):
    """A 33 MiB request through P/D: the client's body was read whole (``request.read()`` copies
    it on the event loop) and the prefill and the decode bodies handed to aiohttp whole, which
    copied each into the socket's buffer on the loop (~50 ms per 33 MiB); now the body is joined
    in the parse thread and the bodies are sent a piece at a time (again on a retry): the loop
    never works 20 ms between two ticks. Both backends get the whole prompt, the client the
    decode's answer. (The prompt is text: a parsed list of millions of ids takes ~20 ms to free
    wherever its last reference goes, which this test does not measure.)"""
    from kvpool.connectors.openai_api import body_pieces

    words = (33 << 20) // 5
    data = json.dumps({"model": "m", "prompt": "word " * words, "max_tokens": 4}).encode()
    headers = {"Content-Type": "application/json", "Content-Length": str(len(data))}

    async def go() -> None:
        async with big_backend() as (purl, pproc), big_backend() as (durl, dproc):
            proxy = PDProxy([purl], [durl], health_interval_s=60.0)
            await proxy.start("127.0.0.1", 0)
            try:
                async with aiohttp.ClientSession() as client, loop_gaps() as (_, cpu):
                    async with client.post(
                        f"{proxy.url}/v1/completions", data=body_pieces([data]), headers=headers
                    ) as r:
                        assert r.status == 200, await r.text()
                        assert await r.json() == {"choices": [{"text": "x"}]}
                for proc, keys in ((pproc, b"kv_transfer_params max_tokens model prompt stream"),
                                   (dproc, b"max_tokens model prompt")):  # fmt: skip
                    assert proc.stdout is not None
                    assert (await proc.stdout.readline()).split() == [str(words * 5).encode(), *keys.split()]
                assert max(cpu) < 0.02, f"the event loop worked {max(cpu) * 1e3:.0f} ms between ticks"
            finally:
                await proxy.close()

    asyncio.run(asyncio.wait_for(go(), 60))


def test_a_non_ascii_prompt_is_sent_on_as_a_view_of_the_clients_bytes() -> None:
    """A 33 MiB non-ASCII prompt (plain, or the one string of a list): each body sent on
    encoded the client's value again from its text on the event loop (~30 ms each, prefill and
    decode); now the value's byte offsets are found when the body is parsed (in a thread) and
    the bodies copy views of the client's bytes: under 5 ms of the loop's CPU time, and they
    parse to what was meant. Small bodies with non-ASCII keys and values too."""
    from kvpool.connectors.openai_api import (
        encode_body,
        encode_body_parts,
        parse_raw_body,
        prefill_request_body,
    )

    words = (33 << 20) // 7
    for prompt in ("wörd é " * words, ["wörd é " * words]):
        body = {"model": "m", "ß": "ü", "prompt": prompt, "max_tokens": 4}
        raw = parse_raw_body(json.dumps(body, ensure_ascii=False, indent=1).encode())
        assert len(raw.data) != len(raw.text)
        outs = [prefill_request_body(raw.obj)]
        if isinstance(prompt, list):  # a /tokenize body: the one string of the list
            outs.append({"prompt": raw.obj["prompt"][0], "model": "m"})
        for out in outs:
            t0 = time.thread_time()
            parts = encode_body_parts(out, raw)
            spent = time.thread_time() - t0
            assert max(len(p) for p in parts if not isinstance(p, memoryview)) < 1000
            assert json.loads(b"".join(parts)) == out
            assert spent < 0.005, f"encoding took the loop {spent * 1e3:.0f} ms"
    for text in ('{"é": "ü", "a": ["ö"], "b": [ "日本" ] , "c": {"ß": 1}}', '{"a": "\\u00e9", "é": 1}'):
        raw = parse_raw_body(text.encode())
        out = {**raw.obj, "x": "ÿ"}
        out.pop("c", None)
        assert json.loads(encode_body(out, raw)) == out


def test_a_body_with_a_repeated_key_is_sent_on_as_views_of_the_clients_bytes() -> None:
    """A top-level key given twice (``json.loads`` keeps the last value): the body's spans were
    dropped, so each body sent on encoded a 33 MiB prompt again on the event loop; now the
    repeated key's span is its last value's, copied like any other, and the bodies parse to
    what ``json.loads`` gives."""
    from kvpool.connectors.openai_api import encode_body_parts, parse_raw_body, prefill_request_body

    big = json.dumps("word " * ((33 << 20) // 5))
    for text in (
        '{"prompt": "x", "model": "m", "prompt": ' + big + ', "max_tokens": 4}',
        '{"prompt": ' + big + ', "model": "m", "max_tokens": 4, "prompt": ' + big + "}",
        '{"model": "m", "prompt": "small", "prompt": ' + big + ', "model": "n"}',
    ):
        raw = parse_raw_body(text.encode())
        want = json.loads(text)
        assert raw.obj == want and list(raw.obj) == list(want)
        for out in (prefill_request_body(raw.obj), dict(raw.obj)):
            parts = encode_body_parts(out, raw)
            assert max(len(p) for p in parts if not isinstance(p, memoryview)) < 1000
            assert json.loads(b"".join(parts)) == out
    small = parse_raw_body(b'{"a": [1], "b": 2, "a": [3, 4]}')  # a small body: the same
    assert small.spans == {"a": (24, 30), "b": (16, 17)} and small.obj == {"a": [3, 4], "b": 2}


def test_a_long_prompt_of_token_ids_is_held_as_an_array_and_freed_at_once() -> None:
    """A 33 MiB body of 3.8M token ids: the parsed prompt was a list of Python ints, which took
    20-30 ms (the GIL held) to free wherever the request ended -- on the event loop -- and which
    young-generation GCs walked; now the proxy parses it into an ``array('I')`` (so do the
    router's checks, hashing and hot copies, unchanged), freed at once. An array that is not all
    token ids stays a list, as ``json.loads`` makes it."""
    from kvpool.conductor.live import LiveRouter, RouterConfig
    from kvpool.connectors.openai_api import encode_body, encode_ids_parts, parse_raw_body

    want = array("I", range(BIG_IDS_FIRST, BIG_IDS_FIRST + BIG_IDS_N))
    raw = parse_raw_body(json.dumps({"model": "m", "prompt": want.tolist(), "max_tokens": 4}).encode())
    prompt = raw.obj["prompt"]
    assert isinstance(prompt, array) and prompt == want
    router = LiveRouter(["http://127.0.0.1:1"], ["both"], RouterConfig(policy="cache", block_size=16))
    tokens = asyncio.run(router.prompt_tokens(raw.obj, False, None))
    assert tokens is prompt
    assert router.index.hash_tokens(tokens) == router.index.hash_tokens(want.tolist())
    parts = encode_ids_parts({"max_tokens": 1}, "prompt", tokens, 100_000)
    assert json.loads(b"".join(parts)) == {"max_tokens": 1, "prompt": want[:100_000].tolist()}
    again = {"a": 1, "a ": 2, **raw.obj}  # encoded whole (not copied from the text)
    assert json.loads(encode_body(again))["prompt"] == want.tolist()
    del tokens, prompt, again, raw  # held as an array (asserted above): freed at once
    for ids in ([-1] + want[:40_000].tolist(), want[:40_000].tolist() + [1 << 32], [True] * 60_000):
        raw = parse_raw_body(json.dumps({"prompt": ids}).encode() + b" " * (1 << 20))
        assert type(raw.obj["prompt"]) is list and raw.obj["prompt"] == ids


def test_a_body_over_max_request_bytes_gets_413_and_nothing_is_sent() -> None:
    """The proxy reads a client's body itself (a piece at a time): one byte over
    ``max_request_bytes`` is refused with 413 as aiohttp's ``read()`` did, one at the limit is
    served, and the refused one reaches no backend."""

    async def go() -> None:
        p, d = FakeVllm("p0", "prefill"), FakeVllm("d0", "decode")
        async with running([p], [d], max_request_bytes=4096) as (proxy, client):
            for extra, status in ((1, 413), (0, 200)):
                head = '{"model": "m", "max_tokens": 2, "prompt": "'
                text = head + "x" * (4096 + extra - len(head) - 2) + '"}'
                assert len(text) == 4096 + extra
                async with client.post(f"{proxy.url}/v1/completions", data=text.encode()) as r:
                    assert r.status == status, await r.text()
            assert len(p.bodies) == len(d.bodies) == 1

    run(go)


def test_an_invalid_body_over_1_mib_gets_a_400_with_a_one_line_reason() -> None:
    """A client body over 1 MiB (parsed in a thread by ``parse_big``) that is not valid JSON:
    400 with ``parse_big``'s one-line reason, and it reaches no backend."""

    async def go() -> None:
        p, d = FakeVllm("p0", "prefill"), FakeVllm("d0", "decode")
        async with running([p], [d]) as (proxy, client):
            big = json.dumps("word " * (3 << 18))
            for text in ('{"model": "m", "prompt": ' + big[:-1] + '\\x"}', '{"prompt": ' + big + ", "):
                async with client.post(f"{proxy.url}/v1/completions", data=text.encode()) as r:
                    msg = json.loads(await r.text())["error"]["message"]
                    assert r.status == 400 and "not valid JSON" in msg and "\n" not in msg, msg
            assert not p.bodies and not d.bodies

    run(go)


def test_a_routed_request_of_millions_of_token_ids_leaves_the_event_loop_free_until_it_is_sent() -> None:
    """With the router on, a 33 MiB request of 3.8M token ids through P/D: from the client's first
    byte until the decode backend has its whole body, the loop never works 20 ms between two
    ticks (the ids were checked on it when the body was read, 0.2 s). Measured until then
    because freeing the parsed ids when the request ends takes ~20 ms wherever it happens."""
    from kvpool.conductor.live import RouterConfig
    from kvpool.connectors.openai_api import body_pieces

    ids = list(range(BIG_IDS_FIRST, BIG_IDS_FIRST + BIG_IDS_N))
    data = json.dumps({"model": "m", "prompt": ids, "max_tokens": 4}).encode()
    del ids
    headers = {"Content-Type": "application/json", "Content-Length": str(len(data))}

    async def go() -> None:
        async with big_backend() as (purl, pproc), big_backend(delay_s=1.0) as (durl, dproc):
            router = RouterConfig(policy="cache", block_size=16)
            proxy = PDProxy([purl], [durl], router=router, health_interval_s=60.0)
            await proxy.start("127.0.0.1", 0)
            assert pproc.stdout is not None and dproc.stdout is not None
            try:
                async with aiohttp.ClientSession() as client:
                    post = client.post(
                        f"{proxy.url}/v1/completions", data=body_pieces([data]), headers=headers
                    )
                    async with loop_gaps() as (_, cpu):
                        task = asyncio.create_task(post.__aenter__())
                        got = await dproc.stdout.readline()  # the decode has all of it
                    r = await task
                    assert r.status == 200, await r.text()
                    r.release()
                assert got.split() == [str(BIG_IDS_N).encode(), b"max_tokens", b"model", b"prompt"]
                assert (await pproc.stdout.readline()).split()[0] == str(BIG_IDS_N).encode()
                assert max(cpu) < 0.02, f"the event loop worked {max(cpu) * 1e3:.0f} ms between ticks"
            finally:
                await proxy.close()

    asyncio.run(asyncio.wait_for(go(), 60))
