"""The Mooncake Store tier (optional extra `kvcached-sidecar[mooncake]`): the distributed KV-cache
store of kvcache-ai/Mooncake - a master that places objects, clients that each contribute a
memory segment, a transfer engine that moves the bytes over TCP or RDMA.

    mooncake://MASTER_HOST:PORT[?metadata=P2PHANDSHAKE&protocol=tcp&device=&host=LOCAL_HOST
                                &segment_gb=1&buffer_mb=64&prefix=kvcached/&io_timeout_s=0.5]

- `metadata`: the transfer engine's metadata service, `P2PHANDSHAKE` (default: none, clients
  exchange it directly) or e.g. `http://host:8080/metadata`; `protocol` tcp (default) or rdma,
  `device` the RDMA device(s); `host` the address other clients reach this daemon's segment at
  (default: the local address that routes to the master).
- `segment_gb`: the memory this daemon contributes to the store (objects live in some client's
  segment: a daemon that stops takes the objects in its segment with it); 0 contributes none
  and relies on other clients (`mooncake_client` processes, other daemons). Said at start.
- Zero copy: the host pool is registered with the store once (`register_memory`), and backups
  and fetches move each page straight between its pieces and the store in one call per batch
  (`batch_put_from_multi_buffers` / `batch_get_into_multi_buffers`); the record header
  (record.py: the stored key, the size, a checksum, the geometry) travels as the first buffer
  of each object, from a registered arena of header slots. A page kept in more than 2 pieces
  (the layer_first host layout) is copied behind its header into a registered staging slot and
  moves as one buffer (Mooncake moves 64 buffers at half the speed of 2). A record whose header or checksum
  does not match is a miss and is removed, never served. Lookups are one `batch_is_exist` call.
- Outages: every call into the store runs on the tier's I/O threads with a deadline
  (`io_timeout_s`, 0.5 s): a master that stops answering (the client's own RPC timeout is 30 s)
  costs a lookup or a load at most that long, and the tier is then `stuck` - unhealthy, no hits,
  puts dropped - until the late call returned. A call that fails (the master gone: RPC_FAIL)
  marks it unhealthy; a probe (one `batch_is_exist` every PROBE_EVERY_S, also while the daemon
  is idle) marks it healthy again. A master restarted empty loses what it placed: misses.
  A clear the store cannot do then (down, stuck, failed) is owed: the tier stays unhealthy
  until the probe finds it answering and the clear is done, so what was stored before a clear
  (a weight update's old KV, a late put) is never read after it.
- Connecting: Mooncake's `setup` holds the GIL while it waits for the master, and waits for
  ever when there is none (it retries every few seconds): called in the daemon against a master
  that is down, it would freeze the whole daemon. So the tier's thread first has a child process
  try the same setup with a deadline (SETUP_PROBE_S), and calls setup itself only once that
  child connected; until then the tier is down and the thread tries again every RECONNECT_S.
  The daemon does not wait for it at start: the tier is `ready` after the first try.
"""
from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Sequence

from .base import StorageBackend, prefix_walk
from .iothreads import IOThreads, run_bounded
from .mooncake_buffers import HeaderArena, Staging, pointer
from .owed_clear import OwesClears
from .record import HEADER_BYTES, BadRecord, check_header, check_payload, gather, nbytes, pack_header, scatter
from .uris import MOONCAKE_IO_TIMEOUT_S, parse_mooncake_uri as parse_uri, redact

log = logging.getLogger(__name__)

PROBE_EVERY_S = 0.5
SETUP_PROBE_S = 5.0  # a child's setup against the master, before the daemon's own
RECONNECT_S = 2.0
_SETUP_PROBE = ("import sys\n"
                "from mooncake.store import MooncakeDistributedStore\n"
                "host, metadata, protocol, device, master = sys.argv[1:6]\n"
                "rc = MooncakeDistributedStore().setup(host, metadata, 0, 1 << 20, protocol, device, master)\n"
                "sys.exit(0 if rc == 0 else 3)\n")
IO_TIMEOUT_S = MOONCAKE_IO_TIMEOUT_S
PUT_TIMEOUT_S = 5.0  # backups wait longer (their pages stay on loan meanwhile)
IO_THREADS = 2
BATCH = 256  # keys per store call
PUT_SLICE = 8  # pages per put call: the next slice's checksums overlap this one's transfer
STAGE_SLOTS = 2 * IO_THREADS * PUT_SLICE  # staged pages in flight at most (Staging)
RPC_ERRORS = (-900, -901, -902)  # the master could not be reached: an outage, not a refusal
NOT_FOUND = -704


class MooncakeBackend(OwesClears, StorageBackend):
    _LOG_TAG = "mooncake"

    def __init__(self, uri: str, on_ready: Callable[[], None] | None = None):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError:
            raise ValueError(f"{uri!r}: the mooncake tier needs Mooncake's Python package: pip install "
                             "'kvcached-sidecar[mooncake]' (and Debian's libibverbs1)") from None
        self._store_class = MooncakeDistributedStore
        opts = parse_uri(uri)
        self.uri = redact(uri)
        self.opts = opts
        self.prefix = opts["prefix"]
        self._store_id = f"mooncake://{opts['master']}?prefix={self.prefix}"  # (owed_clear.py)
        self.io_timeout_s, self.lookup_keys = opts["io_timeout_s"], opts["lookup_keys"]
        self.segment_bytes = opts["segment_bytes"]
        self.counters = {"puts": 0, "gets": 0, "dropped_puts": 0, "errors": 0, "corrupt": 0,
                         "put_errors": 0, "late_io": 0, "unregistered": 0, "lookups_cut": 0}
        self.last_error = ""
        self._store = None
        self._lock = threading.Lock()
        self._healthy = False
        self._late = 0  # calls past their deadline that have not returned
        self._clear_lock = threading.Lock()  # owed_clear.py: a clear the store has not done
        self._regions: list[tuple[int, int]] = []  # registered (ptr, size)
        self._pending_regions: list[tuple[int, int]] = []  # to register once connected
        self._headers = HeaderArena()
        self._staging: Staging | None = None
        self._staging_lock = threading.Lock()
        self._io = IOThreads(IO_THREADS, "kvcached-mooncake")
        self._closed = threading.Event()
        self._connect_said = False
        self._tried = threading.Event()  # the first connection attempt is over
        self._on_ready = on_ready
        self._prober = threading.Thread(target=self._probe, name="kvcached-mooncake-probe", daemon=True)
        self._prober.start()

    def ready(self) -> bool:
        return self._tried.is_set()

    # connection and health -----------------------------------------------------------------
    def _master_answers(self) -> str:
        """'' when a child process's setup against the master succeeded within SETUP_PROBE_S,
        else why not."""
        o = self.opts
        try:
            done = subprocess.run([sys.executable, "-c", _SETUP_PROBE, o["host"], o["metadata"],
                                   o["protocol"], o["device"], o["master"]],
                                  capture_output=True, timeout=SETUP_PROBE_S)
        except subprocess.TimeoutExpired:
            return f"the master at {o['master']} did not answer within {SETUP_PROBE_S:g} s"
        except OSError as exc:
            return f"cannot run the setup probe: {exc}"
        if done.returncode != 0:
            return f"a setup against the master at {o['master']} failed (exit {done.returncode})"
        return ""

    def _connect(self) -> None:
        """On the tier's thread: setup() once a child's setup showed the master answers."""
        o = self.opts
        why = self._master_answers()
        if why:
            self.last_error = why
            if not self._connect_said:
                self._connect_said = True
                log.warning("[mooncake] %s: %s; the tier is down until it answers", self.uri, why)
            return
        store = self._store_class()
        rc = store.setup(o["host"], o["metadata"], self.segment_bytes, o["buffer_bytes"],
                         o["protocol"], o["device"], o["master"])
        if rc != 0:
            self.last_error = f"setup against the master at {o['master']} returned {rc}"
            log.warning("[mooncake] %s: %s", self.uri, self.last_error)
            return
        with self._lock:
            self._store = store
            regions, self._pending_regions = self._pending_regions, []
        if store.register_buffer(self._headers.base, self._headers.buf.nbytes) != 0:
            log.warning("[mooncake] %s: cannot register the header arena", self.uri)
            return
        for ptr, size in regions:
            self._register(ptr, size)
        self._healthy = True
        log.info("[mooncake] %s: connected to the master %s as %s (%s), contributing a %.2f GiB "
                 "segment", self.uri, o["master"], o["host"], o["protocol"], self.segment_bytes / 2**30)

    def register_memory(self, ptr: int, size: int) -> None:
        """The host pool: its pages move to and from the store without a copy."""
        with self._lock:
            store = self._store
            if store is None:
                self._pending_regions.append((ptr, size))
                return
        self._register(ptr, size)

    def _register(self, ptr: int, size: int) -> None:
        rc = self._store.register_buffer(ptr, size)
        if rc != 0:
            log.warning("[mooncake] %s: cannot register %.2f GiB of host memory (%d): its pages "
                        "are not stored here", self.uri, size / 2**30, rc)
            return
        self._regions.append((ptr, size))

    def _registered(self, ptr: int, n: int) -> bool:
        return any(base <= ptr and ptr + n <= base + size for base, size in self._regions)

    def _probe(self) -> None:
        try:
            self._connect()
        finally:
            self._tried.set()
            if self._on_ready is not None:
                self._on_ready()
        while not self._closed.wait(PROBE_EVERY_S):
            if self._store is None:
                if not self._closed.wait(RECONNECT_S):
                    self._connect()
                continue
            if self._late:
                continue  # stuck: a call has not returned; it decides
            try:
                got = run_bounded(self._io, self._store.batch_is_exist, [([self.prefix + "probe"],)],
                                  self.io_timeout_s, self._late_op("a probe"),
                                  lambda _i: self._late_returned())[0]
                if got is None:
                    continue
                if got and got[0] in RPC_ERRORS:
                    self._failed(f"the master does not answer ({got[0]})")
                    continue
                if self._owes() and not self._owed_now():
                    continue  # down until its owed clear and deletes are done
            except Exception as exc:  # (the store's binding raising): down, the probe goes on
                self._failed(f"the probe failed: {exc!r}")
                continue
            if not self._healthy:
                self._healthy = True
                log.info("[mooncake] %s healthy again", self.uri)

    def _failed(self, why: str) -> None:
        self.counters["errors"] += 1
        self.last_error = why
        if self._healthy:
            log.warning("[mooncake] %s unhealthy: %s", self.uri, why)
        self._healthy = False

    def _late_op(self, what: str):
        def on_late(_i: int) -> None:
            with self._lock:
                self._late += 1
            self.counters["late_io"] += 1
            self._failed(f"{what} has not returned in {self.io_timeout_s:g} s (a master that "
                         "stopped answering?); the tier is stuck until it does")
        return on_late

    def _late_returned(self) -> None:
        with self._lock:
            self._late -= 1

    def _usable(self) -> bool:
        return self._store is not None and self._healthy and not self._late and not self._owes()

    def health(self) -> bool:
        return self._usable()

    def _call(self, fn, args: tuple, timeout: float, what: str, on_done=None):
        """fn(*args) on an I/O thread; None when it is late (then on_done() runs when it returns)."""
        def returned(_i: int) -> None:
            self._late_returned()
            if on_done is not None:
                on_done()
        return run_bounded(self._io, fn, [args], timeout, self._late_op(what), returned)[0]

    def _name(self, key: bytes) -> str:
        return self.prefix + key.hex()

    # interface ------------------------------------------------------------------------------
    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        if not keys or not self._usable():
            return 0
        return prefix_walk(keys, BATCH, self._present) or 0

    def _present(self, part: Sequence[bytes]) -> int | None:
        got = self._call(self._store.batch_is_exist, ([self._name(k) for k in part],),
                         self.io_timeout_s, "a lookup")
        if got is not None and any(r in RPC_ERRORS for r in got):
            self._failed(f"a lookup failed ({min(got)})")
            return None
        return None if got is None else next((i for i, r in enumerate(got) if r != 1), len(got))

    def _batch(self, keys, buffers, part, slots, header=None) -> tuple[list, list, list, list]:
        """(names, buffer pointers, sizes, [(i, slot, staged)]) of the keys of `part` that can
        move: a page in 2 pieces or fewer as its header slot and its pieces (in registered
        memory), a page in more as one staging slot holding header and page (staged: (staging,
        slot)). header(i), when given, is written first (a put; for a staged page, its pieces
        are copied behind it)."""
        names, ptrs, sizes, idx = [], [], [], []
        for slot, i in zip(slots, part):
            staged = self._stage(buffers[i])
            if staged is not None:
                staging, sslot = staged
                if header is not None:
                    view = staging.view(sslot)
                    view[:HEADER_BYTES] = header(i)
                    gather(buffers[i], view[HEADER_BYTES:])
                bufs = [staging.ptr(sslot)], [staging.slot_bytes]
            else:
                bufs = self._buffers(buffers[i], slot)
                if bufs is None:
                    self.counters["unregistered"] += 1
                    continue
                if header is not None:
                    self._headers.view(slot)[:] = header(i)
            names.append(self._name(keys[i]))
            ptrs.append(bufs[0])
            sizes.append(bufs[1])
            idx.append((i, slot, staged))
        return names, ptrs, sizes, idx

    def _stage(self, pieces) -> tuple[Staging, int] | None:
        """A staging slot for a page of more than 2 pieces, or None (few pieces, none free)."""
        if len(pieces) <= 2:
            return None
        page = nbytes(pieces)
        with self._staging_lock:
            staging = self._staging
            if staging is None or staging.page_bytes != page:
                if staging is not None and not staging.idle():
                    return None  # another geometry's pages still move: this one as pieces
                if staging is not None:
                    staging.close()
                staging = self._staging = Staging(self._store, page, STAGE_SLOTS)
            if not staging.ok:
                return None
        sslot = staging.take()
        return None if sslot is None else (staging, sslot)

    def _give(self, slots, idx) -> None:
        """The header and staging slots of a batch, back."""
        for _i, _slot, staged in idx:
            if staged is not None:
                staged[0].give(staged[1])
        self._headers.give(slots)

    def _buffers(self, pieces, slot: int) -> tuple[list[int], list[int]] | None:
        ptrs, sizes = [self._headers.ptr(slot)], [HEADER_BYTES]
        for piece in pieces:
            ptr, n = pointer(piece)
            if not self._registered(ptr, n):
                return None
            ptrs.append(ptr)
            sizes.append(n)
        return ptrs, sizes

    def get_into(self, keys, buffers, geometry, release=None) -> list:
        out: list = [False] * len(keys)
        if not keys or not self._usable():
            return out
        for start in range(0, len(keys), BATCH):
            part = range(start, min(len(keys), start + BATCH))
            self._get_part(keys, buffers, geometry, part, out, release)
        return out

    def _get_part(self, keys, buffers, geometry, part, out, release) -> None:
        slots = self._headers.take(len(part), self.io_timeout_s)
        if slots is None:
            return  # misses
        names, ptrs, sizes, idx = self._batch(keys, buffers, part, slots)
        if not names:
            self._give(slots, idx)
            return

        def returned() -> None:  # a late read: its pages were on loan until now
            self._give(slots, idx)
            if release is not None:
                for i, _slot, _staged in idx:
                    release(i)

        got = self._call(self._store.batch_get_into_multi_buffers, (names, ptrs, sizes),
                         self.io_timeout_s, "a block read", returned)
        if got is None:
            for i, _slot, _staged in idx:
                out[i] = None
            return
        try:
            bad = []
            for (i, slot, staged), r in zip(idx, got):
                if r in RPC_ERRORS:
                    self._failed(f"a read failed ({r})")
                    continue
                if r == NOT_FOUND or (r < 0 and r != -600):
                    continue
                try:
                    want = nbytes(buffers[i])
                    if r != HEADER_BYTES + want:
                        raise BadRecord(f"{r} bytes stored, {HEADER_BYTES + want} expected"
                                        if r >= 0 else "a record larger than this geometry's page")
                    if staged is not None:
                        view = staged[0].view(staged[1])
                        crc = check_header(bytes(view[:HEADER_BYTES]), keys[i], want, geometry)
                        scatter(view[HEADER_BYTES:], buffers[i])
                    else:
                        crc = check_header(bytes(self._headers.view(slot)), keys[i], want, geometry)
                    check_payload(buffers[i], crc)
                except BadRecord as exc:
                    log.warning("[mooncake] %s: %s; removed", keys[i].hex(), exc)
                    self.counters["corrupt"] += 1
                    bad.append(self._name(keys[i]))
                    continue
                out[i] = True
                self.counters["gets"] += 1
            if bad:
                self._call(self._store.batch_remove, (bad, True), self.io_timeout_s, "a removal")
        finally:
            self._give(slots, idx)

    def put(self, keys, buffers, geometry, release=None) -> list:
        """Slices of PUT_SLICE pages go to the I/O threads as soon as their headers are packed,
        so the checksums of the next slice are computed while the last one moves."""
        out: list = [False] * len(keys)
        if not keys:
            return out
        if not self._usable():
            self.counters["dropped_puts"] += len(keys)
            return out
        for start in range(0, len(keys), BATCH):
            window = []
            for s in range(start, min(len(keys), start + BATCH), PUT_SLICE):
                part = range(s, min(len(keys), start + BATCH, s + PUT_SLICE))
                slots = self._headers.take(len(part), self.io_timeout_s)
                if slots is None:
                    self.counters["dropped_puts"] += len(part)
                    continue
                names, ptrs, sizes, idx = self._batch(keys, buffers, part, slots,
                                                      lambda i: pack_header(keys[i], buffers[i], geometry))
                if not names:
                    self._give(slots, idx)
                    continue
                future = self._io.submit(self._store.batch_put_from_multi_buffers, names, ptrs, sizes)
                window.append((future, slots, idx))
            deadline = time.monotonic() + PUT_TIMEOUT_S
            for future, slots, idx in window:
                self._put_done(future, slots, idx, deadline, out, release)
        return out

    def _put_done(self, future, slots, idx, deadline, out, release) -> None:
        try:
            got = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:  # late: the pages stay on loan until the write returns
            self._late_op("a block write")(0)
            for i, _slot, _staged in idx:
                out[i] = None

            def returned(_future=None) -> None:
                self._late_returned()
                self._give(slots, idx)
                if release is not None:
                    for i, _slot, _staged in idx:
                        release(i)
            if future.cancel():
                returned()
            else:
                future.add_done_callback(returned)
            return
        except Exception as exc:  # the binding refused the call: those puts failed
            self._give(slots, idx)
            self.counters["put_errors"] += len(idx)
            self.last_error = f"put failed: {exc}"
            return
        self._give(slots, idx)
        for (i, _slot, _staged), r in zip(idx, got):
            if r == 0:
                out[i] = True
                self.counters["puts"] += 1
            elif r in RPC_ERRORS:
                self._failed(f"a write failed ({r})")
                self.counters["dropped_puts"] += 1
            else:  # refused (no room in any segment, ...): that put only
                self.counters["put_errors"] += 1
                self.last_error = f"put refused ({r})"

    def _deletes_now(self) -> bool:  # (owed_clear.py) not while a late call holds the store
        return self._healthy and self._store is not None and not self._late

    def _delete_store(self, keys) -> int | None:
        """(owed_clear.py) The keys removed: how many were there; None when the store is not
        there, stuck, or the call failed or was late."""
        if self._store is None or self._late:
            return None
        got = self._call(self._store.batch_remove, ([self._name(k) for k in keys], True),
                         self.io_timeout_s, "a removal")
        if got is None or any(r in RPC_ERRORS for r in got):
            if got is not None:
                self._failed("a removal failed (the master does not answer)")
            return None
        return sum(1 for r in got if r == 0)

    def _clear_store(self) -> int | None:
        """(owed_clear.py) Every object under the prefix removed: how many; None when the
        store is not there, stuck, or the call failed or was late."""
        if self._store is None or self._late:
            return None
        got = self._call(self._store.remove_by_regex, ("^" + re.escape(self.prefix), True),
                         self.io_timeout_s, "a clear")
        if got is not None and got < 0:
            self._failed(f"a clear failed ({got})")
        return got if got is not None and got >= 0 else None

    def usage(self) -> dict:
        return {"used_bytes": 0, "capacity_bytes": 0, "blocks": None, "healthy": self.health(),
                "stuck": bool(self._late), "clear_owed": self._clear_owed,
                "deletes_owed": len(self._owed_deletes), "segment_bytes": self.segment_bytes,
                "connected": self._store is not None, "last_error": self.last_error, **self.counters}

    def close(self) -> None:
        self._closed.set()
        self._prober.join(PROBE_EVERY_S + self.io_timeout_s + 2)
        store, self._store = self._store, None
        if store is not None and not self._late:
            store.close()
        self._io.shutdown(1.0)
