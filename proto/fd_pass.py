"""Handing file descriptors to the daemon: what ZeroMQ cannot carry (a Unix socket with
SCM_RIGHTS does).

An engine whose KV lives in memory only it can name - SGLang's HiCache host pool, made with
memfd_create - sends the daemon the pool's fds once, on the instance's fd socket
`{run_dir}/{instance}.fds.sock` (0600 in the 0700 run dir; the daemon also checks that the peer
runs as its own uid, by SO_PEERCRED). One connection carries one message:

    request:  b"KVCFDS1\\0" + count (uint16 LE), with `count` fds in one SCM_RIGHTS message
    reply:    b"OK" + token (32 hex chars)  |  b"ER" + a message (UTF-8)

The token names those fds for a `register_kv` that follows: its layout's allocations are
`{"kind": "fd", "token": T, "index": i, "size": bytes}` (layout.py). The daemon keeps unclaimed
fds for TOKEN_TTL_S at most, and at most MAX_PENDING tokens holding MAX_PENDING_FDS fds in all
(past either a message is refused, "retry later": the daemon's files are not the engines' to
fill); a registration takes them (maps
what it names and closes them all), so the daemon holds no fd of the engine's afterwards, only
the mappings until the KV is unregistered.
"""
from __future__ import annotations

import re
import socket
import struct
import time

from .paths import fd_socket_path  # noqa: F401  (where the socket is)

MAGIC = b"KVCFDS1\0"
MAX_FDS = 64           # fds in one message
MAX_PENDING = 16       # tokens not claimed yet
MAX_PENDING_FDS = 2 * MAX_FDS  # their fds, all together
TOKEN_TTL_S = 60.0     # an unclaimed token's fds are closed after this
REPLY_MAX = 512
TOKEN_RE = re.compile(r"^[0-9a-f]{32}$")


class FdPassError(OSError):
    """The daemon did not take the fds (no fd socket, refused, or no answer in time)."""


def send_fds(path: str, fds: list[int], timeout: float = 5.0) -> str:
    """Send `fds` to the daemon listening at `path`; the token it names them by."""
    if not 1 <= len(fds) <= MAX_FDS:
        raise ValueError(f"{len(fds)} fds: send 1..{MAX_FDS}")
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            _connect(sock, path, deadline)
            sock.sendmsg([MAGIC + struct.pack("<H", len(fds))],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
            reply = _read_reply(sock)
        except OSError as exc:
            raise FdPassError(f"handing {len(fds)} fds to the daemon at {path} failed: {exc}") from None
    if reply[:2] == b"OK" and TOKEN_RE.match(reply[2:].decode("ascii", "replace")):
        return reply[2:].decode("ascii")
    raise FdPassError(f"the daemon at {path} refused the fds: "
                      f"{reply[2:].decode('utf-8', 'replace') or 'no answer'}")


def _connect(sock: socket.socket, path: str, deadline: float) -> None:
    """connect(), again while the daemon's backlog is full (EAGAIN on a Unix socket) and time
    is left."""
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _read_reply(sock: socket.socket) -> bytes:
    chunks = []
    while sum(map(len, chunks)) < REPLY_MAX:
        chunk = sock.recv(REPLY_MAX)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def parse_request(data: bytes, fds: list[int]) -> str | None:
    """Why a request (its bytes and the fds that came with it) is refused, or None."""
    if len(data) != len(MAGIC) + 2 or not data.startswith(MAGIC):
        return "not a kvcached fd message"
    count = struct.unpack("<H", data[len(MAGIC):])[0]
    if count != len(fds):
        return f"the message says {count} fds, {len(fds)} came"
    if not 1 <= count <= MAX_FDS:
        return f"{count} fds: send 1..{MAX_FDS}"
    return None
