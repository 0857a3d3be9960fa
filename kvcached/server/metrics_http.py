"""The HTTP server behind `--metrics-port`: one thread, non-blocking sockets, every cost bounded.

prometheus_client's own server starts a thread per connection and waits on each without a
deadline. Anyone who can reach the port (on loopback: every local user) could open connections
that never finish a request and pile up the daemon's threads, which count against its user's
process limit (the engine's, when they run as one user), and a flood of scrapes made a status
snapshot each, each under the host tier's lock, which the copies take too. Here:
- one thread serves every connection through a selector; at most MAX_CONNECTIONS are open, and a
  connection past that closes the oldest (so a flood cannot keep a real scrape out for long);
- a connection has DEADLINE_S to send its request and take the answer, then it is closed;
- a request is at most MAX_REQUEST_BYTES; GET (or HEAD) of /metrics or / only (and /health
  when the daemon gave a health check: 200 or 503 and a line, no rendering, no lock), others
  get 404, 405, 400 or 431; every answer closes its connection;
- the exposition is rendered at most once per MIN_RENDER_S for each format (text, OpenMetrics:
  `format_of` says which an Accept header gets), and the scrapes in between share it: a flood
  of scrapes costs the daemon a few status snapshots a second, whatever headers they send.
"""
from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from typing import Callable

from .stop_flag import StopFlag

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64
DEADLINE_S = 5.0
MAX_REQUEST_BYTES = 8192
MIN_RENDER_S = 0.25
POLL_S = 0.2  # the loop's turn with nothing to do: deadlines (a stop wakes it: stop_flag.py)
PATHS = ("/metrics", "/")
HEALTH_PATH = "/health"

Render = Callable[[str], tuple[bytes, str]]  # Accept header -> (body, content type)
Health = Callable[[], tuple[bool, str]]  # -> (serving, why)
FormatOf = Callable[[str], str]  # Accept header -> the format it gets (what renderings are shared by)


class _Conn:
    __slots__ = ("sock", "deadline", "inbox", "out")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline
        self.inbox = bytearray()
        self.out: memoryview | None = None  # the answer, once the request is read


class MetricsServer:
    def __init__(self, addr: str, port: int, render: Render, format_of: FormatOf = str,
                 health: Health | None = None):
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(sockaddr)
            self._listener.listen(128)
        except OSError:
            self._listener.close()
            raise
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._render, self._format_of, self._health = render, format_of, health
        self._rendered: dict[str, tuple[float, bytes, str]] = {}  # format -> (when, body, type)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Conn] = {}  # oldest first
        self.counts = {"served": 0, "refused": 0, "expired": 0, "evicted": 0, "renders": 0}
        self._stop = StopFlag()
        self._sel.register(self._stop.fd, selectors.EVENT_READ)  # (its set() ends the select)
        self._thread = threading.Thread(target=self._run, name="kvcached-metrics", daemon=True)
        self._thread.start()

    # the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for key, events in self._sel.select(POLL_S):
                    if key.fileobj is self._listener:
                        self._accept()
                        continue
                    if key.fileobj == self._stop.fd:
                        continue
                    conn = self._conns.get(key.fileobj)
                    if conn is None:  # closed earlier in this turn (the oldest, past the cap)
                        continue
                    try:
                        self._write(conn) if events & selectors.EVENT_WRITE else self._read(conn)
                    except Exception:  # a bug costs that connection, not the endpoint
                        log.exception("[metrics] serving a connection failed")
                        self._close(conn)
                now = time.monotonic()
                for conn in [c for c in self._conns.values() if c.deadline < now]:
                    self.counts["expired"] += 1
                    self._close(conn)
        except Exception:  # the endpoint goes; the daemon stays
            log.exception("[metrics] the /metrics server stopped")
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            self._sel.close()
            self._listener.close()

    def _accept(self) -> None:
        for _ in range(MAX_CONNECTIONS):  # then back to the others
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the others first; a turn later, again
                log.warning("[metrics] cannot accept a connection: %s", exc)
                return
            sock.setblocking(False)
            if len(self._conns) >= MAX_CONNECTIONS:
                self.counts["evicted"] += 1
                self._close(next(iter(self._conns.values())))
            self._conns[sock] = _Conn(sock, time.monotonic() + DEADLINE_S)
            self._sel.register(sock, selectors.EVENT_READ)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.inbox += data
        end = conn.inbox.find(b"\r\n\r\n")
        if end < 0 and len(conn.inbox) <= MAX_REQUEST_BYTES:
            return
        if end < 0 or end + 4 > MAX_REQUEST_BYTES:
            status, body, ctype, head_only = "431 Request Header Fields Too Large", b"", "text/plain", False
        else:
            status, body, ctype, head_only = self._answer(bytes(conn.inbox[:end]))
        self._respond(conn, status, body, ctype, head_only)

    def _answer(self, head: bytes) -> tuple[str, bytes, str, bool]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return "400 Bad Request", b"", "text/plain", False
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", b"", "text/plain", False
        if target == HEALTH_PATH and self._health is not None:
            try:
                ok, why = self._health()
            except Exception:
                log.exception("[metrics] the health check failed")
                return "500 Internal Server Error", b"", "text/plain", False
            return ("200 OK" if ok else "503 Service Unavailable"), (why + "\n").encode(), \
                "text/plain; charset=utf-8", method == "HEAD"
        if target not in PATHS:
            return "404 Not Found", b"", "text/plain", False
        accept = ""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        try:
            body, ctype = self._exposition(accept)
        except Exception:
            log.exception("[metrics] rendering the metrics failed")
            return "500 Internal Server Error", b"", "text/plain", False
        return "200 OK", body, ctype, method == "HEAD"

    def _exposition(self, accept: str) -> tuple[bytes, str]:
        """Shared by format, not by Accept header: headers are the scraper's to vary, and a
        flood of distinct ones must not cost a rendering each."""
        now = time.monotonic()
        fmt = self._format_of(accept)
        made = self._rendered.get(fmt)
        if made is None or now - made[0] >= MIN_RENDER_S:
            body, ctype = self._render(accept)
            self.counts["renders"] += 1
            if len(self._rendered) >= 8:  # a few formats exist; bounded all the same
                self._rendered.clear()
            made = self._rendered[fmt] = (now, body, ctype)
        return made[1], made[2]

    def _respond(self, conn: _Conn, status: str, body: bytes, ctype: str, head_only: bool) -> None:
        self.counts["served" if status.startswith(("200", "503")) else "refused"] += 1
        head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode("latin-1")
        conn.out = memoryview(head if head_only else head + body)
        self._sel.modify(conn.sock, selectors.EVENT_WRITE)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.out = conn.out[sent:]
        if not conn.out:
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock, None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        if self._thread.is_alive():
            log.error("[shutdown] the /metrics server did not stop within 2 s")
        else:
            self._stop.close()
