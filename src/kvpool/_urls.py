"""URLs that may carry credentials (metadata and master URLs): the one redaction used for error
messages, reprs and logs (:func:`redact_url`), and the warning when credentials would travel in
clear text (:func:`warn_clear_credentials`: http://, redis://). Called by ``kvpool.transfer.metadata``
when it builds a backend or an error message, and by the config objects' reprs (``kvpool.config``).
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import urllib.parse

__all__ = ["SECRET_PARAMS", "redact_url", "warn_clear_credentials"]

_log = logging.getLogger("kvpool.transfer.metadata")

#: Query parameters whose values are credentials (compared lower-case).
SECRET_PARAMS = ("password", "passwd", "pass", "secret", "token", "auth")


def redact_url(url: str) -> str:
    """Return ``url`` with any password (in the user part, or a ``password``/``secret``/``token``
    query parameter) replaced by ``***`` so it can go into error messages."""
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparsable URL>"
    if password is not None:
        user = parts.username or ""
        host = parts.netloc.rpartition("@")[2]
        parts = parts._replace(netloc=f"{user}:***@{host}")
    if parts.query:
        pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        pairs = [(k, "***" if k.lower() in SECRET_PARAMS else v) for k, v in pairs]
        parts = parts._replace(query=urllib.parse.urlencode(pairs, safe="*"))
    return urllib.parse.urlunsplit(parts)


#: Schemes whose credentials travel in clear text -> the scheme that carries them over TLS.
_CLEAR_SCHEMES = {"http": "https", "redis": "rediss"}

_warned: set[str] = set()  # hosts warn_clear_credentials warned about (one line each per process)
_warned_lock = threading.Lock()


def warn_clear_credentials(url: str) -> None:
    """Log one warning per host when ``url`` sends credentials (``user:password@``, ``:password@``,
    or a ``password``/``secret``/``token`` query parameter) over plain ``http://`` or ``redis://``
    (not ``https://``, ``rediss://``) to a host that is not loopback: anyone on the network path
    reads them. Names the host, never the credentials. A host name other than ``localhost`` is not
    resolved (no blocking look-up): it gets the warning."""
    try:
        parts = urllib.parse.urlsplit(url)
        name = parts.hostname or ""
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    except ValueError:
        return  # the caller refuses the URL
    has_creds = parts.username is not None or any(k.lower() in SECRET_PARAMS for k, _ in query)
    if parts.scheme not in _CLEAR_SCHEMES or not has_creds:
        return
    try:
        if name == "localhost" or ipaddress.ip_address(name).is_loopback:
            return
    except ValueError:
        pass  # a host name
    host = parts.netloc.rpartition("@")[2]
    with _warned_lock:
        if host in _warned:
            return
        _warned.add(host)
    _log.warning(
        "the metadata URL for %s sends credentials over plain %s://, readable by anyone on the "
        "network path; use %s:// (or a metadata server on loopback)",
        host,
        parts.scheme,
        _CLEAR_SCHEMES[parts.scheme],
    )
