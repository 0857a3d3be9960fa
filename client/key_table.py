"""Lookups from the daemon's key table in shared memory (layout: kvcached_proto.key_table), with
no message: the whole lookup is one C call (kvcached_proto._keytable.answer: the daemon's
liveness in its status block and pidfd, the keys joined, the probe, the table's flags), a 64-key
lookup a few microseconds.

`KeyTableReader.lookup` answers (host, storage, packed keys) or None, and None means "ask the
daemon" (the lookup op): no table yet (nothing registered, or the extension is not built), a
daemon that is not up, silent past the hang threshold or exited, a table of another daemon or
one the daemon closed, a slot the daemon held too long, or a question the table cannot answer -
a miss where it could not take every host key, or a storage run that needs a tier it does not
cover (Redis) or one that does not answer now. The answer is what the daemon's index held as
each key was read; a hit pins nothing (a block evicted before its load is a load that plans
fewer blocks, as after a lookup op).

`LookupNotes` carries what the local lookups saw to the daemon in batches, without waiting for
a reply: its eviction policy's history, recency and hit counters stay as if it had answered.
The client sends them before its next request of another kind, from a lookup once they are due,
or from its notes thread once they are NOTE_DELAY_S old (a client that asks nothing more).
"""
from __future__ import annotations

import array
import logging
import mmap
import os
import threading
import time

import zmq

import posix_ipc

from kvcached_proto import KvcachedError, Op, encode_request
from kvcached_proto.key_table import HEADER_BYTES, MAX_NOTED_KEYS, MAX_NOTED_LOOKUPS, Flags, native, segment_name

log = logging.getLogger(__name__)

RETRY_S = 0.5  # no table yet: look again at most this often
# A note message goes when its first lookup is NOTE_DELAY_S old, or before the client's next
# request of any other kind (an engine sends some every step), or when it grew large: sending
# costs tens of microseconds (encoding, waking the socket's I/O thread), paid by the lookup that
# sends it, so it is sent rarely - a scheduler asking for its waiting requests every step sends
# one message per 50 ms, holding each distinct lookup once with how often it was asked.
NOTE_DELAY_S = 0.05
NOTE_BATCH = MAX_NOTED_LOOKUPS  # distinct lookups (1,024)
NOTE_KEYS = MAX_NOTED_KEYS  # keys of the distinct lookups (32,768: half a MiB of frame)
NOTE_LOOKUPS = 1 << 20  # lookups, repeats included
_OPEN = int(Flags.OPEN)  # a plain int: `int & IntFlag` makes an enum member, a microsecond
NOTES_AT_CLOSE_S = 0.1  # close() waits this long at most for the daemon to take the last notes
# (short: an engine shutting down has more to do before it is killed, e.g. vLLM's worker)


class KeyTableReader:
    def __init__(self, instance: str, epoch: int, status):
        self.name = segment_name(os.getuid(), instance)
        self.epoch = epoch
        self._status = status  # the client's StatusReader: the daemon's liveness, read in C too
        self._hang_ns = int(status.hang_s * 1e9)
        self._kt = native()
        self._mm: mmap.mmap | None = None
        self._next_try = 0.0
        self.answered = 0  # lookups answered here
        self.asked = 0  # lookups it left to the daemon (no table, or one that could not answer)

    @property
    def available(self) -> bool:
        return self._kt is not None

    def lookup(self, keys) -> tuple[int, int, bytes] | None:
        """(host, storage, the keys packed) from the table, or None: send the lookup op."""
        mm = self._mm if self._mm is not None else self._open()
        status = self._status._mm
        if mm is None or status is None:
            self.asked += 1
            return None
        got = self._kt.answer(mm, keys, self.epoch, status, self._hang_ns, self._status.pidfd)
        if got is None:
            self.asked += 1
            if not self._kt.flags(mm) & _OPEN:  # closed: a new table (geometry) or a stopped daemon
                self.close()
            return None
        self.answered += 1
        return got

    def _open(self) -> mmap.mmap | None:
        now = time.monotonic()
        if self._kt is None or now < self._next_try:
            return None
        self._next_try = now + RETRY_S
        try:
            shm = posix_ipc.SharedMemory(self.name, flags=0)
        except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
            return None
        try:
            st = os.fstat(shm.fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077 or shm.size < HEADER_BYTES:
                return None  # not the daemon's (it makes its table 0600, as this user)
            mm = mmap.mmap(shm.fd, shm.size, prot=mmap.PROT_READ)
        finally:
            shm.close_fd()
        try:
            self._kt.count(mm)  # checks the header
        except ValueError:
            mm.close()
            return None
        self._mm = mm
        return mm

    def close(self) -> None:
        """Drop the mapping; the next lookup opens the table anew (a registration made one)."""
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        self._next_try = 0.0


class LookupNotes:
    """The local lookups not yet told to the daemon, one entry per distinct lookup (a scheduler
    asks again for each waiting request every step): its keys, how many times it was asked,
    and the storage hits answered. Safe across threads (the client's notes thread takes them)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.pending: dict[bytes, list[int]] = {}  # packed keys -> [times asked, storage hits]
        self.lookups = 0
        self.nkeys = 0
        self.since = 0.0
        self.dropped = 0  # lookups whose notes were dropped (socket full, or past one message)

    def due(self) -> bool:
        return bool(self.pending) and time.monotonic() - self.since >= NOTE_DELAY_S

    def add(self, packed: bytes, storage: int) -> bool:
        """Note one lookup; True when the batch should go now."""
        with self._lock:
            entry = self.pending.get(packed)
            if entry is not None:
                entry[0] += 1
                entry[1] += storage
            elif len(self.pending) >= NOTE_BATCH or self.nkeys + len(packed) // 16 > NOTE_KEYS:
                self.dropped += 1  # (kept while the socket is busy: what one message may carry,
                #                     the daemon refuses more)
                return True
            else:
                if not self.pending:
                    self.since = time.monotonic()
                self.pending[packed] = [1, storage]
                self.nkeys += len(packed) // 16
            self.lookups += 1
            return (len(self.pending) >= NOTE_BATCH or self.lookups >= NOTE_LOOKUPS
                    or self.nkeys >= NOTE_KEYS or time.monotonic() - self.since >= NOTE_DELAY_S)

    def take(self) -> tuple[bytes, list[int], list[int], int] | None:
        """(keys back to back, keys per lookup, times each was asked, storage hits), or None."""
        with self._lock:
            if not self.pending:
                return None
            pending, self.pending, self.lookups, self.nkeys = self.pending, {}, 0, 0
        return (b"".join(pending), [len(k) // 16 for k in pending], [v[0] for v in pending.values()],
                sum(v[1] for v in pending.values()))

    def take_dropped(self) -> int:
        with self._lock:
            dropped, self.dropped = self.dropped, 0
        return dropped

    def drop(self, n: int) -> None:
        with self._lock:
            self.dropped += n


class SendsNotes:
    """Client's half that sends the notes (a mixin: it uses the client's socket, lock, request
    ids and replies to discard)."""

    def _notes_fields(self) -> dict | None:
        """The pending notes as lookup_notes' fields (taken), or None; `lookups` is how many
        lookups they count (not sent)."""
        taken = self._notes.take()
        if taken is None:
            return None
        keys, counts, repeats, storage = taken
        unnoted = self._notes.take_dropped()
        return {"keys": keys, "counts": array.array("i", counts).tobytes(),
                "repeats": array.array("i", repeats).tobytes(), "storage_hits": storage,
                "unnoted": unnoted, "lookups": sum(repeats)}

    def _notes_at_close(self) -> None:
        fields = self._notes_fields()
        if fields is None:
            return
        fields.pop("lookups")
        try:
            self._request(Op.LOOKUP_NOTES, NOTES_AT_CLOSE_S, **fields)
        except KvcachedError:  # the daemon is gone or slow: its counters miss them, nothing else
            return

    def _start_notes_thread(self) -> None:
        """A thread that sends the notes a client left pending once they are NOTE_DELAY_S old
        (a scheduler may ask nothing more for a while: the daemon's counters and policy must
        not wait for its next call). It runs Python only when there is something to send."""
        def run() -> None:
            try:
                while not self._notes_stop.wait(NOTE_DELAY_S):
                    if self._notes.due():
                        self._send_notes()
            except Exception:  # a bug here must be seen; lookups go on (notes then go with requests)
                log.exception("[lookup] the notes thread of %s stopped", self.client_id)

        self._notes_thread = threading.Thread(target=run, name=f"kvcached-notes-{self.client_id}",
                                              daemon=True)
        self._notes_thread.start()

    def _send_notes(self) -> None:
        """Send what the local lookups saw without waiting for a reply (dropped when the socket
        is busy or full: it feeds statistics and the eviction policy, nothing waits on it)."""
        sock = self._sock
        if sock is None or not self._lock.acquire(blocking=False):
            return
        try:
            fields = self._notes_fields()
            if fields is None:
                return
            rid, lookups = next(self._rid), fields.pop("lookups")
            try:
                sock.send(encode_request(Op.LOOKUP_NOTES, rid, self.client_id, **fields), zmq.NOBLOCK)
            except zmq.ZMQError:
                self._notes.drop(fields["unnoted"] + lookups)
                return
            if len(self._discard) > 4096:  # a daemon that stopped answering: forget the oldest
                self._discard.clear()
            self._discard.add(rid)
        finally:
            self._lock.release()
