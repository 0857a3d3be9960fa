"""A bare pyzmq ROUTER echo: the baseline `kvcached bench ipc` compares the daemon against.

Run as `python -m kvcached.bench.echo ENDPOINT MAX_SECONDS`; it echoes every message back to
its sender and exits on an empty frame or after MAX_SECONDS.
"""
import sys
import time

import zmq


def main() -> int:
    endpoint, max_s = sys.argv[1], float(sys.argv[2])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    print("ready", flush=True)
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        if not sock.poll(100):
            continue
        frames = sock.recv_multipart()
        if len(frames) == 2 and frames[1] == b"":
            break
        sock.send_multipart(frames)
    sock.close(linger=0)
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
