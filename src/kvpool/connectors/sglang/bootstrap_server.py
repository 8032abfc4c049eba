"""The SGLang P/D backend's bootstrap server and the prefill side's signed registrations with it
(:mod:`kvpool.connectors.sglang.bootstrap_auth` says what is signed and checked)."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

from kvpool.connectors.sglang.bootstrap_auth import (
    AUTH_HEADER,
    NONCE_PATH,
    BootstrapAuth,
    register_row,
    secret_from_env,
    send_json,
    server_id,
    server_names,
)

log = logging.getLogger("kvpool.connectors.sglang")


class SignedRegistration:
    """Mixed into the manager (before SGLang's ``CommonKVManager``): its bootstrap registration
    is signed."""

    _bootstrap_auth: BootstrapAuth | None = None

    def bootstrap_signer(self) -> BootstrapAuth:
        """What signs this prefill's bootstrap registrations (created at the first: SGLang's
        ``CommonKVManager.__init__`` registers before this class's ``__init__`` body runs)."""
        if self.__dict__.get("_bootstrap_auth") is None:
            self._bootstrap_auth = BootstrapAuth(secret_from_env())
        return self._bootstrap_auth

    def _register_topology_row(self, url: str, payload: dict) -> None:
        """Called by SGLang's ``register_to_bootstrap`` (prefill manager creation): ``PUT /route``,
        signed."""
        register_row(self.bootstrap_signer(), url, payload)


class SignedDpRank:
    """Mixed into the sender (before SGLang's ``CommonKVSender``): its DP rank registration is
    signed with its manager's key."""

    kv_mgr: Any
    bootstrap_server_url: str
    bootstrap_room: int

    def _register_prefill_dp_rank(self) -> None:
        """Called by SGLang's sender (with several DP ranks and no ``follow_bootstrap_room``):
        ``POST /register_dp_rank``, signed."""
        url = f"http://{self.bootstrap_server_url}/register_dp_rank"
        payload = {"bootstrap_room": self.bootstrap_room, "dp_rank": self.kv_mgr.attn_dp_rank}
        try:
            response = send_json(self.kv_mgr.bootstrap_signer(), "POST", url, payload)
            if response.status_code != 200:
                log.error(
                    "kvpool prefill: DP rank not registered: HTTP %s %s", response.status_code, response.text
                )
        except Exception as exc:  # noqa: BLE001 - as SGLang's: the decode's query then fails the room
            log.error("kvpool prefill: DP rank not registered: %s", exc)


class KvpoolKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's common bootstrap server (``PUT/GET /route``, ``/register_dp_rank``,
    ``/query_dp_ranks``, ``/health``), created by SGLang's prefill instance; with a secret the
    registrations (``PUT /route``, ``POST /register_dp_rank``) must be signed by a prefill
    manager, else they are refused (:mod:`kvpool.connectors.sglang.bootstrap_auth`)."""

    def __init__(self, host: str, port: int) -> None:
        self.bootstrap_auth = BootstrapAuth(secret_from_env())  # before SGLang starts serving
        super().__init__(host, port)

    def _setup_routes(self) -> None:
        """SGLang's routes, and the challenge: ``GET /kvpool/bootstrap_nonce`` (this start's nonce)."""
        super()._setup_routes()
        self.app.router.add_get(NONCE_PATH, self._handle_nonce)

    async def _handle_nonce(self, request: web.Request) -> web.Response:
        return web.Response(text=self.bootstrap_auth.nonce.hex())

    async def _refusal(self, request: web.Request) -> web.Response | None:
        """The response refusing a registration, or None when it is authenticated (event loop)."""
        body = await request.read()  # cached: SGLang's handler reads it again
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        names = server_names(self.host, self.port, sock)  # sealed for any of them: accepted
        try:
            addressed = server_id(f"http://{request.host}/")
        except ValueError:  # an unparsable Host: only the reason lacks it
            addressed = None
        refused = self.bootstrap_auth.check(
            request.method, request.path, body, request.headers.get(AUTH_HEADER), names, addressed
        )
        return None if refused is None else web.Response(status=refused[0], text=refused[1])

    async def _handle_route_put(self, request: web.Request) -> web.Response:
        refusal = await self._refusal(request)
        return refusal if refusal is not None else await super()._handle_route_put(request)

    async def _handle_register_dp_rank(self, request: web.Request) -> web.Response:
        refusal = await self._refusal(request)
        return refusal if refusal is not None else await super()._handle_register_dp_rank(request)
