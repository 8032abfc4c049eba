"""Authentication of the SGLang P/D bootstrap server's registrations.

SGLang's bootstrap server (``CommonKVBootstrapServer``, an aiohttp app on the prefill instance)
takes ``PUT /route`` from every prefill rank (its control socket's address) and
``POST /register_dp_rank`` from prefill requests (which DP rank serves a room); decodes read them
back (``GET /route``, ``POST /query_dp_ranks``) and then send that prefill rank their buffer
addresses and destination pages and wait for its status. Anyone who reaches the port could
register a rank of their own: decodes would send it their registration and metadata and wait on a
rank that never sends.

With a cluster secret (``KVPOOL_SECRET``) the prefill side signs what it registers: the
``X-Kvpool-Auth`` header carries, hex-encoded, the trailer of
:mod:`kvpool.connectors.sglang.control_auth` (sender, counter, time, HMAC-SHA256) over the frames
``method | path | body``, with a key derived from the secret and :data:`PURPOSE` and an empty
receiver (the instance's one bootstrap server). The server
refuses a registration whose header is missing (HTTP 401), whose MAC is wrong, whose time is more
than ``KVPOOL_SGLANG_AUTH_WINDOW_S`` off, or that it already accepted (HTTP 403); refusals are
counted (:attr:`BootstrapAuth.dropped`) and logged at most every 10 s, and change nothing, so the
reads decodes make return only what authenticated prefills registered. Without a secret nothing
is signed or checked (a warning says so once per process). Reads (``GET /route``,
``/query_dp_ranks``, ``/health``) stay open: they return addresses, no secrets.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any
from urllib.parse import urlsplit

from kvpool.config import TransferConfig
from kvpool.connectors.sglang.control_auth import TRAILER_LEN, ControlAuth

log = logging.getLogger("kvpool.connectors.sglang")

PURPOSE = b"kvpool-sglang-bootstrap-v1"
AUTH_HEADER = "X-Kvpool-Auth"
_WARNING = (
    "kvpool SGLang backend: the bootstrap server's registrations are unauthenticated (no "
    "KVPOOL_SECRET): anyone who reaches its port can register a prefill rank that decodes send "
    "their buffer addresses to and wait on"
)


def secret_from_env() -> str | None:
    """The transfer engine's secret (``KVPOOL_SECRET`` or ``KVPOOL_CONFIG``), as its managers use."""
    return TransferConfig.from_env().secret


class BootstrapAuth:
    """Signs (prefill managers, any thread) and checks (the bootstrap server's event loop, one
    thread) bootstrap registrations."""

    def __init__(self, secret: str | None, **kw: Any) -> None:
        self.auth = ControlAuth(
            secret, purpose=PURPOSE, what="bootstrap registration", warning=_WARNING, **kw
        )
        self.enabled = self.auth.enabled
        self.dropped = self.auth.dropped  # why -> refused registrations

    def headers(self, method: str, path: str, body: bytes) -> dict[str, str]:
        """HTTP headers of a JSON request carrying ``body`` (signed when there is a secret)."""
        headers = {"Content-Type": "application/json"}
        if self.enabled:
            trailer = self.auth.seal([method.upper().encode(), path.encode(), body])[-1]
            headers[AUTH_HEADER] = trailer.hex()
        return headers

    def check(self, method: str, path: str, body: bytes, header: str | None) -> tuple[int, str] | None:
        """None when the request may be acted on, else (HTTP status, reason)."""
        try:
            trailer = bytes.fromhex(header or "")
        except ValueError:
            trailer = b""
        if len(trailer) != TRAILER_LEN:
            trailer = b""  # counted as unsigned
        _, why = self.auth.check([method.upper().encode(), path.encode(), body, trailer])
        if why is None:
            return None
        return (401 if why == "unsigned" else 403), f"kvpool bootstrap: registration refused ({why})"


def send_json(auth: BootstrapAuth, method: str, url: str, payload: Any, timeout_s: float = 5.0) -> Any:
    """One signed JSON request (``requests``' response; raises as ``requests`` does)."""
    import requests

    body = json.dumps(payload).encode()
    return requests.request(
        method, url, data=body, headers=auth.headers(method, urlsplit(url).path, body), timeout=timeout_s
    )


def register_row(auth: BootstrapAuth, url: str, payload: dict[str, Any]) -> None:
    """SGLang's ``_register_topology_row`` (PUT with 5 tries, backoff 1 s doubling), signed: each
    try is sealed anew (a new counter and time). A refusal (401/403: the bootstrap server has
    another secret or none of ours) is logged with the server's reason."""
    for attempt in range(5):
        try:
            response = send_json(auth, "PUT", url, payload)
            if response.status_code == 200:
                return
            log.warning(
                "kvpool prefill: bootstrap registration %d/5 failed: HTTP %s %s",
                attempt + 1,
                response.status_code,
                response.text[:200],
            )
        except Exception as exc:  # noqa: BLE001 - retried, as SGLang does
            log.warning("kvpool prefill: bootstrap registration %d/5 failed: %s", attempt + 1, exc)
        if attempt < 4:
            time.sleep(min(2.0**attempt, 30.0) * (0.75 + 0.25 * (time.monotonic() % 1)))
    log.error("kvpool prefill: registration with the bootstrap server at %s failed after 5 tries", url)
