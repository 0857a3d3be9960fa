"""The fd socket: where an engine hands the daemon memory only it can name (kvcached_proto.fd_pass).

One thread serves `{run_dir}/{instance}.fds.sock` with a selector: each connection has
CONN_TIMEOUT_S to send its one message and is answered as soon as it has, so peers that connect
and say nothing hold up no one (at most MAX_OPEN wait at once; past that the oldest is dropped).
A peer of another uid (SO_PEERCRED) is refused, and a message that is not the protocol's has
whatever fds came with it closed.
The fds wait under a random token until a `register_kv` claims them (claim() hands them over
whole: the registration maps what it names and closes them all) or until TOKEN_TTL_S passes;
at most MAX_PENDING tokens wait, holding MAX_PENDING_FDS fds in all, so a flood of fds costs the
daemon a bounded number of files (16 sets of 64 took 960 of a 1,024-file daemon, and its next
accepted connection aborted it).
"""
from __future__ import annotations

import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time

from kvcached_proto.fd_pass import MAX_FDS, MAX_PENDING, MAX_PENDING_FDS, TOKEN_TTL_S, parse_request

from ..logs import LineBudget
from .instance_files import CHECK_EVERY_S, socket_file_there
from .stop_flag import StopFlag

log = logging.getLogger(__name__)

CONN_TIMEOUT_S = 1.0
MAX_OPEN = 64  # connections waiting for their message at once
POLL_S = 0.2  # the loop's turn with nothing to do: expiries (a stop wakes it: stop_flag.py)
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class FdInbox(threading.Thread):
    def _listen(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)  # under the daemon's umask 077: 0600
            sock.listen(64)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    def _heal(self, sel) -> None:
        """(About once a second.) The socket's file gone from the run dir: listen there anew
        (the run dir is made again by the request thread: until then, the next second)."""
        if time.monotonic() < self._next_check:
            return
        self._next_check = time.monotonic() + CHECK_EVERY_S
        if socket_file_there(self.path):
            return
        try:
            sock = self._listen()
        except OSError:
            return
        sel.unregister(self._sock)
        self._sock.close()
        self._sock = sock
        sel.register(sock, selectors.EVENT_READ)
        log.warning("[fds] the fd socket %s was gone from the run dir: listening there again", self.path)

    def __init__(self, path: str):
        super().__init__(name="kvcached-fds", daemon=True)
        self.path = path
        self._sock = self._listen()
        self._next_check = 0.0  # its file there (instance_files.py)
        self._pending: dict[str, tuple[float, list[int]]] = {}
        self._lock = threading.Lock()
        self._stopping = StopFlag()
        self.received = self.refused = 0
        self._said = LineBudget()  # (this thread's) a sender in a loop fills no log

    # the engine's side ------------------------------------------------------
    def run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        sel.register(self._stopping.fd, selectors.EVENT_READ)  # (its set() ends the select)
        waiting: dict[socket.socket, float] = {}  # connection -> when it must have spoken
        try:
            while not self._stopping.is_set():
                self._expire()
                self._heal(sel)
                for key, _ in sel.select(timeout=POLL_S):
                    if key.fileobj == self._stopping.fd:
                        continue
                    try:
                        if key.fileobj is self._sock:
                            self._accept(sel, waiting)
                        else:
                            self._answer(sel, waiting, key.fileobj)
                    except Exception:  # a bug must not leave the daemon without its fd socket
                        log.exception("[fds] serving a connection failed")
                        if key.fileobj is not self._sock:
                            self._drop(sel, waiting, key.fileobj)
                now = time.monotonic()
                for conn in [c for c, deadline in waiting.items() if deadline < now]:
                    self._drop(sel, waiting, conn)  # said nothing in time
        finally:
            for conn in list(waiting):
                self._drop(sel, waiting, conn)
            sel.close()

    def _accept(self, sel, waiting: dict) -> None:
        """Every connection the backlog holds (a flood must not fill it for the others)."""
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, socket.timeout):
                return
            except OSError as exc:
                log.error("[fds] accept failed: %s", exc)
                time.sleep(0.05)
                return
            if len(waiting) >= MAX_OPEN:  # a flood of silent peers: the oldest goes
                self._drop(sel, waiting, min(waiting, key=waiting.get))
            conn.setblocking(False)
            waiting[conn] = time.monotonic() + CONN_TIMEOUT_S
            sel.register(conn, selectors.EVENT_READ)

    def _drop(self, sel, waiting: dict, conn) -> None:
        waiting.pop(conn, None)
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _answer(self, sel, waiting: dict, conn) -> None:
        try:
            reply = self._take(conn)
        except OSError as exc:  # the peer left: nothing was kept
            reply = b"ER" + str(exc).encode()[:200]
        try:
            conn.settimeout(CONN_TIMEOUT_S)
            conn.sendall(reply)
        except OSError:
            pass
        self._drop(sel, waiting, conn)

    def _take(self, conn: socket.socket) -> bytes:
        """The one message of a connection that has something to read."""
        pid, uid, _ = _CREDS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
        data, ancdata, flags, _ = conn.recvmsg(64, socket.CMSG_SPACE(MAX_FDS * 4))
        fds = _fds_of(ancdata)  # read whole (a reply to an unread message resets the peer)
        why = parse_request(data, fds)
        if uid != os.getuid():
            why = f"uid {uid} is not the daemon's ({os.getuid()})"
        if why is None and flags & socket.MSG_CTRUNC:
            why = f"more than {MAX_FDS} fds"
        with self._lock:
            if why is None and len(self._pending) >= MAX_PENDING:
                why = f"{MAX_PENDING} sets of fds wait to be registered; retry later"
            held = sum(len(got) for _at, got in self._pending.values())
            if why is None and held + len(fds) > MAX_PENDING_FDS:
                why = (f"{held} fds wait to be registered, {len(fds)} more would pass "
                       f"{MAX_PENDING_FDS}; retry later")
            if why is None:
                token = secrets.token_hex(16)
                self._pending[token] = (time.monotonic(), fds)
                self.received += 1
                self._said.log(log, logging.INFO, "taken", "[fds] %d fds from pid %d wait under a token",
                               len(fds), pid)
                return b"OK" + token.encode()
        _close_all(fds)
        self.refused += 1
        self._said.log(log, logging.WARNING, "refused", "[fds] refused a message from pid %d: %s", pid, why)
        return b"ER" + why.encode()

    # the daemon's side --------------------------------------------------------
    def claim(self, token: str) -> list[int] | None:
        """The fds sent under `token` (the caller's to close from now on), or None."""
        with self._lock:
            got = self._pending.pop(token, None)
        return None if got is None else got[1]

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [t for t, (at, _) in self._pending.items() if now - at > TOKEN_TTL_S]
            gone = [self._pending.pop(t)[1] for t in old]
        for fds in gone:
            log.warning("[fds] %d fds were not registered within %.0f s: closed", len(fds), TOKEN_TTL_S)
            _close_all(fds)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        self._stopping.set()
        if self.is_alive():
            self.join(timeout=2.0)
        if not self.is_alive():
            self._stopping.close()
        self._sock.close()
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for _, fds in pending:
            _close_all(fds)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _fds_of(ancdata) -> list[int]:
    """Every fd that came, whatever else is wrong with the message (each must be closed)."""
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds.extend(struct.unpack(f"{usable // 4}i", data[:usable]))
    return fds
