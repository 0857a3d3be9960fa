"""Reattaching to a daemon in the background, so that the engine's thread never waits for one.

The engine-side pieces (GroupClient's ranks, PrefixCacheManager, the vLLM connector) hold a
Reattacher while they have no daemon: `take()` answers at once, with a connection that a
background thread has made ready (connected, and prepared: e.g. the KV cache registered) or
with None, and the engine goes on without the daemon (a miss, a skipped save). Attempts run
every `every_s` while someone wants a connection; one that fails is tried again later, however
it failed (no daemon, a hung one, a refused registration).

`watch(current)` keeps the thread for good: every `every_s` it looks at the owner's connection
(`current()`) and, when there is none or its daemon is gone or hung, prepares one,
so a daemon that died or restarted between two engine calls is attached again before the next
one instead of at the one after.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Generic, TypeVar

from kvcached_proto.errors import Busy, KvcachedError, RequestError

from .run_dir_hint import WrongRunDir

log = logging.getLogger(__name__)

REATTACH_EVERY_S = 0.25
REFUSED_BACKOFF_MAX_S = 2.0  # a daemon that is up but refuses the preparation is asked less often

T = TypeVar("T")


class Reattacher(Generic[T]):
    def __init__(self, connect: Callable[[], T], prepare: Callable[[T], None] | None = None,
                 every_s: float = REATTACH_EVERY_S, name: str = "kvcached"):
        self._connect = connect
        self._prepare = prepare
        self.every_s = every_s
        self.name = name
        self._lock = threading.Lock()      # guards _ready, _thread, _closed
        self._attempt = threading.Lock()   # one attempt at a time (background or attach_now)
        self._ready: T | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self._current: Callable[[], T | None] | None = None
        self._refusals = 0  # preparations refused in a row (the daemon answered: do not hammer it)
        self.last_error = ""
        self.attempts = 0

    def take(self) -> T | None:
        """A prepared connection if one is ready (it is the caller's from now on), else None at
        once; in that case attempts go on in the background."""
        with self._lock:
            ready, self._ready = self._ready, None
            if ready is None:
                self._start()
        return ready

    def watch(self, current: Callable[[], T | None]) -> None:
        """Until close(), attempt whenever current() (the owner's connection) is None or not
        usable (checked every every_s)."""
        with self._lock:
            self._current = current
            self._start()

    def _start(self) -> None:  # under _lock
        if not self._closed and (self._thread is None or not self._thread.is_alive()):
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"{self.name}-reattach")
            self._thread.start()

    def attach_now(self) -> T | None:
        """One attempt on the calling thread (at set-up, or when the caller asks explicitly);
        takes a connection the background made ready first. None when it failed."""
        got = self.take_ready()
        if got is not None:
            return got
        with self._attempt:
            got = self.take_ready()  # the background may have finished while we waited
            return got if got is not None else self._try()

    def has_ready(self) -> bool:
        """A connection is ready to be taken (the owner's may be replaced by it now)."""
        return self._ready is not None

    def take_ready(self) -> T | None:
        with self._lock:
            ready, self._ready = self._ready, None
        return ready

    def _try(self) -> T | None:
        self.attempts += 1
        try:
            conn = self._connect()
        except KvcachedError as exc:
            self._failed(exc)
            return None
        except Exception as exc:  # an OS or socket error: still no daemon, and the thread lives
            self._failed(RuntimeError(f"{type(exc).__name__}: {exc}"))
            return None
        try:
            if self._prepare is not None:
                self._prepare(conn)
        except Exception as exc:  # a refused registration, a daemon that died meanwhile, ...
            _close(conn)
            self._failed(exc, refused=isinstance(exc, RequestError) and not isinstance(exc, Busy))
            self._refusals += 1
            return None
        self.last_error = ""
        self._refusals = 0
        return conn

    def _failed(self, exc: Exception, refused: bool = False) -> None:
        """refused: the daemon answered the preparation with an error (e.g. a KV layout it will
        not register): no cache until that changes, which an operator must hear of."""
        msg = str(exc)
        if msg != self.last_error and isinstance(exc, WrongRunDir):  # zero hits until fixed
            log.warning("[%s] %s", self.name, msg)
        elif msg != self.last_error and refused:  # say each new reason once, not every attempt
            log.warning("[%s] the daemon is up but refused this engine, which goes on without "
                        "it (asked again every %.0f s): %s", self.name, REFUSED_BACKOFF_MAX_S, msg)
        elif msg != self.last_error:
            log.info("[%s] no daemon to attach to yet: %s", self.name, msg)
        self.last_error = msg

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._attempt:
                with self._lock:
                    if self._closed:
                        return
                    have_ready, current = self._ready is not None, self._current
                if current is None and have_ready:
                    return  # asked by take() alone: done once a connection is ready
                want = not have_ready
                if current is not None:
                    want = self._still_needed(current)
                    if not want and have_ready:  # the owner's connection is fine after all
                        _close(self.take_ready())
                if want and not have_ready:
                    conn = self._try()
                    if conn is not None:
                        with self._lock:
                            keep = not self._closed
                            if keep:
                                self._ready = conn
                        if not keep:
                            _close(conn)
                            return
                        if current is None:
                            return
            self._stop.wait(min(self.every_s * 2 ** self._refusals,
                                max(self.every_s, REFUSED_BACKOFF_MAX_S)))

    @staticmethod
    def _still_needed(current: Callable[[], T | None]) -> bool:
        try:
            conn = current()
            return conn is None or not usable(conn)
        except Exception:  # the owner's connection is half closed: it is of no use
            return True

    def close(self) -> None:
        """Stop attempting; a connection made ready and never taken is closed."""
        with self._lock:
            self._closed = True
            ready, self._ready = self._ready, None
            thread = self._thread
        self._stop.set()
        if ready is not None:
            _close(ready)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10.0)


def usable(conn) -> bool:
    """conn.alive() (its daemon up and beating); a connection without alive() - a GroupClient,
    which reattaches its ranks itself - counts as usable."""
    alive = getattr(conn, "alive", None)
    return alive() if alive is not None else True


def _close(conn) -> None:
    try:
        conn.close()
    except Exception as exc:  # closing a half-made connection must not raise over the cause
        log.debug("closing a connection that was not taken: %s", str(exc))


def reconnector(client) -> Callable[[], object]:
    """Connect again the way `client` was connected (after the daemon comes back)."""
    kind = type(client)
    if hasattr(client, "reconnect_args"):
        return lambda: kind.connect(**client.reconnect_args())
    return lambda: kind.connect(instance=client.instance, run_dir=client.run_dir,
                                timeout=client.timeout, name=client.name,
                                hang_s=getattr(client, "hang_s", None))
