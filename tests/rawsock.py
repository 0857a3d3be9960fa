"""A raw DEALER socket for sending hand-made frames to a daemon (bad-input tests)."""
from __future__ import annotations

import msgpack
import zmq

from kvcached_proto.paths import request_endpoint


class RawSocket:
    def __init__(self, run_dir: str, instance: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(request_endpoint(run_dir, instance))

    def ask(self, *frames: bytes, timeout_ms: int = 5000) -> dict:
        self.sock.send_multipart(list(frames))
        while True:  # task events of this connection may come first: the reply is what we want
            assert self.sock.poll(timeout_ms), "the daemon did not answer"
            msg = msgpack.unpackb(self.sock.recv(), raw=False)
            if not (isinstance(msg, dict) and "event" in msg):
                return msg

    def close(self) -> None:
        self.sock.close(linger=0)
