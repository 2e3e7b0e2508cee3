"""URLs as DeepSpec writes and prints them: never with the credentials a user put in them."""

from __future__ import annotations

import urllib.parse


def redact_url(url: str) -> str:
    """`url` with any user name and password replaced by `***` (everything else kept)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    netloc = f"***@{host}" + (f":{parts.port}" if parts.port is not None else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
