"""The etcd metadata backend: etcd v3 through its HTTP/JSON gateway, with etcd's own authentication.

``etcd://[user:password@]host:port[,host:port...]``. Descriptors are signed by the cluster secret,
so a forged or replayed one is refused by its reader; but anyone who can reach an etcd without
authentication can *delete* a segment's descriptor (its peers then get ``SegmentNotFound``). Run etcd
with authentication on (``etcdctl user add root``, ``etcdctl auth enable``, a user with read/write on
the ``kvpool/segments/`` prefix) and put that user in the URL: every call then carries an etcd token
(``/v3/auth/authenticate``), renewed when etcd says it expired. The password travels to etcd in
clear over ``http://`` (as with ``etcdctl`` against a plain-HTTP etcd): a warning says so once for a
non-loopback etcd.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import time
import urllib.parse
from typing import Any

from kvpool._urls import warn_clear_credentials
from kvpool.errors import InvalidArgument, MetadataError
from kvpool.transfer.metadata import KEY_PREFIX, MetadataBackend, _redact
from kvpool.transfer.metadata_http import HttpClient, Response, check_name, check_value, failure_reason

_DEFAULT_ETCD_PORT = 2379
_UNAUTHENTICATED = 16  # gRPC code of "etcdserver: invalid auth token" (a token expired)


def _bad_etcd_url(url: str) -> str:
    return "etcd metadata URL must look like etcd://[user:password@]host:port[,host:port], got " + repr(
        _redact(url)
    )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class EtcdMetadata(MetadataBackend):
    """etcd v3 through its HTTP/JSON gateway (``/v3/kv/put``, ``/v3/kv/range``, ``/v3/kv/deleterange``).

    Descriptors live under ``kvpool/segments/<name>``.  Several endpoints may be given comma-separated
    (``etcd://h1:2379,h2:2379``); they are tried in order while the time budget lasts. With a user
    in the URL, each endpoint gets its own token (etcd's simple tokens are valid on the member that
    issued them only).
    """

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "etcd" or not parts.netloc:
            raise InvalidArgument(_bad_etcd_url(url))
        userinfo, _, hosts = parts.netloc.rpartition("@")
        self._user: str | None = None
        self._password = ""
        if userinfo:
            user, _, password = userinfo.partition(":")
            self._user = urllib.parse.unquote(user)
            self._password = urllib.parse.unquote(password)
            if not self._user:
                raise InvalidArgument(_bad_etcd_url(url))
        endpoints = []
        for hostport in hosts.split(","):
            hostport = hostport.strip()
            probe = urllib.parse.urlsplit(f"//{hostport}")
            try:
                port = probe.port
            except ValueError as exc:
                raise InvalidArgument(f"bad port in etcd metadata URL {_redact(url)!r}: {exc}") from exc
            if not probe.hostname or probe.username is not None:
                raise InvalidArgument(_bad_etcd_url(url))
            host = f"[{probe.hostname}]" if ":" in probe.hostname else probe.hostname
            endpoints.append(f"http://{host}:{port or _DEFAULT_ETCD_PORT}")
            if self._user is not None:  # the password goes to /v3/auth/authenticate in clear
                warn_clear_credentials(
                    f"http://{urllib.parse.quote(self._user)}:***@{host}:{port or _DEFAULT_ETCD_PORT}"
                )
        self.url = url
        self.timeout_s = timeout_s
        self._endpoints = endpoints
        self._client = HttpClient(timeout_s)
        self._tokens: dict[str, str] = {}  # endpoint -> etcd auth token (dict ops are atomic)

    @staticmethod
    def _key(name: str) -> str:
        return _b64((KEY_PREFIX + name).encode("utf-8"))

    def _post(self, endpoint: str, path: str, payload: dict[str, Any], deadline: float) -> Response:
        """One POST to ``endpoint``, with its auth token when a user is configured (fetched, and
        fetched again once when etcd answers that it expired)."""
        body = json.dumps(payload).encode("ascii")
        for attempt in (0, 1):
            headers = {"Content-Type": "application/json"}
            if self._user is not None:
                token = self._tokens.get(endpoint) if attempt == 0 else None
                headers["Authorization"] = token or self._authenticate(endpoint, deadline)
            resp = self._client.request("POST", endpoint + path, body, headers, deadline - time.monotonic())
            if self._user is None or not _token_expired(resp):
                return resp
            self._tokens.pop(endpoint, None)
        return resp

    def _authenticate(self, endpoint: str, deadline: float) -> str:
        payload = json.dumps({"name": self._user, "password": self._password}).encode()
        resp = self._client.request(
            "POST",
            f"{endpoint}/v3/auth/authenticate",
            payload,
            {"Content-Type": "application/json"},
            deadline - time.monotonic(),
        )
        token = (_json(resp) or {}).get("token") if resp.status == 200 else None
        if not isinstance(token, str) or not token:
            detail = resp.body[:200].decode("utf-8", "replace").strip()
            raise MetadataError(
                f"etcd metadata {_redact(self.url)}: {endpoint} refused user {self._user!r} "
                f"({resp.status}: {detail}); check the user and password in the URL and that etcd's "
                f"authentication is enabled"
            )
        self._tokens[endpoint] = token
        return token

    def _call(self, op: str, payload: dict[str, Any], name: str) -> dict[str, Any]:
        """POST ``payload`` to ``/v3/kv/<op>`` and return the decoded JSON answer."""
        deadline = time.monotonic() + self.timeout_s
        failure: BaseException | None = None
        resp: Response | None = None
        for endpoint in self._endpoints:
            if deadline - time.monotonic() <= 0:
                break
            try:
                resp = self._post(endpoint, f"/v3/kv/{op}", payload, deadline)
                break
            except (OSError, http.client.HTTPException, ValueError) as exc:
                failure = exc
        if resp is None:
            reason = failure_reason(failure) if failure is not None else "timed out"
            raise MetadataError(
                f"etcd metadata {_redact(self.url)} failed on {op} {name!r}: {reason} "
                f"(timeout {self.timeout_s:g} s); check that etcd is running and that its client URL "
                f"(--advertise-client-urls) matches the metadata URL"
            ) from failure
        answer = _json(resp)
        if resp.status != 200 or answer is None or "error" in answer:
            detail = resp.body[:200].decode("utf-8", "replace").strip()
            hint = (
                "etcd has authentication on: put a user in the URL (etcd://user:password@host:port)"
                if self._user is None and "user name is empty" in detail
                else "check that the URL points at an etcd >= 3.4 client port (v3 JSON gateway)"
            )
            raise MetadataError(
                f"etcd metadata {_redact(self.url)} answered {resp.status} to {op} {name!r}: {detail}; {hint}"
            )
        return answer

    def get(self, name: str) -> bytes | None:
        """Return the descriptor stored under ``kvpool/segments/<name>``, or ``None``."""
        check_name(name)
        answer = self._call("range", {"key": self._key(name)}, name)
        kvs = answer.get("kvs") or []
        if not kvs:
            return None
        try:
            # etcd's gateway omits empty fields, so an empty value comes back without "value".
            return base64.b64decode(kvs[0].get("value", ""), validate=True)
        except (AttributeError, TypeError, binascii.Error) as exc:
            raise MetadataError(
                f"etcd metadata {_redact(self.url)} returned a malformed range answer for {name!r}; "
                f"check that the URL points at an etcd server"
            ) from exc

    def put(self, name: str, value: bytes) -> None:
        """Store ``value`` under ``kvpool/segments/<name>``."""
        check_name(name)
        self._call("put", {"key": self._key(name), "value": _b64(check_value(value))}, name)

    def delete(self, name: str) -> None:
        """Delete ``kvpool/segments/<name>``; deleting an absent key is fine."""
        check_name(name)
        self._call("deleterange", {"key": self._key(name)}, name)

    def __repr__(self) -> str:
        return f"EtcdMetadata({_redact(self.url)!r}, timeout_s={self.timeout_s!r})"


def _json(resp: Response) -> dict[str, Any] | None:
    """The answer's JSON object ({} for an empty body), or None when it is not one."""
    try:
        answer = json.loads(resp.body) if resp.body else {}
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def _token_expired(resp: Response) -> bool:
    return resp.status == 401 or (_json(resp) or {}).get("code") == _UNAUTHENTICATED
