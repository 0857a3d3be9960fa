"""Connections the daemon accepts, counted and capped, so that no flood of them takes its file
descriptors (libzmq aborts the process when an ipc accept fails with EMFILE).

At start the open-files limit is raised to its hard limit. Every accepted connection (a zmq
monitor's ACCEPTED event) is counted per request socket and per peer - a process (SO_PEERCRED)
on the ipc socket, an address on TCP; one past `max_connections` (bounded by the files limit
less a reserve for the daemon's own files) or past `max_per_peer` is shut down at once with a
logged reason, and zmq closes it. The status socket is guarded the same way, with a cap of its
own (STATUS_CONNECTIONS, STATUS_PER_PEER a process); all the listeners' caps together stay
under half the files limit. Connections that never finish their handshake are closed
by zmq after HANDSHAKE_MS. A DISCONNECTED event uncounts one.

A connection that sends requests but reads none of the replies is closed (`unread`): once its
socket's send buffer is full, zmq keeps what the daemon sends it in the daemon (a client
sending status requests without reading grew the daemon by 111 MB, up to the 100,000 replies
of the socket's SNDHWM; a key_events reply may be a MiB). When its send queue (SIOCOUTQ) has
been 3/4 of its buffer or more at its requests for UNREAD_CLOSE_S (looked at every
UNREAD_EVERY-th request, then at each once full), the next is not handled and the connection
is shut. A client that stops reading and sends nothing costs its
buffer and its tasks' events; one that is only slow to read is never closed (kvcached_client's
socket reads whatever comes: RCVHWM 0).

An fd number is reused as soon as it is closed, so an ACCEPTED fd is acted on only while its
socket is still the one accepted (its local address is the listener's), after every monitor
event queued before it was handled. Each listener has its own monitor, so one listener's
DISCONNECTED event can arrive after another listener accepted a connection on the same fd: a
close uncounts a connection only when it comes from the listener that accepted it, and an
accept that finds its fd still counted for another listener uncounts that stale one (its
socket is gone: the fd is this one now). A closed connection's messages still queued are
handled after its close's event too, with its old fd number: one that strikes, or closes for
unread replies, or says hello, acts on the connection at that fd only when the message's own
peer (libzmq's Peer-Address: on ipc the pid and uid) is that connection's.
"""
from __future__ import annotations

import fcntl
import logging
import resource
import socket
import struct
import termios
import time
from collections import Counter
from dataclasses import dataclass

import zmq

from ..logs import LineBudget

log = logging.getLogger(__name__)

FD_RESERVE = 256  # files the daemon needs besides connections: storage, segments, threads
STATUS_CONNECTIONS = 64  # the status socket's (status CLIs and pollers: few, short-lived)
STATUS_PER_PEER = 8  # one process's on the status socket: a flooder leaves room for the others
HANDSHAKE_MS = 5000
STRIKES = 3
LOG_EVERY_S = 5.0  # one line per peer this often; a flood of refusals is counted, not logged
UNREAD_CLOSE_S = 1.0  # a connection's send buffer full at its requests this long: shut
UNREAD_EVERY = 16  # requests (the ioctl on every one: ~1 us a request; so: 0.2 us, timeit)
_OUTQ = struct.Struct("i")


def raise_files_limit() -> int:
    """Lift the soft open-files limit to the hard one; returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("[startup] cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_caps(wanted: int, files_limit: int, request_listeners: int = 1) -> tuple[int, int]:
    """(per request listener, the status socket's): each request listener at most `wanted`,
    and every listener's together at most half the files limit, never the reserve - so that
    no flood of connections, on any of the daemon's zmq sockets, can take its last files."""
    budget = min(files_limit - FD_RESERVE, files_limit // 2)
    status = max(8, min(STATUS_CONNECTIONS, budget // 8))
    return max(8, min(wanted, (budget - status) // max(1, request_listeners))), status


@dataclass
class _Conn:
    listener: str
    peer: str
    strikes: int = 0  # large frames in a row that were no valid request
    shut: bool = False  # shut by the daemon, its close not seen yet: never shut twice
    full_since: float = 0.0  # monotonic: its send buffer was full at each request since (unread)
    requests: int = 0  # (unread looks at every UNREAD_EVERY-th while the buffer is not full)


def _frame_peer(frame, ipc: bool) -> str | None:
    """The peer, in _peer's words, of the connection a message came on (libzmq's Peer-Address
    property: "host:uid:gid:pid" on ipc, the address on TCP); None where it does not say."""
    try:
        said = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    if not ipc:
        return f"address {said}"
    parts = said.rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return f"pid {parts[3]} (uid {parts[1]})"


def _peer(sock: socket.socket) -> str:
    if sock.family == socket.AF_UNIX:
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                             struct.calcsize("3i")))
        return f"pid {pid} (uid {uid})"
    return f"address {sock.getpeername()[0]}"


def _local(sock: socket.socket, endpoint: str) -> bool:
    """Whether this socket is still one accepted on `endpoint` (not a reused fd)."""
    name = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        name = name.decode() if isinstance(name, bytes) else name
        return endpoint == f"ipc://{name}"
    host, port = name[:2]
    return endpoint.endswith(f":{port}")


class ConnectionGuard:
    def __init__(self, max_connections: int, max_per_peer: int):
        self.max_connections, self.max_per_peer = max_connections, max_per_peer
        self._caps: dict[str, tuple[int, str, int]] = {}  # a listener's own caps, and what they are
        self._on_listener: Counter = Counter()  # (listener, peer) -> open, where capped apart
        self._open: dict[int, _Conn] = {}
        self._per_listener: Counter = Counter()
        self._per_peer: Counter = Counter()
        self.refused = 0
        self.unread_closed = 0  # connections shut for reading none of their replies
        self._said = LineBudget(lines=1, window_s=LOG_EVERY_S)  # a line per peer this often

    def accepted(self, fd: int, endpoint: str) -> None:
        """A connection was accepted on `endpoint`: count it, or shut it if it is one too many."""
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            return  # closed already: its DISCONNECTED event follows
        try:
            if not _local(sock, endpoint):
                return
            stale = self._open.pop(fd, None)  # another listener's, its close still queued
            if stale is not None:
                self._uncount(stale)
            peer = _peer(sock)
            why = self._over(endpoint, peer)
            if why:
                self.refused += 1
                self._say(peer, endpoint, why)
                sock.shutdown(socket.SHUT_RDWR)  # zmq sees the end and closes it
                return
            self._open[fd] = _Conn(endpoint, peer)
            self._per_listener[endpoint] += 1
            self._per_peer[peer] += 1
            if endpoint in self._caps:
                self._on_listener[endpoint, peer] += 1
        except OSError as exc:  # gone meanwhile
            log.debug("[clients] accepted connection %d gone before it was counted: %s", fd, exc)
        finally:
            sock.detach()  # the fd stays zmq's

    def unread(self, fd: int, frame=None) -> bool:
        """(Before a request from fd is handled.) True when the connection is shut for reading
        none of its replies (the module's docstring): the request is dropped, unanswered."""
        conn = self._open.get(fd)
        if conn is None or conn.shut:
            return False
        conn.requests += 1
        if conn.requests % UNREAD_EVERY and not conn.full_since:
            return False
        try:
            queued = _OUTQ.unpack(fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]  # SIOCOUTQ
            full = queued >= 1 << 16 and queued * 4 >= 3 * _sndbuf(fd)  # (the ioctl alone: ~1 us)
        except OSError:
            return False
        now = time.monotonic()
        if not full or not conn.full_since:
            conn.full_since = now if full else 0.0
            return False
        if now - conn.full_since < UNREAD_CLOSE_S or not self.same_peer(fd, frame):
            return False
        conn.shut = True
        self.unread_closed += 1
        self._say(conn.peer, conn.listener, f"its replies have filled its socket's buffer, unread, "
                  f"for {now - conn.full_since:.1f} s while it sent requests", "closed a connection of")
        self._shut(fd)
        return True

    def _say(self, peer: str, endpoint: str, why: str, what: str = "refused a connection from") -> None:
        self._said.log(log, logging.WARNING, peer, "[clients] %s %s on %s: %s", what, peer, endpoint, why)

    def limit(self, endpoint: str, cap: int, what: str, per_peer: int) -> None:
        """`endpoint`'s connections are capped at `cap` (said as `what`), not max_connections,
        and each peer's on it at `per_peer` (besides max_per_peer over every listener)."""
        self._caps[endpoint] = (cap, what, per_peer)

    def _over(self, endpoint: str, peer: str) -> str:
        cap, what, per_peer = self._caps.get(endpoint, (self.max_connections, "--max-connections", 0))
        if self._per_listener[endpoint] >= cap:
            return (f"{self._per_listener[endpoint]} connections are open ({what} {cap}, "
                    "bounded by the open-files limit)")
        if per_peer and self._on_listener[endpoint, peer] >= per_peer:
            return f"it has {per_peer} connections open on this socket, its cap per process"
        if self._per_peer[peer] >= self.max_per_peer:
            return (f"it has {self._per_peer[peer]} connections open "
                    f"(--max-connections-per-peer {self.max_per_peer})")
        return ""

    def strike(self, fd: int, frame=None) -> None:
        """The connection at fd sent a large frame that was no valid request: after
        STRIKES in a row (no valid request between) it is closed - its flood then costs the
        daemon a reconnect, not a frame's bytes each time. A client with a bug gets its error
        replies first."""
        conn = self._open.get(fd)
        if conn is None or conn.shut or not self.same_peer(fd, frame):
            return
        conn.strikes += 1
        if conn.strikes >= STRIKES:
            conn.shut = True
            log.warning("[clients] closing the connection of %s on %s: %d large frames in a row "
                        "were no valid request", conn.peer, conn.listener, conn.strikes)
            self._shut(fd)

    def same_peer(self, fd: int, frame) -> bool:
        """False when message `frame` came from another peer than the connection counted at fd:
        it came on a connection since closed, whose fd number a new one has taken (its frames
        still queued are handled after the close's event): nothing it did is the new one's."""
        conn = self._open.get(fd)
        if conn is None or frame is None:
            return True
        said = _frame_peer(frame, conn.listener.startswith("ipc://"))
        return said is None or said == conn.peer

    def is_open(self, fd: int, frame) -> bool:
        """Whether message `frame`, from fd, came on a connection that is open and counted: not
        one shut at accept (past a cap) or closed since, whose close's event may already have
        been handled (nothing would ever drop a client registered for it)."""
        conn = self._open.get(fd)
        return conn is not None and not conn.shut and self.same_peer(fd, frame)

    def valid(self, fd: int) -> None:
        conn = self._open.get(fd)
        if conn is not None:
            conn.strikes = 0

    def _shut(self, fd: int) -> None:
        """Shut a counted connection (its fd is still the one counted: it is in _open until
        its DISCONNECTED event); zmq sees the end and closes it."""
        try:
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            log.debug("[clients] connection %d already closed: %s", fd, exc)
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError as exc:
            log.debug("[clients] connection %d already going: %s", fd, exc)
        finally:
            sock.detach()

    def closed(self, fd: int, endpoint: str) -> bool:
        """A connection of `endpoint` closed; False when fd is not that listener's (any more)."""
        conn = self._open.get(fd)
        if conn is None or conn.listener != endpoint:
            return False
        del self._open[fd]
        self._uncount(conn)
        return True

    def _uncount(self, conn: _Conn) -> None:
        self._per_listener[conn.listener] -= 1
        self._per_peer[conn.peer] -= 1
        if conn.listener in self._caps:
            self._on_listener[conn.listener, conn.peer] -= 1
            if not self._on_listener[conn.listener, conn.peer]:
                del self._on_listener[conn.listener, conn.peer]

    def status(self) -> dict:
        return {"open": len(self._open), "refused": self.refused, "max": self.max_connections,
                "max_per_peer": self.max_per_peer, "unread_closed": self.unread_closed}


def _sndbuf(fd: int) -> int:
    """The socket's send buffer now (TCP's grows as it tunes itself)."""
    sock = socket.socket(fileno=fd)
    try:
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    finally:
        sock.detach()
