"""The daemon's two request sockets and their settings: the ipc ROUTER in the run dir, and for
--listen a CURVE-encrypted TCP ROUTER whose clients must hold an allowed key.

What one connection may have queued in the daemon: RECV_HWM frames of at most RECV_MAX_BYTES
(zmq stops reading a connection whose queue is full, so a flood waits in the flooder's own
memory); frames a little over MAX_FRAME_BYTES get FRAME_TOO_LARGE, zmq drops a peer that sends
more. Clients wait for each reply, so a few frames in flight per connection is plenty. A peer
that has not finished its handshake in HANDSHAKE_MS is closed; ZMTP heartbeats close one that
stops answering (a hung host, a cut network: no FIN ever comes), which the disconnect monitor
turns into a dead client.
"""
from __future__ import annotations

import logging

import zmq

from kvcached_proto import MAX_FRAME_BYTES

from ..errors import StartupError
from .connections import HANDSHAKE_MS

log = logging.getLogger(__name__)

RECV_MAX_BYTES = MAX_FRAME_BYTES + (1 << 20)
RECV_HWM = 4
SEND_HWM = 100000
ZMTP_HEARTBEAT_MS, ZMTP_HEARTBEAT_TIMEOUT_MS = 1000, 5000


def _router(ctx: zmq.Context) -> zmq.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, RECV_MAX_BYTES)
    sock.setsockopt(zmq.RCVHWM, RECV_HWM)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    sock.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMTP_HEARTBEAT_TIMEOUT_MS)
    return sock


def ipc_router(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = _router(ctx)
    sock.bind(endpoint)
    return sock


def curve_router(ctx: zmq.Context, cfg):
    """(socket, authenticator) for cfg.listen: CURVE with the daemon's key pair, and only
    clients whose public key is in cfg.curve_allow_dir get through the ZAP handshake."""
    import zmq.auth
    from zmq.auth.thread import ThreadAuthenticator

    try:
        public, secret = zmq.auth.load_certificate(cfg.curve_secret_key_file)
    except (OSError, ValueError) as exc:
        raise StartupError(f"--curve-secret-key-file {cfg.curve_secret_key_file}: {exc}") from None
    if not secret:
        raise StartupError(f"--curve-secret-key-file {cfg.curve_secret_key_file}: no secret key in it")
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvcached.auth"))
    auth.start()
    auth.configure_curve(domain="*", location=cfg.curve_allow_dir)
    sock = _router(ctx)
    sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
    for endpoint in cfg.listen:
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)  # else the context's term() waits for it forever
            auth.stop()
            raise StartupError(f"--listen {endpoint}: cannot listen there: {exc}") from None
    log.info("[startup] CURVE on %s; allowed client keys from %s", ", ".join(cfg.listen),
             cfg.curve_allow_dir)
    return sock, auth
