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
``method | path | body | nonce``, with a key derived from the secret and :data:`PURPOSE`, sealed
for the receiver ``host:port`` of the URL the registration is sent to (:func:`server_id`,
normalized as ``control_auth.endpoint_id``). ``nonce`` is the server's challenge: 16 random bytes
drawn at each start of the server, which it hands out, hex-encoded, at ``GET`` :data:`NONCE_PATH`
(open, as the reads: it is no secret); a prefill fetches it before it signs and keeps it
(:meth:`BootstrapAuth.server_nonce`), and fetches it again and re-signs once when a registration
is refused (:func:`send_json`). A restarted server has a new nonce, so a registration captured
before the restart fails its MAC although the new server's replay window (in memory) never saw
it; clocks play no part in that. SGLang's Rust server answers 404 there: the registration is
then sealed with an empty nonce, which no kvpool server accepts, and the Rust server checks
nothing. The server accepts only registrations sealed for one of its own
names (:func:`server_names`): the address the connection came in on (its IP and port), the host
and port it was started with (unless a wildcard address), and the ``host:port`` names in
``KVPOOL_SGLANG_BOOTSTRAP_NAMES`` (comma-separated: the names it is reached by through DNS names
other than its bind host, NAT or port mappings). So a registration captured on its way to one
prefill instance's bootstrap server fails the MAC at any other.

The server refuses a registration whose header is missing (HTTP 401), whose MAC is wrong (also:
sealed for another server; the reason names the server's names when the request's ``Host`` is
not one of them), whose time is more than ``KVPOOL_SGLANG_AUTH_WINDOW_S`` off, or that it already
accepted (HTTP 403); refusals are counted (:attr:`BootstrapAuth.dropped`) and logged at most every
10 s, and change nothing, so the reads decodes make return only what authenticated prefills
registered. Without a secret nothing is signed or checked (a warning says so once per process).
Reads (``GET /route``, ``/query_dp_ranks``, ``/health``) stay open: they return addresses, no
secrets.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from ipaddress import ip_address
from typing import Any
from urllib.parse import urlsplit

from kvpool.config import TransferConfig
from kvpool.connectors.sglang.control_auth import TRAILER_LEN, ControlAuth, endpoint_id

log = logging.getLogger("kvpool.connectors.sglang")

PURPOSE = b"kvpool-sglang-bootstrap-v2"
AUTH_HEADER = "X-Kvpool-Auth"
NONCE_PATH = "/kvpool/bootstrap_nonce"
NONCE_LEN = 16
_WARNING = (
    "kvpool SGLang backend: the bootstrap server's registrations are unauthenticated (no "
    "KVPOOL_SECRET): anyone who reaches its port can register a prefill rank that decodes send "
    "their buffer addresses to and wait on"
)


def secret_from_env() -> str | None:
    """The transfer engine's secret (``KVPOOL_SECRET`` or ``KVPOOL_CONFIG``), as its managers use."""
    return TransferConfig.from_env().secret


def server_id(url: str) -> bytes:
    """The receiver id a registration sent to ``url`` is sealed for: its ``host:port`` (port 80
    when the URL names none), as :func:`~kvpool.connectors.sglang.control_auth.endpoint_id`."""
    parts = urlsplit(url)
    return endpoint_id(parts.hostname or "", parts.port or 80)


def server_names(host: str, port: int, sockname: Any = None) -> list[bytes]:
    """The receiver ids a bootstrap server started on ``host``:``port`` accepts registrations
    sealed for: the address a connection came in on (``sockname``, its socket's local address),
    ``host``:``port`` unless ``host`` is a wildcard, and ``KVPOOL_SGLANG_BOOTSTRAP_NAMES``."""
    names = []
    if isinstance(sockname, tuple) and len(sockname) >= 2:
        try:
            ip = ip_address(str(sockname[0]).split("%", 1)[0])
            if ip.version == 6 and ip.ipv4_mapped is not None:  # a dual-stack socket's IPv4 peer
                ip = ip.ipv4_mapped
            names.append(endpoint_id(ip.compressed, int(sockname[1])))
        except ValueError:
            pass
    if host and host not in ("0.0.0.0", "::", "[::]"):
        names.append(endpoint_id(host, port))
    for name in map(str.strip, os.environ.get("KVPOOL_SGLANG_BOOTSTRAP_NAMES", "").split(",")):
        if name:  # host:port (an IPv6 address in brackets), or a host (this server's port)
            h, colon, p = name.rpartition(":")
            names.append(endpoint_id(h, p) if colon and h and p.isdigit() else endpoint_id(name, port))
    return list(dict.fromkeys(names))


class BootstrapAuth:
    """Signs (prefill managers, any thread) and checks (the bootstrap server's event loop, one
    thread) bootstrap registrations."""

    def __init__(self, secret: str | None, **kw: Any) -> None:
        self.auth = ControlAuth(
            secret, purpose=PURPOSE, what="bootstrap registration", warning=_WARNING, **kw
        )
        self.enabled = self.auth.enabled
        self.dropped = self.auth.dropped  # why -> refused registrations
        self.nonce = os.urandom(NONCE_LEN)  # a server's: this start's challenge
        self._nonces: dict[str, bytes] = {}  # a signer's: bootstrap server (host:port) -> nonce

    def headers(self, method: str, url: str, body: bytes, nonce: bytes = b"") -> dict[str, str]:
        """HTTP headers of a JSON request carrying ``body`` to ``url`` (signed for the server
        there and its ``nonce`` when there is a secret)."""
        headers = {"Content-Type": "application/json"}
        if self.enabled:
            frames = [method.upper().encode(), urlsplit(url).path.encode(), body, nonce]
            headers[AUTH_HEADER] = self.auth.seal(frames, server_id(url))[-1].hex()
        return headers

    def server_nonce(self, url: str, fresh: bool = False) -> bytes:
        """The nonce of the bootstrap server at ``url`` (``GET`` :data:`NONCE_PATH` there, kept
        until ``fresh``; raises as ``requests`` does). b"" from a server without one (SGLang's
        Rust server, which checks nothing): no kvpool server accepts a registration sealed with it."""
        import requests

        parts = urlsplit(url)
        nonce = None if fresh else self._nonces.get(parts.netloc)
        if nonce is None:
            r = requests.get(f"{parts.scheme}://{parts.netloc}{NONCE_PATH}", timeout=5)
            try:
                nonce = bytes.fromhex(r.text.strip()) if r.status_code == 200 else b""
            except ValueError:
                nonce = b""
            if len(self._nonces) >= 64:  # a signer talks to one server or a few
                self._nonces.clear()
            self._nonces[parts.netloc] = nonce
        return nonce

    def check(
        self,
        method: str,
        path: str,
        body: bytes,
        header: str | None,
        names: Sequence[bytes],
        addressed: bytes | None = None,
    ) -> tuple[int, str] | None:
        """None when the request may be acted on, else (HTTP status, reason). ``names``: the
        server's (:func:`server_names`); ``addressed``: the id of the request's ``Host`` (only
        to say why a MAC failed)."""
        try:
            trailer = bytes.fromhex(header or "")
        except ValueError:
            trailer = b""
        if len(trailer) != TRAILER_LEN:
            trailer = b""  # counted as unsigned
        frames = [method.upper().encode(), path.encode(), body, self.nonce, trailer]
        _, why = self.auth.check(frames, names)
        if why is None:
            return None
        if why == "bad MAC" and addressed is not None and addressed not in names:
            why += (
                f"; addressed to {addressed.decode(errors='replace')[:300]}, which is not one of this "
                f"server's names {[n.decode() for n in names]} (add it to KVPOOL_SGLANG_BOOTSTRAP_NAMES)"
            )
        return (401 if why == "unsigned" else 403), f"kvpool bootstrap: registration refused ({why})"


def send_json(auth: BootstrapAuth, method: str, url: str, payload: Any, timeout_s: float = 5.0) -> Any:
    """One signed JSON request (``requests``' response; raises as ``requests`` does), sealed with
    the server's nonce; refused (401/403, e.g. the server restarted since its nonce was fetched),
    sent once more, sealed anew with the nonce fetched afresh."""
    import requests

    body = json.dumps(payload).encode()
    for fresh in (False, True):
        nonce = auth.server_nonce(url, fresh) if auth.enabled else b""
        r = requests.request(
            method, url, data=body, headers=auth.headers(method, url, body, nonce), timeout=timeout_s
        )
        if not auth.enabled or r.status_code not in (401, 403):
            break
    return r


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
