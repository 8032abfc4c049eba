"""OpenAI request bodies and error replies as ``kvpool proxy`` reads and writes them.

:func:`parse_body` checks a client's body (UTF-8 JSON object, bounded nesting, the types of the
fields the proxy reads) before anything is sent on; :func:`prefill_request_body` is the copy that goes
to a prefill backend; :func:`error_response` is an error in OpenAI's shape,
``{"error": {"message", "type", "code"}}``. Called by :class:`kvpool.connectors.proxy.PDProxy` on its
event loop, once per request.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from aiohttp import web

__all__ = [
    "ERROR_TYPES",
    "MAX_BODY_DEPTH",
    "PREFILL_KV_TRANSFER_PARAMS",
    "error_response",
    "error_text",
    "parse_body",
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


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body; ValueError with a one-line reason for anything else
    (invalid UTF-8 or JSON, not an object, nested deeper than :data:`MAX_BODY_DEPTH`)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("request body is not UTF-8") from None
    try:
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
    for key, kind in (("stream", bool), ("max_tokens", int), ("model", str)):
        if key in body and body[key] is not None and not isinstance(body[key], kind):
            raise ValueError(f"'{key}' must be a {kind.__name__}")
    return body


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
