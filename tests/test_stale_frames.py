"""A closed connection's frames still queued are handled after its close, under its old fd
number, which a new connection may have taken at once: what they do (strikes, a close for
unread replies, a hello's claim on the fd) must not fall on the new connection of another
process. Real zmq sockets, a real second process, the daemon's own guard."""
from __future__ import annotations

import subprocess
import sys

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvcached.server.connections import STRIKES, ConnectionGuard

_PEER = """
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
for line in sys.stdin:  # connect | junk N | say TEXT; at the end its connection closes
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "connect":
        s.connect(sys.argv[1])
    elif cmd == "junk":
        for _ in range(int(arg)):
            s.send(b"\\xff" * 70_000)
    elif cmd == "say":
        s.send(arg.encode())
    print("done", flush=True)
s.close(linger=1000)
ctx.term()
"""


class _Peer:
    """A process with a DEALER of its own (its pid is the peer's); told what to do."""

    def __init__(self, endpoint: str):
        self.p = subprocess.Popen([sys.executable, "-c", _PEER, endpoint], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)

    def do(self, cmd: str) -> None:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        assert self.p.stdout.readline().strip() == "done"

    def leave(self) -> None:
        self.p.stdin.close()
        assert self.p.wait(10) == 0

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def _event(mon, want: int) -> int:
    assert mon.poll(10_000), "no monitor event"
    event = recv_monitor_message(mon)
    assert event["event"] == want, event
    return int(event["value"])


def _frames(router, n: int) -> list:
    """n one-frame messages: (SRCFD, the frame) of each."""
    out = []
    for _ in range(n):
        assert router.poll(10_000)
        router.recv()  # routing id
        frame = router.recv(copy=False)
        out.append((frame.get(zmq.SRCFD), frame))
    return out


@pytest.fixture
def router(tmp_path):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/stale.sock"
    sock.bind(endpoint)
    mon = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
    yield ctx, sock, mon, endpoint
    sock.disable_monitor()
    mon.close(linger=0)
    sock.close(linger=0)
    ctx.term()


def test_a_closed_connections_queued_junk_strikes_nobody_else_but_its_own_does(router):
    _ctx, sock, mon, endpoint = router
    guard = ConnectionGuard(max_connections=100, max_per_peer=100)
    gone, other = _Peer(endpoint), _Peer(endpoint)  # (their pipes' fds taken before)
    try:
        gone.do("connect")
        fd = _event(mon, zmq.EVENT_ACCEPTED)
        guard.accepted(fd, endpoint)
        gone.do(f"junk {STRIKES}")
        assert sock.poll(10_000)  # its frames are queued in the router, none read yet
        gone.leave()
        assert _event(mon, zmq.EVENT_DISCONNECTED) == fd
        assert guard.closed(fd, endpoint)
        other.do("connect")  # another process: the freed fd number is its connection's
        assert _event(mon, zmq.EVENT_ACCEPTED) == fd
        guard.accepted(fd, endpoint)
        stale = _frames(sock, STRIKES)  # the gone process's frames, read now
        assert [srcfd for srcfd, _ in stale] == [fd] * STRIKES
        for srcfd, frame in stale:
            guard.strike(srcfd, frame)
            assert not guard.unread(srcfd, frame)
        assert not mon.poll(500), "the other process's connection was shut for the gone one's junk"
        other.do("say still-here")  # its own message comes through, on the same connection
        (srcfd, frame), = _frames(sock, 1)
        assert bytes(frame.buffer) == b"still-here" and guard.same_peer(srcfd, frame)
        # the control: the connection's own junk strikes it, and it is shut
        other.do(f"junk {STRIKES}")
        for srcfd, frame in _frames(sock, STRIKES):
            guard.strike(srcfd, frame)
        assert _event(mon, zmq.EVENT_DISCONNECTED) == fd
    finally:
        gone.kill()
        other.kill()
