"""OpenAI request bodies and error replies as ``kvpool proxy`` reads and writes them.

:func:`parse_body` checks a client's body (UTF-8 JSON object, bounded nesting, the types of the
fields the proxy reads) before anything is sent on; :func:`prefill_request_body` is the copy that goes
to a prefill backend; :func:`encode_body` writes such a copy, copying the client's values from its
text (:func:`parse_raw_body`) instead of encoding them again; :func:`error_response` is an error in
OpenAI's shape, ``{"error": {"message", "type", "code"}}``. Called by
:class:`kvpool.connectors.proxy.PDProxy` on its event loop, once per request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any

from aiohttp import web

from kvpool.connectors.proxy_json import PIECE, BodyTooDeep, NotAnObject, jsonable, loads_ids, parse_big

__all__ = [
    "ERROR_TYPES",
    "BodyParts",
    "body_pieces",
    "MAX_BODY_DEPTH",
    "PREFILL_KV_TRANSFER_PARAMS",
    "RawBody",
    "encode_body",
    "encode_body_parts",
    "encode_ids_parts",
    "error_response",
    "error_text",
    "loads_off_loop",
    "parse_body",
    "parse_raw_body",
    "read_body_chunks",
    "prefill_request_body",
    "snippet",
]

_log = logging.getLogger("kvpool.connectors.proxy")

#: ``kv_transfer_params`` sent with every prefill request.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


#: Deepest JSON nesting accepted in a request body (deeper bodies get 400, not a RecursionError).
MAX_BODY_DEPTH = 64
_STRINGS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_EMPTY_PAIR = re.compile(r"\[\]|\{\}")

ERROR_TYPES = {
    400: "invalid_request_error",
    429: "rate_limit_exceeded",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}


def error_response(status: int, message: str, request_id: str | None = None) -> web.Response:
    """The reply for a request the proxy fails or refuses: OpenAI's error shape, the request id as
    ``X-Request-Id``; a 5xx is also logged (the operator's only trace of it)."""
    if status >= 500:
        _log.warning("request %s answered %d: %s", request_id or "-", status, message)
    headers = {"X-Request-Id": request_id} if request_id else None
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "code": status}}
    return web.json_response(body, status=status, headers=headers)


def error_text(exc: BaseException) -> str:
    """``Type: message`` of an exception for an error message (the type alone when it has none)."""
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if str(exc) else text


def snippet(data: bytes, limit: int = 300) -> str:
    """The start of a backend's answer, decoded leniently, for an error message."""
    text = data.decode("utf-8", "replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True, eq=False)
class RawBody:
    """A client's JSON object body as received, with where each top-level value lies in it, so
    that copies of the object with a few top-level keys changed are sent on without encoding the
    big values again (:func:`encode_body`)."""

    data: bytes
    text: str
    """``data`` decoded (UTF-8)."""
    obj: dict[str, Any]
    """The parsed object; its values are never changed in place (they are copied as text)."""
    spans: dict[str, tuple[int, int]]
    """Top-level key -> (start, end) of its value in ``text``."""
    byte_spans: dict[str, tuple[int, int]] | None = None
    """The same in ``data`` (None: the same offsets, ``data`` being ASCII)."""


_WS = re.compile(r"[ \t\n\r]*")
_scan_once = json.JSONDecoder().scan_once  # the C scanner behind json.loads


def _scan_object(text: str) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    """``json.loads(text)`` of a JSON object, with each top-level value's span in ``text`` (a key
    that repeats: its last value's, the one ``json.loads`` keeps). Raises on anything
    else (the caller then lets ``json.loads`` say what is wrong)."""
    ws = _WS.match
    i = ws(text, 0).end()
    if text[i : i + 1] != "{":
        raise ValueError("not an object")
    i = ws(text, i + 1).end()
    obj: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    if text[i : i + 1] == "}":
        i += 1
    else:
        while True:
            if text[i : i + 1] != '"':
                raise ValueError("expected a key")
            key, i = scanstring(text, i + 1)
            i = ws(text, i).end()
            if text[i : i + 1] != ":":
                raise ValueError("expected ':'")
            i = ws(text, i + 1).end()
            try:
                value, end = _scan_once(text, i)
            except StopIteration:
                raise ValueError("expected a value") from None
            obj[key] = value
            spans[key] = (i, end)
            i = ws(text, end).end()
            sep = text[i : i + 1]
            i = ws(text, i + 1).end()
            if sep == "}":
                break
            if sep != ",":
                raise ValueError("expected ',' or '}'")
    if ws(text, i).end() != len(text):
        raise ValueError("extra data")
    return obj, spans


#: Answers longer than this are parsed in a thread (shorter ones take the loop under ~5 ms).
THREAD_PARSE_BYTES = 1 << 20


async def body_pieces(parts: Sequence[bytes | memoryview], piece: int = 1 << 20) -> AsyncIterator[memoryview]:
    """``parts`` as views of at most ``piece`` bytes, for aiohttp to send one at a time (with a
    ``Content-Length``): a body of tens of MiB handed to it whole is copied into the socket
    transport's buffer on the event loop (~50 ms per 33 MiB)."""
    for p in parts:
        view = memoryview(p)
        for i in range(0, len(view), piece):
            yield view[i : i + piece]


async def read_body_chunks(request: web.Request, max_bytes: int) -> tuple[list[bytes], int]:
    """A client's body as it came (its chunks, its size): ``request.read()`` (the same 413 past
    ``max_bytes``) without joining it on the event loop (~25 ms per 33 MiB); the proxy joins it
    in the thread that parses it."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > max_bytes:
            raise web.HTTPRequestEntityTooLarge(max_bytes, size)
        chunks.append(chunk)
    return chunks, size


@dataclass(frozen=True, eq=False)
class BodyParts:
    """A JSON body encoded already, in the pieces :func:`encode_body_parts` (or
    :func:`encode_ids_parts`) made: ``BackendClient.request`` sends it, again on each try."""

    parts: Sequence[bytes | memoryview]

    @property
    def size(self) -> int:
        """Its length in bytes (the request's ``Content-Length``)."""
        return sum(len(p) for p in self.parts)

    def payload(self) -> bytes | AsyncIterator[memoryview]:
        """What aiohttp sends for one try: a body up to :data:`THREAD_PARSE_BYTES` joined (one
        short copy), a longer one as a new :func:`body_pieces` iterator of its pieces."""
        if self.size <= THREAD_PARSE_BYTES:
            return b"".join(self.parts)
        return body_pieces(self.parts)


async def loads_off_loop(data: bytes) -> dict[str, Any] | None:
    """A backend's JSON answer parsed (the proxy's event loop awaits it): a small one at once,
    one over :data:`THREAD_PARSE_BYTES` in a thread by
    :func:`kvpool.connectors.proxy_json.loads_ids` (a bounded piece per C call, so the thread
    leaves the loop free; long arrays of token ids as ``array('I')``; an invalid object raises a
    one-line ValueError). An answer that is not a JSON object is None (a long one is not parsed);
    invalid JSON raises ValueError."""
    if len(data) <= THREAD_PARSE_BYTES:
        value = json.loads(data)
        return value if isinstance(value, dict) else None
    return await asyncio.to_thread(loads_ids, data)


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body; ValueError with a one-line reason for anything else
    (invalid UTF-8 or JSON, not an object, nested deeper than :data:`MAX_BODY_DEPTH`)."""
    return parse_raw_body(raw).obj


def parse_raw_body(raw: bytes) -> RawBody:
    """:func:`parse_body`, keeping the body's text and its top-level values' spans (a repeated key:
    its last value's) for :func:`encode_body`; about as fast as ``json.loads`` (its C scanner). A body over
    :data:`THREAD_PARSE_BYTES` (parsed in a thread) is parsed by
    :func:`kvpool.connectors.proxy_json.parse_big`, a bounded piece per C call, so that the
    thread leaves the event loop free (json's scanner holds the GIL for a whole value: 0.1-0.3 s
    for a 33 MiB prompt string); its long arrays of token ids come as ``array('I')``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("request body is not UTF-8") from None
    if len(text) > THREAD_PARSE_BYTES:  # parsed in a thread: a bounded piece per C call
        try:
            body, spans = parse_big(text, MAX_BODY_DEPTH)
        except BodyTooDeep as exc:
            raise ValueError(str(exc)) from None
        except NotAnObject:
            raise
        except (ValueError, IndexError) as exc:
            raise ValueError(f"request body is not valid JSON ({str(exc).splitlines()[0][:120]})") from None
        return _checked(raw, text, body, spans)
    try:
        body, spans = _scan_object(text)
    except (ValueError, RecursionError, IndexError):
        body, spans = None, None  # json.loads below says what is wrong (or parses it all the same)
    try:
        if body is None:
            body = json.loads(text)
    except RecursionError:
        raise ValueError(f"request body nests deeper than {MAX_BODY_DEPTH} levels") from None
    except ValueError as exc:
        raise ValueError(f"request body is not valid JSON ({str(exc).splitlines()[0][:120]})") from None
    # json.loads stops at the interpreter's recursion limit; re-encoding a body nested nearly that
    # deep would fail later, so bound the depth here (C-speed passes: drop strings, keep brackets,
    # peel one level of empty pairs per pass).
    shape = _NOT_BRACKET.sub("", _STRINGS.sub("", text))
    for _ in range(MAX_BODY_DEPTH + 1):
        if not shape:
            break
        shape = _EMPTY_PAIR.sub("", shape)
    else:
        raise ValueError(f"request body nests deeper than {MAX_BODY_DEPTH} levels")
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return _checked(raw, text, body, spans)


def _checked(
    raw: bytes, text: str, body: dict[str, Any], spans: dict[str, tuple[int, int]] | None
) -> RawBody:
    """The parsed body, once the fields the proxy reads have their types (else ValueError)."""
    for key, kind in (("stream", bool), ("max_tokens", int), ("model", str)):
        if key in body and body[key] is not None and not isinstance(body[key], kind):
            raise ValueError(f"'{key}' must be a {kind.__name__}")
    spans = spans or {}
    byte_spans = _byte_spans(text, spans) if len(raw) != len(text) else None
    return RawBody(raw, text, body, spans, byte_spans)


def _byte_spans(text: str, spans: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """``spans`` (offsets in ``text``) as offsets in ``text`` encoded (UTF-8), the text measured
    a bounded piece per C call (in the thread that parses a large body), so that sending a
    non-ASCII value on copies a view of the client's bytes instead of encoding it again on the
    event loop (~30 ms per 33 MiB)."""
    at: dict[int, int] = {}
    pos = off = 0
    for p in sorted({p for span in spans.values() for p in span}):
        for a in range(pos, p, PIECE):
            off += len(text[a : min(a + PIECE, p)].encode())
        pos, at[p] = p, off
    return {k: (at[a], at[b]) for k, (a, b) in spans.items()}


def encode_body(out: dict[str, Any], raw: RawBody | None = None) -> bytes:
    """``out`` as JSON (UTF-8 bytes), for a backend. ``out`` is a top-level copy of ``raw.obj`` with
    some keys added, changed or removed: each value that is still the very object of ``raw.obj``
    is copied from the client's text (it parses to that value) instead of being encoded again,
    which for a prompt of tens of MiB takes the event loop 0.1-0.4 s; the others are encoded.
    Without ``raw`` (or spans) all of ``out`` is encoded."""
    return b"".join(encode_body_parts(out, raw))


def encode_body_parts(out: dict[str, Any], raw: RawBody | None = None) -> list[bytes | memoryview]:
    """:func:`encode_body` in the pieces it joins (the client's values as views of its bytes)."""
    if raw is None or not raw.spans:
        return [json.dumps(out, default=jsonable).encode()]
    view = memoryview(raw.data)
    parts: list[bytes | memoryview] = [b"{"]
    for key, value in out.items():
        if len(parts) > 1:
            parts.append(b", ")
        parts.append(json.dumps(key).encode() + b": ")
        span = raw.spans.get(key)
        src = raw.obj[key] if span is not None else None
        a = b = cut_a = cut_b = 0  # cut_*: ASCII characters (brackets, spaces) off the span's ends
        if span is not None:
            a, b = span
        if isinstance(src, list) and len(src) == 1 and src[0] is value and isinstance(value, str):
            # the one string of a one-string list (a prompt sent as ["text"]): inside the brackets
            in_a, in_b = _WS.match(raw.text, a + 1).end(), b - 1
            while raw.text[in_b - 1] in " \t\n\r":
                in_b -= 1
            cut_a, cut_b, src = in_a - a, b - in_b, value
        if span is not None and src is value:
            if raw.byte_spans is not None:
                a, b = raw.byte_spans[key]
            parts.append(view[a + cut_a : b - cut_b])
        else:
            parts.append(json.dumps(value, default=jsonable).encode())
    parts.append(b"}")
    return parts


def encode_ids_parts(head: dict[str, Any], key: str, ids: Sequence[int], n: int) -> list[bytes]:
    """``json.dumps({**head, key: list(ids[:n])}).encode()`` (``ids``: a list or an ``array``)
    in pieces (``key`` last), the ids encoded :data:`_IDS_PIECE` at a time: json's encoder holds
    the GIL for a whole list (4.3M ids: 0.25 s), so a thread encoding it a piece at a time lets
    the event loop run between pieces."""
    parts = [json.dumps(head)[:-1].encode() + (b", " if head else b"") + json.dumps(key).encode() + b": ["]
    for a in range(0, n, _IDS_PIECE):
        if a:
            parts.append(b", ")
        piece = ids[a : min(a + _IDS_PIECE, n)]
        parts.append(json.dumps(piece if isinstance(piece, list) else list(piece))[1:-1].encode())
    parts.append(b"]}")
    return parts


#: Token ids encoded per C call by :func:`encode_ids_parts` (a few ms).
_IDS_PIECE = 1 << 16


def prefill_request_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body sent to the prefill backend for the client request ``body`` (which is not modified)."""
    out = dict(body)  # only top-level keys change
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)  # vLLM refuses min_tokens > max_tokens
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return out
