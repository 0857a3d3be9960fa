"""The daemon's two request sockets and their settings: the ipc ROUTER in the run dir, and for
--listen a CURVE-encrypted TCP ROUTER whose clients must hold an allowed key.

What one connection may have queued in the daemon: RECV_HWM frames of at most RECV_MAX_BYTES
and the one zmq is reading (it stops reading a connection whose queue is full, so a flood waits
in the flooder's own memory): 11 MiB at most, a bound that the connection caps multiply; in
practice about a frame a connection - 512 connections flooding 2 MiB frames took the daemon
from 279 to 1,185-1,238 MB at its peak (8 MiB frames, the cap before: 3,376 MB). Frames a
little over MAX_REQUEST_BYTES get FRAME_TOO_LARGE, zmq drops a peer that sends more, and
heap_trim.py gives back the heap such frames leave. A client has a few frames in flight at
most (a step's loads, sent together, wait past the fourth in the client's own queue, which
costs them nothing the replies do not). A peer that has not finished its handshake in
HANDSHAKE_MS is closed. A TCP peer whose host or network is gone (no FIN ever comes) is found
by TCP keepalive (probes after TCP_KEEPALIVE_IDLE_S, then every second: about 10 s), which the
disconnect monitor turns into a dead client; an ipc peer's connection ends with its process.
No ZMTP heartbeat: libzmq 4.3.5 aborts the whole process when its heartbeat timer fires on a
connection whose input it had stopped (its queue full: a flood) and then seen end or more data
(`Assertion failed: !_io_error (src/stream_engine_base.cpp:310)`; seen in the faults bench, and
in 3 runs of 3 of tests/test_overload.py's socket-settings flood with the 1 s beat put back).
"""
from __future__ import annotations

import logging
import os
import stat

import zmq

from kvcached_proto import MAX_REQUEST_BYTES

from ..errors import StartupError
from .connections import HANDSHAKE_MS

log = logging.getLogger(__name__)

RECV_MAX_BYTES = MAX_REQUEST_BYTES + (256 << 10)
RECV_HWM = 4
SEND_HWM = 100000
# zmq I/O threads (AFFINITY bits): the ipc sockets' connections on the first, and with --listen
# the TCP ones on a second. A CURVE handshake's crypto runs on the I/O thread of its connection:
# strangers' handshakes (they need only the daemon's public key) on the one thread the engine's
# requests and replies went through kept its ping at p50 3.7 ms, with the ZAP answers already
# cheap (zap.py); on a thread of their own, 0.6-0.9 ms (idle 0.66)
LOCAL_IO, TCP_IO = 1, 2
TCP_KEEPALIVE_IDLE_S, TCP_KEEPALIVE_INTVL_S, TCP_KEEPALIVE_CNT = 5, 1, 5


def io_threads(listen: bool) -> int:
    return 2 if listen else 1


def _router(ctx: zmq.Context) -> zmq.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, RECV_MAX_BYTES)
    sock.setsockopt(zmq.RCVHWM, RECV_HWM)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)  # (no ZMTP heartbeat: see above)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, TCP_KEEPALIVE_INTVL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, TCP_KEEPALIVE_CNT)
    return sock


def ipc_router(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = _router(ctx)
    sock.setsockopt(zmq.AFFINITY, LOCAL_IO)
    try:
        sock.bind(endpoint)
    except BaseException as exc:
        sock.close(linger=0)  # (left open, it kept the context's term() - the stop - waiting)
        if isinstance(exc, zmq.ZMQError):
            raise StartupError(f"cannot listen on {endpoint}: {exc}") from None
        raise
    return sock


def curve_router(ctx: zmq.Context, cfg):
    """(socket, ZAP handler) for cfg.listen: CURVE with the daemon's key pair, and only
    clients whose public key is in cfg.curve_allow_dir get through the ZAP handshake."""
    import zmq.auth

    from .zap import ZapHandler

    try:
        public, secret = zmq.auth.load_certificate(cfg.curve_secret_key_file)
    except (OSError, ValueError) as exc:
        raise StartupError(f"--curve-secret-key-file {cfg.curve_secret_key_file}: {exc}") from None
    if not secret:
        raise StartupError(f"--curve-secret-key-file {cfg.curve_secret_key_file}: no secret key in it")
    allowed = allowed_client_keys(cfg.curve_allow_dir)
    auth = ZapHandler(ctx, allowed)
    sock = _router(ctx)
    sock.setsockopt(zmq.AFFINITY, TCP_IO)
    sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
    for endpoint in cfg.listen:
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)  # else the context's term() waits for it forever
            auth.stop()
            raise StartupError(f"--listen {endpoint}: cannot listen there: {exc}") from None
    log.info("[startup] CURVE on %s; %d allowed client key(s) from %s", ", ".join(cfg.listen),
             len(allowed), cfg.curve_allow_dir)
    return sock, auth


def _private_to_us(st) -> str:
    """'' when a file is ours (or root's) and not writable by group or others."""
    if st.st_uid not in (os.getuid(), 0):
        return f"owned by uid {st.st_uid}, not the daemon's ({os.getuid()}) or root"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); chmod go-w it"
    return ""


def _dir_private_to_us(st) -> str:
    """As _private_to_us, but a directory others may write is fine when it is sticky (a
    Kubernetes Secret volume is 1777): they can add files there, which are theirs and refused
    one by one, but cannot remove or replace ours."""
    if st.st_mode & stat.S_ISVTX and st.st_uid in (os.getuid(), 0):
        return ""
    return _private_to_us(st)


def _public_key(path: str, name: str, refuse) -> bytes:
    """The public key of one certificate file, read from the file whose owner and mode were
    checked (not reopened by name), in the format zmq.auth writes (`public-key = "..."`)."""
    from zmq.utils import z85

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)  # a FIFO must not hang us
    except OSError as exc:
        raise refuse(f"{name}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refuse(f"{name} is not a regular file")
        if why := _private_to_us(st):
            raise refuse(f"{name}: anyone who can write it can admit a client: {why}")
        data = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    for line in data.splitlines():
        line = line.strip()
        if line.startswith(b"public-key"):
            key = line.partition(b"=")[2].strip(b" \t'\"")
            try:
                if len(key) == 40 and len(z85.decode(key)) == 32:
                    return key
            except (ValueError, KeyError, TypeError):
                pass
            break
    raise refuse(f"{name} is not a CURVE public key certificate (no valid `public-key = ...` "
                 "line; `kvcached keygen` writes them)")


def allowed_client_keys(directory: str) -> frozenset:
    """The public keys (z85) of the *.key certificates in the allow dir, each checked: who can
    write a key there admits a client, so every key file (links followed) must be the daemon
    user's or root's and not writable by group or others, and so must the directory unless it
    is sticky; a file that is no public key certificate, or a directory with none, refuses the
    start (pyzmq's own loader logged such a file and then admitted no client at all)."""
    def refuse(why: str):
        return StartupError(f"--curve-allow-dir {directory}: {why}")
    try:
        why = _dir_private_to_us(os.stat(directory))
        names = sorted(n for n in os.listdir(directory) if n.endswith(".key"))
    except OSError as exc:
        raise refuse(exc.strerror) from None
    if why:
        raise refuse(f"anyone who can write there can admit a client: {why}")
    keys = {_public_key(os.path.join(directory, name), name, refuse) for name in names}
    if not keys:
        raise refuse("no *.key certificate in it: no client could connect over TCP "
                     "(`kvcached keygen` writes them)")
    return frozenset(keys)
