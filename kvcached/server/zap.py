"""The CURVE listener's ZAP handler: which client keys get in, at little cost to the daemon.

libzmq asks the ZAP handler of the daemon's context (a socket at inproc://zeromq.zap.01) about
every CURVE handshake that got as far as the client's key. pyzmq's ThreadAuthenticator answers
from an asyncio loop, Python on every handshake that holds the GIL the request thread needs: so
strangers (anyone with the daemon's public key, which every client is given) starting
handshakes as fast as they can - 2 processes, ~2,700 a second - took an ipc engine's ping from
p50 0.66 / p99 0.88 ms to 6.7 / 73 ms; with this handler 3.7 / 41 ms (and with the TCP
listener on an I/O thread of its own, sockets.py, 0.6-0.9 / 23-46 ms, most of that tail the
two cores this VM shares with the flooders: at nice 19 they left 0.5 / 7.5 ms). Here a
handshake costs a frozenset lookup, and the thread gives the GIL up after each answer
(PAUSE_S); a refused key is logged once per address every LOG_EVERY_S with how many were
refused since, and counted (status `connections.auth_denied`).
"""
from __future__ import annotations

import logging
import threading
import time

import zmq
from zmq.utils import z85

from ..logs import LineBudget

log = logging.getLogger("kvcached.auth")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
PAUSE_S = 0.0001  # after each answer: at most ~10,000 handshakes a second, the GIL handed over
LOG_EVERY_S = 60.0


class ZapHandler:
    """Answers ZAP requests on a thread of its own: 200 for a CURVE client whose public key
    (z85, as loaded from the allow dir) is in `allowed`, 400 for anything else."""

    def __init__(self, ctx: zmq.Context, allowed: frozenset):
        self._allowed = frozenset(z85.decode(k) for k in allowed)
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self.denied = 0
        self._said = LineBudget(lines=1, window_s=LOG_EVERY_S)  # a line per address this often
        self._thread = threading.Thread(target=self._run, name="kvcached-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = self._sock
        while not self._stop.is_set():
            if not sock.poll(100):
                continue
            try:
                msg = sock.recv_multipart(zmq.NOBLOCK)
                try:
                    reply = self._answer(msg)
                except Exception:  # a bug: this handshake fails, the next ones are answered
                    log.exception("[auth] a ZAP request could not be answered")
                    rid = msg[1] if len(msg) > 1 else b""
                    reply = [b"1.0", rid, b"500", b"internal error", b"", b""]
                sock.send_multipart(reply)  # (REP: each request answered, else none more comes)
            except zmq.ZMQError as exc:  # closed under us at stop, or a malformed exchange
                if self._stop.is_set():
                    return
                log.warning("[auth] ZAP exchange failed: %s", exc)
                continue
            time.sleep(PAUSE_S)

    def _answer(self, msg: list) -> list:
        if len(msg) < 6:  # (libzmq sends none such)
            self.denied += 1
            return [b"1.0", msg[1] if len(msg) > 1 else b"", b"400", b"malformed", b"", b""]
        version, request_id, _domain, address, _identity, mechanism = msg[:6]
        if mechanism == b"CURVE" and len(msg) == 7 and msg[6] in self._allowed:
            return [b"1.0", request_id, b"200", b"OK", z85.encode(msg[6]), b""]
        self.denied += 1
        self._say(address.decode(errors="replace"), msg[6] if len(msg) == 7 else b"")
        return [b"1.0", request_id, b"400", b"client key not allowed", b"", b""]

    def _say(self, address: str, key: bytes) -> None:
        shown = z85.encode(key).decode() if len(key) == 32 else "none"
        self._said.log(log, logging.WARNING, address, "[auth] refused a CURVE client at %s: its key "
                       "%s is not in the allow dir", address, shown)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(linger=0)
