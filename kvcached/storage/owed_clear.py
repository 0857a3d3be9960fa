"""A remote store's clear that cannot be done when it is asked for (Redis, Mooncake).

A clear must leave nothing stored before it readable after it (a weight update's old KV). A
store that is down, stuck or failing then owes the clear: the backend serves nothing while
`_clear_owed` is set (its `_usable()` says so), and its probe calls `_owed_now()` once the
store answers, marking the tier healthy only after the clear is done. Clears run one at a time,
so a request's clear is never lost to the probe's. The owed state is logged once.

A `delete` the store cannot do is owed the same way: the keys are kept, the tier serves
nothing until its probe has deleted them (past MAX_OWED_DELETES keys it owes a clear instead).

A store whose failover may lose what the old primary acknowledged (Redis behind Sentinel or in
a cluster: replication is asynchronous) keeps the deletes and clears it did in the last
REDO_WINDOW_S (`_done_lately`); at a failover (`failed_over`) they are owed again, and the tier
serves nothing until its probe has done them on the new primary: a delete or clear lost with
the old primary does not bring its blocks back. A Redis server's restart is one too, and may
undo more (`_keep_since`: since its last snapshot; redis_restarts.py).

Owed clears and deletes outlive the daemon (OwedRecord, a file in its run dir): a daemon stopped
or killed while they are owed owes them again at its next start. So does what a store whose
failover or restart may undo them keeps (`_remember`: the deletes and clears done lately, and
what the store's followers saw of it, redis_restarts.py): a failover or restart while no daemon
followed the store is seen at the next start, and what it may have undone is done again.

A backend using it sets `_clear_lock` (a Lock) and has `uri`, `last_error`, `_healthy`,
`_LOG_TAG`, `_clear_store()` and `_delete_store(keys)`: how many blocks the store removed, or
None when it could not (its failure already recorded, e.g. the tier marked down).
"""
from __future__ import annotations

import collections
import json
import logging
import os
import stat
import threading
import time

log = logging.getLogger(__name__)

MAX_OWED_DELETES = 10_000  # keys a tier keeps owed; past it, a clear
REDO_WINDOW_S = 120.0  # a failover may lose what the old primary acknowledged this lately
MAX_RECORD_BYTES = 64 << 20  # what the record is read up to; a larger one: every tier owes a clear


class OwesClears:
    _clear_owed = False
    _owed_deletes: frozenset | set = frozenset()  # keys (as stored) a delete could not remove
    _owed_said = False
    _owed_record: "OwedRecord | None" = None  # set by the tiers: the owed clears on disk
    _LOG_TAG = "storage"
    _store_id = ""
    _done_lately: "collections.deque | None" = None  # (monotonic, keys | None: a clear); set
    _done_lately_keys = 0                            # by a store whose failover may lose them

    def _owes(self) -> bool:
        return self._clear_owed or bool(self._owed_deletes)

    @property
    def store_id(self) -> str:
        """What the owed record names this store by: where it is and its prefix, not how it
        is reached (a restart with another timeout or TLS file still owes what it owed). The
        backend sets `_store_id`; the URI as status shows it otherwise."""
        return self._store_id or self.uri

    def owe_clear(self, record: "OwedRecord") -> None:
        """(At start, before any request.) Keep owed clears in record; one it holds for this
        tier (a clear a stopped daemon owed) is owed again, and done by the probe. (A record
        written by a daemon that named tiers by their URI is read too.)"""
        self._owed_record = record
        names = {self.store_id, self.uri}
        if any(record.owed(n) for n in names):
            self._clear_owed = True
            log.warning("[%s] %s: a clear owed before the restart is owed still", self._LOG_TAG,
                        self.uri)
            record.note(self.store_id, True)
        deletes = set().union(*(record.deletes(n) for n in names))
        for n in names - {self.store_id}:
            record.note(n, False)
            record.note_deletes(n, ())
        if deletes and self._clear_owed:  # the clear removes them too
            record.note_deletes(self.store_id, ())
        elif deletes:
            self._owed_deletes = set(deletes)
            record.note_deletes(self.store_id, deletes)
            log.warning("[%s] %s: %d deletes owed before the restart are owed still",
                        self._LOG_TAG, self.uri, len(deletes))
        if self._done_lately is not None:
            self._restored(record.state(self.store_id))
            self._remember()

    # what a later daemon must know of the store ---------------------------------------------
    def _remember(self) -> None:
        """Keep this store's state (`_state`) on record, taken as it is written."""
        if self._owed_record is not None and self._done_lately is not None:
            self._owed_record.note_state(self.store_id, self._state)

    def _state(self) -> dict:
        """The deletes and clears done lately, at wall-clock times (a later daemon's monotonic
        clock is another)."""
        wall = time.time() - time.monotonic()
        return {"done": [[round(at + wall, 3), None if keys is None else sorted(k.hex() for k in keys)]
                         for at, keys in list(self._done_lately or ())]}

    def _restored(self, state: dict) -> float | None:
        """(At start.) The deletes and clears the last daemon did lately, kept as if done by
        this one (at most now). Returns the oldest one's (monotonic) time, None with none."""
        now, mono = time.monotonic(), time.monotonic() - time.time()
        entries = []
        for item in state.get("done") or ():
            try:
                keys = None if item[1] is None else frozenset(bytes.fromhex(k) for k in item[1])
                entries.append((min(now, float(item[0]) + mono), keys))
            except (TypeError, ValueError, IndexError, KeyError):  # not ours to trust: a clear,
                entries.append((now, None))  # which owes everything (a change redoes it)
                log.warning("[%s] %s: a delete kept on record is not readable: taken as a clear "
                            "done now", self._LOG_TAG, self.uri)
        if not entries:
            return None
        with self._clear_lock:
            lately = sorted([*entries, *self._done_lately], key=lambda e: e[0])
            self._done_lately = collections.deque(lately)
            self._done_lately_keys = sum(len(keys or ()) for _, keys in lately)
        log.info("[%s] %s: %d deletes and clears the last daemon did are kept (a failover or restart "
                 "may undo them)", self._LOG_TAG, self.uri, len(entries))
        return lately[0][0]

    def clear(self) -> int:
        """Every block under the prefix goes now, or once the store answers again (owed)."""
        with self._clear_lock:
            self._clear_owed = True  # from here nothing stored before is read
            return self._clear_locked(self._healthy) or 0

    def delete(self, keys) -> int:
        """The keys go now, or once the store answers again (owed; the tier serves nothing
        until then). Returns how many the store removed now."""
        if not keys:
            return 0
        with self._clear_lock:
            if self._clear_owed:
                return 0  # everything goes with the owed clear
            got = self._delete_store(keys) if self._deletes_now() else None
            if got is not None:
                self._done(keys)
                return got
            owed = set(self._owed_deletes) | set(keys)
            if len(owed) > MAX_OWED_DELETES:  # too many to keep: the whole tier goes instead
                self._clear_owed = True
                self._clear_locked(False)  # the owed clear on record before the deletes go
                self._owed_deletes = frozenset()
                self._record_deletes()
                return 0
            self._owed_deletes = owed
            self._record_deletes()
            self._say_owed(f"{len(owed)} deletes are owed")
            return 0

    def delete_refused(self, n: int) -> str | None:
        """A store owing a clear takes any delete (the clear covers it), one that answers does
        it now; one that is down owes it, which past MAX_OWED_DELETES keys becomes a clear of
        every block under the prefix - that no delete request may cause (StorageFlow.delete
        refuses it: a client's large delete during an outage wiped a store other daemons
        share)."""
        with self._clear_lock:
            if (self._clear_owed or self._deletes_now()
                    or len(self._owed_deletes) + n <= MAX_OWED_DELETES):
                return None
        return (f"down, and owing more deletes than {MAX_OWED_DELETES} keys would make it owe "
                "a clear of every block it holds (other daemons' too); delete these keys once "
                "it answers again (status: healthy), or fewer at a time")

    def _deletes_now(self) -> bool:
        """Whether a delete is tried on the store now (else it is owed at once)."""
        return self._healthy

    def _owed_now(self) -> bool:
        """(The probe, the store answering.) The owed clear, then the owed deletes; False while
        any stays owed."""
        with self._clear_lock:
            if self._clear_owed and self._clear_locked(True) is None:
                return False
            if self._owed_deletes:
                if self._delete_store(list(self._owed_deletes)) is None:
                    return False
                self._done(self._owed_deletes)
                # the record first: status, which counts the set, never says fewer are owed
                # than a restart would find
                if self._owed_record is not None:
                    self._owed_record.note_deletes(self.store_id, ())
                self._owed_deletes = frozenset()
                self._owed_said = False
            return True

    def _done(self, keys) -> None:
        """(_clear_lock held.) The store did a delete of `keys`, or a clear (None): kept for
        REDO_WINDOW_S where a failover may lose it (longer where a restart may: _keep_since).
        Past MAX_OWED_DELETES keys, the oldest kept become a clear, at the time of the newest of
        them: a failover whose window holds none of them owes the newer deletes alone."""
        lately = self._done_lately
        if lately is None:
            return
        now = time.monotonic()
        while lately and lately[0][0] < self._keep_since(now):
            self._done_lately_keys -= len(lately.popleft()[1] or ())
        if keys is None:
            lately.clear()
            lately.append((now, None))
            self._done_lately_keys = 0
            self._remember()
            return
        lately.append((now, frozenset(keys)))
        self._done_lately_keys += len(keys)
        collapsed = None
        while self._done_lately_keys > MAX_OWED_DELETES:
            collapsed, gone = lately.popleft()
            self._done_lately_keys -= len(gone or ())
        if collapsed is not None:
            lately.appendleft((collapsed, None))
        self._remember()

    def _keep_since(self, now: float) -> float:
        """The oldest a done delete or clear kept may be: what a failover may undo (a store
        whose restart may undo older ones keeps them longer)."""
        return now - REDO_WINDOW_S

    def failed_over(self, why: str, since: float | None = None) -> None:
        """(The probe, a new primary found or a restart.) The deletes and clears done since
        `since` (monotonic; by default REDO_WINDOW_S ago) may be lost with the old primary: owed
        again, so the tier serves nothing until the probe has done them on the new one."""
        with self._clear_lock:
            horizon = time.monotonic() - REDO_WINDOW_S if since is None else since
            redo = [keys for at, keys in self._done_lately or () if at >= horizon]
            if not redo:
                return
            owed = set(self._owed_deletes)
            if None not in redo:
                owed.update(*redo)
            self.last_error, self._owed_said = why, False
            if None in redo or len(owed) > MAX_OWED_DELETES:
                self._clear_owed = True
                self._clear_locked(False)  # on record, said
                self._owed_deletes = frozenset()
            else:
                self._owed_deletes = owed
                self._say_owed(f"{len(owed)} deletes done or owed before the failover are owed")
            self._record_deletes()

    def _record_deletes(self) -> None:
        if self._owed_record is not None:
            self._owed_record.note_deletes(self.store_id, self._owed_deletes)

    def _say_owed(self, what: str) -> None:
        cause = self.last_error
        if " owed (" in cause:  # said before: keep its cause
            cause = cause.split(" (", 1)[1].rsplit("); the tier", 1)[0]
        self.last_error = (f"{what} ({cause or 'the store is down'}); the tier serves nothing "
                           "until the store has done it")
        if not self._owed_said:
            self._owed_said = True
            log.warning("[%s] %s: %s", self._LOG_TAG, self.uri, self.last_error)

    def _clear_locked(self, reachable: bool) -> int | None:
        got = self._clear_store() if reachable else None
        if got is not None:
            self._done(None)
            if self._owed_record is not None:  # (the record first, as for owed deletes)
                self._owed_record.note(self.store_id, False)
            self._clear_owed = self._owed_said = False
            return got
        if self._owed_record is not None:
            self._owed_record.note(self.store_id, True)
        self._say_owed("a clear is owed")
        return None


class OwedRecord:
    """Which storage tiers owe a clear or deletes, kept in `{run_dir}/{instance}.clears-owed`
    (a line per tier owing a clear: its store_id - address and prefix, no password; a line per
    owed delete: the store_id, a tab, `delete`, a tab, the stored key in hex) for as long as they
    do, so a daemon stopped or killed meanwhile owes them too when it starts again: a store that
    comes back after the restart never serves what a clear or a delete removed. And a line per
    store whose failover may undo what it did (the store_id, a tab, `state`, a tab, JSON:
    OwesClears._state). The run dir is the daemon's own (0700, checked at start); a file there
    that is no regular file of this user is not read."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._owed: set[str] = set()
        self._deletes: dict[str, set[bytes]] = {}
        self._states: dict[str, str] = {}  # store -> its state (JSON), as a later daemon reads it
        self._all_owe = False  # a record too large to read whole: every tier owes a clear
        for line in self._read():
            uri, _, state = line.partition("\tstate\t")
            if state:
                self._states[uri] = state
                continue
            uri, _, key = line.partition("\tdelete\t")
            if not key:
                self._owed.add(line)
                continue
            try:
                self._deletes.setdefault(uri, set()).add(bytes.fromhex(key))
            except ValueError:
                log.warning("[storage] %s: a line that is no owed delete skipped", self.path)

    def _read(self) -> list[str]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return []
        except OSError as exc:  # a link (ELOOP), or unreadable: not ours to trust
            log.warning("[storage] %s not read: %s", self.path, exc.strerror or exc)
            return []
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                log.warning("[storage] %s is no file of this user: not read", self.path)
                return []
            text = f.read(MAX_RECORD_BYTES + 1)
            if len(text) > MAX_RECORD_BYTES:  # not read whole: what it owes is not known
                log.warning("[storage] %s is over %d MiB: every storage tier owes a clear",
                            self.path, MAX_RECORD_BYTES >> 20)
                self._all_owe = True
                return []
            return [line for line in text.decode(errors="replace").splitlines() if line]

    def owed(self, uri: str) -> bool:
        return self._all_owe or uri in self._owed

    def state(self, uri: str) -> dict:
        """What the last daemon kept of a store (OwesClears._state); {} with none. One that is
        no state it wrote is a clear done just now: what it would have said is not known."""
        text = self._states.get(uri)
        if text is None:
            return {}
        try:
            state = json.loads(text)
            if isinstance(state, dict):
                return state
        except ValueError:
            pass
        log.warning("[storage] %s: the state kept of %s is not readable: taken as a clear done lately",
                    self.path, uri)
        return {"done": [[time.time(), None]]}

    def note_state(self, uri: str, state) -> None:
        """Record a store's state, `state()` taken under the record's lock (the last taken is
        the last written), on disk before this returns."""
        with self._lock:
            text = json.dumps(state(), separators=(",", ":"), sort_keys=True)
            if self._states.get(uri) == text:
                return
            self._states[uri] = text
            self._write()

    def deletes(self, uri: str) -> set[bytes]:
        return set(self._deletes.get(uri, ()))

    def note(self, uri: str, owed: bool) -> None:
        """Record (or drop) a tier's owed clear, on disk before this returns."""
        with self._lock:
            if (uri in self._owed) == owed:
                return
            (self._owed.add if owed else self._owed.discard)(uri)
            self._write()

    def note_deletes(self, uri: str, keys) -> None:
        """Record a tier's owed deletes (all of them; none: dropped), on disk before this
        returns."""
        with self._lock:
            if set(keys) == self._deletes.get(uri, set()):
                return
            if keys:
                self._deletes[uri] = set(keys)
            else:
                self._deletes.pop(uri, None)
            self._write()

    def _write(self) -> None:
        lines = [f"{u}\n" for u in sorted(self._owed)]
        lines += [f"{u}\tdelete\t{k.hex()}\n" for u, keys in sorted(self._deletes.items())
                  for k in sorted(keys)]
        lines += [f"{u}\tstate\t{text}\n" for u, text in sorted(self._states.items())]
        try:
            if not lines:
                os.unlink(self.path)
                return
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                f.write("".join(lines))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except FileNotFoundError:
            pass  # nothing owed and no file
        except OSError as exc:  # still owed in this run; a restart may forget it
            log.warning("[storage] cannot record the owed clears and deletes in %s: %s",
                        self.path, exc.strerror or exc)
