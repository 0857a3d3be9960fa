"""Storage URIs: as they may be shown (a password in one, `redis://user:secret@host`, never
appears in status, metrics or logs), and the disk, Redis and Mooncake tiers', checked without
touching anything (redis_store.py and mooncake_store.py say what their options mean)."""
from __future__ import annotations

import socket
from urllib.parse import parse_qs, unquote, urlparse, urlsplit, urlunsplit

DISK_IO_TIMEOUT_S = 5.0  # a disk tier's file I/O deadline unless the URI says io_timeout_s
MOONCAKE_IO_TIMEOUT_S = 0.5  # a Mooncake tier's call deadline unless the URI says io_timeout_s
LOOKUP_KEYS = 16384  # a remote tier's walk of one request's keys unless the URI says lookup_keys


def scheme_of(uri: str) -> str:
    """The URI's scheme ("disk", "redis+sentinel", ...), "" without one."""
    return uri.split("://", 1)[0] if "://" in uri else ""


def redact(uri: str) -> str:
    """The URI with the password of its userinfo replaced by ***."""
    try:
        url = urlsplit(uri)
        password = url.password
    except ValueError:  # a malformed netloc: show no userinfo at all
        return scheme_of(uri) + "://***" if "@" in uri else uri
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


def _count(uri: str, q: dict, name: str, default: int) -> int:
    raw = q.get(name, [str(default)])[0]
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{uri!r}: {name}={raw!r}: expected a whole number >= 1")
    return int(raw)


def _local_address(host: str, port: int) -> str:
    """The local address that routes to the master (what other clients reach us at)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def parse_mooncake_uri(uri: str) -> dict:
    """mooncake://HOST:PORT[?options], checked (nothing connected)."""
    shown = redact(uri)
    try:
        url = urlparse(uri)
        port = url.port
    except ValueError:
        raise ValueError(f"{shown!r}: the port must be an integer in 0..65535") from None
    if url.scheme != "mooncake" or not url.hostname or not port:
        raise ValueError(f"{shown!r}: expected mooncake://MASTER_HOST:PORT[?options]")
    q = parse_qs(url.query)
    known = {"metadata", "protocol", "device", "host", "segment_gb", "buffer_mb", "prefix", "io_timeout_s",
             "lookup_keys"}
    unknown = set(q) - known
    if unknown:
        raise ValueError(f"{shown!r}: unknown option(s) {sorted(unknown)}; known: {', '.join(sorted(known))}")

    def number(name: str, default: float, zero_ok: bool = False) -> float:
        raw = q.get(name, [str(default)])[0]
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{shown!r}: {name}={raw!r} is not a number") from None
        if not (0 <= value if zero_ok else 0 < value) or value == float("inf"):
            raise ValueError(f"{shown!r}: {name} must be a {'non-negative' if zero_ok else 'positive'} number")
        return value

    protocol = q.get("protocol", ["tcp"])[0]
    if protocol not in ("tcp", "rdma"):
        raise ValueError(f"{shown!r}: protocol={protocol!r}: expected tcp or rdma")
    return {"master": f"{url.hostname}:{port}", "metadata": q.get("metadata", ["P2PHANDSHAKE"])[0],
            "protocol": protocol, "device": q.get("device", [""])[0],
            "host": q.get("host", [None])[0] or _local_address(url.hostname, port),
            "segment_bytes": int(number("segment_gb", 1.0, zero_ok=True) * (1 << 30)),
            "buffer_bytes": int(number("buffer_mb", 64.0) * (1 << 20)),
            "prefix": q.get("prefix", ["kvcached/"])[0],
            "io_timeout_s": number("io_timeout_s", MOONCAKE_IO_TIMEOUT_S),
            "lookup_keys": _count(shown, q, "lookup_keys", LOOKUP_KEYS)}


REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel")
SENTINEL_PORT = 26379


def parse_redis_uri(uri: str) -> dict:
    """A Redis tier's URI (redis_store.py says what they mean), its parts and options checked
    (no connection is made). Messages show the URI without its password."""
    shown = redact(uri)
    scheme = scheme_of(uri)
    sentinel = scheme.endswith("+sentinel")
    try:
        url = urlparse(uri)
        port = None if sentinel else (url.port or 6379)
    except ValueError:
        raise ValueError(f"{shown!r}: the port must be an integer in 0..65535") from None
    hosts = url.netloc.rpartition("@")[2]
    if scheme not in REDIS_SCHEMES or not hosts or (not sentinel and not url.hostname):
        raise ValueError(f"{shown!r}: expected redis[s]://[[user]:password@]host:port/db, "
                         "redis[s]+cluster://[[user]:password@]host:port or "
                         "redis[s]+sentinel://[[user]:password@]host:port[,host:port...]/db?service=NAME")
    q = parse_qs(url.query)
    known = {"prefix", "ttl_s", "ca", "lookup_keys"} | ({"service", "sentinel_auth"} if sentinel else set())
    unknown = set(q) - known
    if unknown:
        raise ValueError(f"{shown!r}: unknown option(s) {sorted(unknown)}; known: {', '.join(sorted(known))}")
    tls = scheme.startswith("rediss")
    if "ca" in q and not tls:
        raise ValueError(f"{shown!r}: ca= is for TLS (rediss://)")
    try:
        db = int(url.path.strip("/") or 0)
        ttl_s = int(q.get("ttl_s", ["0"])[0])
    except ValueError:
        raise ValueError(f"{shown!r}: the port, the db number and ttl_s must be integers") from None
    if ttl_s < 0 or db < 0:
        raise ValueError(f"{shown!r}: ttl_s and the db number must not be negative")
    out = {"cluster": scheme.endswith("+cluster"), "host": url.hostname, "port": port,
           "db": db, "prefix": q.get("prefix", ["kvcached:"])[0].encode(), "ttl_s": ttl_s or None,
           "username": unquote(url.username) if url.username else None,
           "password": unquote(url.password) if url.password is not None else None,
           "tls": tls, "ca": q.get("ca", [None])[0], "sentinels": None,
           "lookup_keys": _count(shown, q, "lookup_keys", LOOKUP_KEYS)}
    if sentinel:
        service = q.get("service", [""])[0]
        if not service:
            raise ValueError(f"{shown!r}: service=NAME (the name the sentinels monitor the primary by) "
                             "is needed")
        auth = q.get("sentinel_auth", ["0"])[0]
        if auth not in ("0", "1"):
            raise ValueError(f"{shown!r}: sentinel_auth is 0 or 1")
        out.update(sentinels=_host_ports(hosts, shown), service=service, sentinel_auth=auth == "1",
                   host=None)
    return out


def _host_ports(hosts: str, shown: str) -> list[tuple[str, int]]:
    """host:port[,host:port...] (a sentinel's port is 26379 unless given)."""
    out = []
    for part in hosts.split(","):
        one = urlsplit("//" + part)
        try:
            port = one.port or SENTINEL_PORT
        except ValueError:
            raise ValueError(f"{shown!r}: {part!r}: the port must be an integer in 0..65535") from None
        if not one.hostname:
            raise ValueError(f"{shown!r}: {part!r} is no host:port")
        out.append((one.hostname, port))
    return out
