"""Pluggable stores for segment descriptors, selected by URL.

A *segment descriptor* is an opaque blob (serialized by the transfer engine) that tells peers how to
reach the memory a process registered.  The engine publishes it under the segment name and peers look
it up by that name.  This module only moves those bytes; it never interprets them.

Supported URLs (see :func:`open_metadata`):

``p2p``
    No central store: the engine exchanges descriptors directly with its peers.
``http://host:port/path`` (or ``https://``)
    Mooncake's HTTP metadata protocol, served e.g. by ``kvpool metadata-server``.
``etcd://host:port``
    The etcd v3 HTTP/JSON gateway (etcd >= 3.4 serves it on the client port).
``redis://host:port[/db]`` (or ``rediss://``)
    A Redis server, through redis-py.

Every backend bounds each call by the ``timeout_s`` given to :func:`open_metadata` and reports any
network failure, timeout or malformed answer as :class:`~kvpool.errors.MetadataError`.
"""

from __future__ import annotations

import abc
import hashlib
import hmac
import http.client
import os
import time
import urllib.error
import urllib.parse
from types import TracebackType
from typing import Any

from kvpool._urls import redact_url as _redact
from kvpool._urls import warn_clear_credentials
from kvpool.errors import InvalidArgument, MetadataError
from kvpool.transfer.metadata_http import (
    MAX_VALUE_BYTES,
    HttpClient,
    Response,
    check_name,
    check_value,
    failure_reason,
)

__all__ = [
    "KEY_PREFIX",
    "MAX_VALUE_BYTES",
    "EtcdMetadata",  # noqa: F822 - from metadata_etcd, through __getattr__
    "HttpMetadata",
    "MetadataBackend",
    "RedisMetadata",
    "open_metadata",
]

#: Prefix of the keys the etcd and redis backends store descriptors under.
KEY_PREFIX = "kvpool/segments/"


#: HTTP header carrying the proof of the cluster secret on metadata writes.
AUTH_HEADER = "X-Kvpool-Auth"


def write_mac(secret: str, method: str, name: str, ts: str, nonce: str, body: bytes) -> str:
    """HMAC-SHA256 (hex) binding one metadata write to the secret: method, key, time, nonce, body."""
    msg = "\n".join(["kvpool-metadata-write", method, name, ts, nonce, hashlib.sha256(body).hexdigest()])
    return hmac.new(
        secret.encode("utf-8", "surrogatepass"), msg.encode("utf-8", "surrogatepass"), hashlib.sha256
    ).hexdigest()


def auth_header(secret: str, method: str, name: str, body: bytes) -> str:
    """The ``X-Kvpool-Auth`` value for one write: ``ts=<unix s>,nonce=<hex>,mac=<hex>``; the secret
    itself never travels, and a captured header is good for this one write only (nonce, time)."""
    ts, nonce = str(int(time.time())), os.urandom(16).hex()
    return f"ts={ts},nonce={nonce},mac={write_mac(secret, method, name, ts, nonce, body)}"


class MetadataBackend(abc.ABC):
    """get/put/delete of opaque descriptor bytes by segment name.

    Implementations are safe to share between threads.  They can be used as context managers, which
    calls :meth:`close` on exit.
    """

    @abc.abstractmethod
    def get(self, name: str) -> bytes | None:
        """Return the descriptor published under ``name``, or ``None`` when there is none."""

    @abc.abstractmethod
    def put(self, name: str, value: bytes) -> None:
        """Publish ``value`` under ``name``, replacing any previous descriptor."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove the descriptor published under ``name``; removing an absent one is not an error."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op for stateless backends
        """Release network resources held by the backend.  Calling it twice is harmless."""

    def __enter__(self) -> MetadataBackend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class HttpMetadata(MetadataBackend):
    """Mooncake's HTTP metadata protocol.

    ``GET {url}?key=<name>`` answers 200 with the descriptor or 404 when absent, ``PUT {url}?key=<name>``
    stores the request body and ``DELETE {url}?key=<name>`` removes it.  ``kvpool metadata-server``
    (and Mooncake's own metadata servers) speak it.
    """

    def __init__(self, url: str, timeout_s: float = 5.0, secret: str | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidArgument(
                "HTTP metadata URL must look like http://host:port/path, got " + repr(_redact(url))
            )
        warn_clear_credentials(url)
        self.url = url
        self.timeout_s = timeout_s
        self._secret = secret or None  # writes carry an HMAC proof of it (kvpool metadata-server --secret)
        self._client = HttpClient(timeout_s)

    def _key_url(self, name: str) -> str:
        sep = "&" if urllib.parse.urlsplit(self.url).query else "?"
        return f"{self.url}{sep}key={urllib.parse.quote(name, safe='')}"

    def _request(self, method: str, name: str, body: bytes | None = None) -> Response:
        headers = None
        if self._secret and method in ("PUT", "DELETE"):
            headers = {AUTH_HEADER: auth_header(self._secret, method, name, body or b"")}
        try:
            return self._client.request(method, self._key_url(name), body, headers)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise MetadataError(
                f"HTTP metadata server {_redact(self.url)} failed on {method} {name!r}: "
                f"{failure_reason(exc)} (timeout {self.timeout_s:g} s); check that the server is running "
                f"(e.g. `kvpool metadata-server --port PORT`) and that the metadata URL is right"
            ) from exc

    def _unexpected(self, method: str, name: str, resp: Response) -> MetadataError:
        snippet = resp.body[:200].decode("utf-8", "replace").strip()
        hint = "check the metadata URL (host, port and path such as /metadata)"
        if resp.status == 413:
            hint = "the descriptor is larger than the server accepts; raise its body-size limit"
        elif resp.status == 401:
            hint = "the metadata server needs the cluster secret for writes; set the same `secret` here"
        elif resp.status in (503, 507):
            hint = "the metadata server is at a limit (connections, keys or bytes); retry or raise it"
        return MetadataError(
            f"HTTP metadata server {_redact(self.url)} answered {resp.status} to {method} {name!r}"
            f"{': ' + snippet if snippet else ''}; {hint}"
        )

    def get(self, name: str) -> bytes | None:
        """Return the descriptor stored under ``name``, or ``None`` on 404."""
        check_name(name)
        resp = self._request("GET", name)
        if resp.status == 200:
            return resp.body
        if resp.status == 404:
            return None
        raise self._unexpected("GET", name, resp)

    def put(self, name: str, value: bytes) -> None:
        """Store ``value`` under ``name`` with ``PUT``."""
        check_name(name)
        resp = self._request("PUT", name, check_value(value))
        if not 200 <= resp.status < 300:
            raise self._unexpected("PUT", name, resp)

    def delete(self, name: str) -> None:
        """Remove ``name`` with ``DELETE``; a 404 (already absent) is fine."""
        check_name(name)
        resp = self._request("DELETE", name)
        if not (200 <= resp.status < 300 or resp.status == 404):
            raise self._unexpected("DELETE", name, resp)

    def __repr__(self) -> str:
        return f"HttpMetadata({_redact(self.url)!r}, timeout_s={self.timeout_s!r})"


class RedisMetadata(MetadataBackend):
    """Redis through redis-py; descriptors are plain string keys ``kvpool/segments/<name>``.

    redis-py is imported when the backend is created; connections are opened lazily on first use.
    """

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise MetadataError(
                f"redis metadata {_redact(url)} needs the redis-py client: `pip install redis`"
            ) from exc
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            raise InvalidArgument(
                "redis metadata URL must look like redis://host:port[/db], got " + repr(_redact(url))
            )
        warn_clear_credentials(url)  # redis:// sends its AUTH password in clear (rediss:// does not)
        self.url = url
        self.timeout_s = timeout_s
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
            )
        except (ValueError, redis.RedisError) as exc:
            raise InvalidArgument(f"bad redis metadata URL {_redact(url)!r}: {exc}") from exc

    @staticmethod
    def _key(name: str) -> str:
        return KEY_PREFIX + name

    def _fail(self, op: str, name: str, exc: BaseException) -> MetadataError:
        return MetadataError(
            f"redis metadata {_redact(self.url)} failed on {op} {name!r}: {failure_reason(exc)} "
            f"(timeout {self.timeout_s:g} s); check that redis-server is running there and that "
            f"the URL (host, port, db, password) is right"
        )

    def get(self, name: str) -> bytes | None:
        """Return the descriptor stored under ``kvpool/segments/<name>``, or ``None``."""
        check_name(name)
        try:
            value = self._client.get(self._key(name))
        except self._errors as exc:
            raise self._fail("GET", name, exc) from exc
        if value is None or isinstance(value, bytes):
            return value
        raise MetadataError(
            f"redis metadata {_redact(self.url)} returned {type(value).__name__} for {name!r}; "
            f"do not enable decode_responses on this URL"
        )

    def put(self, name: str, value: bytes) -> None:
        """Store ``value`` under ``kvpool/segments/<name>``."""
        check_name(name)
        data = check_value(value)
        try:
            self._client.set(self._key(name), data)
        except self._errors as exc:
            raise self._fail("SET", name, exc) from exc

    def delete(self, name: str) -> None:
        """Delete ``kvpool/segments/<name>``; deleting an absent key is fine."""
        check_name(name)
        try:
            self._client.delete(self._key(name))
        except self._errors as exc:
            raise self._fail("DEL", name, exc) from exc

    def close(self) -> None:
        """Close the connection pool."""
        try:
            self._client.close()
        except self._errors:
            pass

    def __repr__(self) -> str:
        return f"RedisMetadata({_redact(self.url)!r}, timeout_s={self.timeout_s!r})"


def __getattr__(name: str) -> Any:  # EtcdMetadata lives in metadata_etcd (it imports this module)
    if name == "EtcdMetadata":
        from kvpool.transfer.metadata_etcd import EtcdMetadata

        return EtcdMetadata
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_metadata(url: str, timeout_s: float = 5.0, secret: str | None = None) -> MetadataBackend | None:
    """Open the descriptor store named by ``url``.

    ``"p2p"`` returns ``None`` (the engine exchanges descriptors with peers itself);
    ``http(s)://host:port/path`` gives :class:`HttpMetadata`, ``etcd://host:port`` gives
    :class:`EtcdMetadata` and ``redis://host:port[/db]`` (or ``rediss://``) gives :class:`RedisMetadata`.
    Nothing is contacted until the first call.  Anything else raises :class:`InvalidArgument`.
    With ``secret``, HTTP writes carry an HMAC proof of it (``X-Kvpool-Auth``); descriptors themselves
    are signed by the engine, whatever the backend.
    """
    if not isinstance(url, str):
        raise InvalidArgument(f"metadata URL must be a str, got {type(url).__name__}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise InvalidArgument(f"metadata timeout_s must be a positive number of seconds, got {timeout_s!r}")
    timeout_s = float(timeout_s)
    text = url.strip()
    if text.lower() == "p2p":
        return None
    try:
        scheme = urllib.parse.urlsplit(text).scheme.lower()
    except ValueError as exc:
        raise InvalidArgument(f"malformed metadata URL {_redact(url)!r}: {exc}") from exc
    if scheme in ("http", "https"):
        return HttpMetadata(text, timeout_s, secret)
    if scheme == "etcd":
        from kvpool.transfer.metadata_etcd import EtcdMetadata

        return EtcdMetadata(text, timeout_s)
    if scheme in ("redis", "rediss"):
        return RedisMetadata(text, timeout_s)
    raise InvalidArgument(
        f"unsupported metadata URL {_redact(url)!r}; use 'p2p', http://host:port/metadata, "
        f"etcd://host:port or redis://host:port[/db]"
    )
