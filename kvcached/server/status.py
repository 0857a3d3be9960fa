"""The status socket: a REP socket on its own thread, so a busy data path cannot starve it."""
from __future__ import annotations

import logging
import threading
from typing import Callable

import zmq

from kvcached_proto import ErrorCode, Op, ProtocolError, decode_request, encode, ok_reply
from kvcached_proto.messages import parse_request, reply_for

log = logging.getLogger(__name__)


class StatusThread(threading.Thread):
    def __init__(self, ctx: zmq.Context, endpoint: str, snapshot: Callable[[], dict]):
        super().__init__(name="kvcached-status", daemon=True)
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        self._sock.bind(endpoint)
        self.endpoint = endpoint
        # its connections, counted and capped by the daemon's loop like the request sockets'
        self.monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED)
        self._snapshot = snapshot
        self._stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self._sock.poll(100):
                    continue
                frame = self._sock.recv()
                self._sock.send(encode(self._answer(frame)))
        except zmq.ZMQError as exc:
            if not self._stopping.is_set():
                log.error("[status] status socket failed: %s", exc)
        finally:
            self._sock.close(linger=0)

    def _answer(self, frame: bytes) -> dict:
        rid = 0
        try:
            req = parse_request(decode_request(frame, {}))
            rid = req.rid
            if req.op != Op.STATUS:
                raise ProtocolError(ErrorCode.UNKNOWN_OP, "the status socket answers status only")
            return ok_reply(rid, status=self._snapshot())
        except ProtocolError as exc:
            return reply_for(rid, exc)
        except Exception as exc:
            log.exception("[status] building the status failed")
            return reply_for(rid, exc)

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=2.0)
        if self.is_alive():
            log.error("[shutdown] status thread did not stop within 2 s")
