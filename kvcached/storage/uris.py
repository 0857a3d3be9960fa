"""Storage URIs as they may be shown: a password in one (`redis://user:secret@host`) never
appears in status, metrics or logs."""
from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redact(uri: str) -> str:
    """The URI with the password of its userinfo replaced by ***."""
    try:
        url = urlsplit(uri)
        password = url.password
    except ValueError:  # a malformed netloc: show no userinfo at all
        return uri.split("://", 1)[0] + "://***" if "@" in uri else uri
    if password is None:
        return uri
    host = url.netloc.rsplit("@", 1)[1]
    user = url.username or ""
    return urlunsplit(url._replace(netloc=f"{user}:***@{host}"))
