"""Storage URIs: as they may be shown (a password in one, `redis://user:secret@host`, never
appears in status, metrics or logs), and the disk tier's, checked without touching anything."""
from __future__ import annotations

from urllib.parse import parse_qs, urlparse, urlsplit, urlunsplit

DISK_IO_TIMEOUT_S = 5.0  # a disk tier's file I/O deadline unless the URI says io_timeout_s


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


def parse_disk_uri(uri: str) -> dict:
    """disk:///abs/path[?capacity_gb=F&io_timeout_s=F&fsync=1], checked (nothing touched)."""
    url = urlparse(uri)
    if url.scheme != "disk" or not url.path.startswith("/") or url.netloc:
        raise ValueError(f"{uri!r}: expected disk:///absolute/path[?capacity_gb=F]")
    q = parse_qs(url.query)
    unknown = set(q) - {"capacity_gb", "fsync", "io_timeout_s"}
    if unknown:
        raise ValueError(f"{uri!r}: unknown option(s) {sorted(unknown)}; known: capacity_gb, "
                         "io_timeout_s, fsync")
    return {"root": url.path, "capacity_bytes": int(_number(uri, q, "capacity_gb", 16.0) * (1 << 30)),
            "io_timeout_s": _number(uri, q, "io_timeout_s", DISK_IO_TIMEOUT_S),
            "fsync": q.get("fsync", ["0"])[0] in ("1", "true", "yes")}


def _number(uri: str, q: dict, name: str, default: float) -> float:
    raw = q.get(name, [str(default)])[0]
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{uri!r}: {name}={raw!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"{uri!r}: {name} must be a positive, finite number")
    return value
