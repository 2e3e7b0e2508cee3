"""Credentials in URLs, redacted wherever a URL is written (a meta file, a lock's command line) or printed (a log
line, an error): `http://user:secret@host/v1?api_key=k` -> `http://***@host/v1?api_key=***`.

What counts as a credential: the whole user-info part (`user:password@`, or a token alone before `@`), and the
values of query parameters whose names say they hold one (key, token, secret, password, auth, signature).
"""

from __future__ import annotations

import re
import urllib.parse

REDACTED = "***"
_SECRET_PARAMETER = re.compile(r"key|token|secret|passw|auth|sig|credential", re.IGNORECASE)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def redact_url(url: str) -> str:
    """`url` without its credentials (module docstring); a string that is not a URL comes back as it is."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return _URL.sub(lambda m: _without_userinfo(m.group(0)), url) if "@" in url else url
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rpartition('@')[2]}"
    query = parts.query
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        if any(_SECRET_PARAMETER.search(name) for name, _ in pairs):
            query = "&".join(f"{urllib.parse.quote(name, safe='')}="
                             + (REDACTED if _SECRET_PARAMETER.search(name) else urllib.parse.quote(value, safe=""))
                             for name, value in pairs)
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_urls(text: str) -> str:
    """`text` with every URL in it redacted (`redact_url`)."""
    return _URL.sub(lambda m: redact_url(m.group(0)), text) if "://" in text else text


def _without_userinfo(url: str) -> str:
    scheme, _, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = f"{REDACTED}@{authority.rpartition('@')[2]}"
    return f"{scheme}://{authority}{slash}{path}"
