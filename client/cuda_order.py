"""The engine's half of the ordering between its streams and the daemon's copy streams, through
the order words (kvcached_proto.order_words, which says why words and not IPC events).

- Before an offload or a load, `fence(stream)` writes the next sequence number into a free
  fence word on the engine's stream, after the work queued so far (its KV writes; for a load,
  whatever last used the target blocks); the request carries (fence_word, fence) and the
  daemon's copy stream waits for it. The engine's CPU does not synchronize. A fence word is
  reused only once its last value was reached, so a later write never stands in for an
  earlier one still queued on another stream.
- Loads: the daemon writes the load's task id into the slot's word for layer i on its load
  stream after the layer's copies, then bumps the slot's counter; `LoadTask.wait_layer` sees
  the counter and queues a wait for that word on the engine's stream.
- A guard thread watches the waits queued and not yet reached: if the daemon died (or stopped
  beating past the hang threshold: a daemon that is only stopped has its copies queued, and
  they end on the GPU without it), it writes RELEASED into the progress words so the engine's
  streams go on; those loads are reported failed by their tasks, and their blocks recomputed.

On CPU the words are written and checked by the CPU (the same layout and bookkeeping).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import numpy as np

from kvcached_proto.errors import DaemonUnavailable, KvcachedTimeout, TaskFailed
from kvcached_proto.order_words import (
    FENCE_WORDS,
    RELEASED,
    LOAD_REVOKE_WORD,
    REVOKE_WORD,
    load_word,
    reached,
    segment_bytes,
)

FENCE_SLOTS = LOAD_REVOKE_WORD  # the fence words this engine uses: every word below the revoke words
from kvcached_proto.shm_layout import NUM_SLOTS

from .kv_alloc import _shared_cpu_buffer

log = logging.getLogger("kvcached.client")
GUARD_PERIOD_S = 0.02
IDLE_WAIT_S = 1.0  # the guard with nothing to watch looks again at least this often
CLOSED_RELEASE_S = 10.0  # after close, pending waits are released this late at most
REFUSED_PAUSE_S = (0.5, 60.0)  # after CUDA refused the order words: first pause, longest pause


class _Refusals:
    """CUDA refusals of the order words in a row, in this process: each spends its connection,
    and the reattach would otherwise register again (a register_kv round trip and a drain of
    the daemon's copies) at every engine step. A new registration waits out a pause that doubles
    with each refusal in a row, up to REFUSED_PAUSE_S[1]; the first registration that works ends
    the streak."""

    def __init__(self):
        self._lock = threading.Lock()
        self.count = 0
        self.until = 0.0
        self.why = ""

    def failed(self, why: str) -> float:
        with self._lock:
            self.count += 1
            first, longest = REFUSED_PAUSE_S
            pause = min(first * 2 ** (self.count - 1), longest)
            self.until, self.why = time.monotonic() + pause, why
            return pause

    def worked(self) -> None:
        if self.count:
            with self._lock:
                self.count, self.until, self.why = 0, 0.0, ""

    def check(self) -> None:
        """Raise DaemonUnavailable while a pause runs (before a registration is attempted)."""
        with self._lock:
            if time.monotonic() < self.until:
                raise DaemonUnavailable(f"CUDA refused the order words {self.count} time(s) in a "
                                        f"row (last: {self.why}); no registration until the "
                                        "pause after it ends")


refusals = _Refusals()


def _cuda_ops(device: str):
    def make(addr: int, nbytes: int):
        import torch

        from kvcached_proto.stream_ops import StreamOps

        with torch.cuda.device(torch.device(device)):
            return StreamOps(addr, nbytes)
    return make


class EngineOrder:
    def __init__(self, device: str, num_layers: int, lost: Callable[[], bool], ops_factory=None):
        self.num_layers = num_layers
        self.nbytes = segment_bytes(NUM_SLOTS, num_layers)
        self._mm, self.name = _shared_cpu_buffer(self.nbytes)
        self.words = np.frombuffer(self._mm, dtype=np.uint64)
        self.device = device
        self.cuda = device.startswith("cuda")
        self._ops_factory = (ops_factory or _cuda_ops(device)) if self.cuda else None
        self.ops = None  # the words' CUDA registration, made by the first stream operation
        self._owner: int | None = None  # the thread that made it: the engine's
        self._lost = lost
        self._last = [0] * FENCE_WORDS  # the value last written to each fence word
        self._seq = 0
        self._next = 0
        self._pending: dict[int, int] = {}  # progress word -> highest value a stream waits for
        self._cv = threading.Condition()
        self._guard: threading.Thread | None = None
        self._closed_at: float | None = None
        self.released = False  # once true, every progress word passes: the client is spent
        self.released_loads: set[int] = set()  # loads whose stream waits were released

    def _stream(self, stream):
        import torch

        return stream or torch.cuda.current_stream(torch.device(self.device))

    def fence(self, stream=None, timeout: float = 5.0) -> dict:
        """Write the next fence after the work queued so far on `stream` (the current stream by
        default); returns the request fields that carry it."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for _ in range(FENCE_SLOTS):
                    k, self._next = self._next, (self._next + 1) % FENCE_SLOTS
                    if reached(self.words[k], self._last[k]):
                        break
                else:  # every fence word still waits for its own engine stream
                    if time.monotonic() > deadline:
                        raise KvcachedTimeout(f"no free fence word in {timeout:g} s: the engine's "
                                              f"streams hold {FENCE_SLOTS} fences not yet reached")
                    self._cv.wait(0.001)
                    continue
                break
            self._seq += 1
            seq = self._last[k] = self._seq
            if not self.cuda:
                self.words[k] = seq  # CPU: the engine's writes are done when it calls
            else:
                self._queue("write", stream, k, seq)
        return {"fence_word": k, "fence": seq}

    def _stream_ops(self):
        """The words' CUDA registration, made here, on the thread that queues the first stream
        operation on them - the engine's - and not where the segment was made: a reattach makes
        it on a background thread, and a CUDA call there such as cuMemHostRegister, while the
        engine captures a CUDA graph (vLLM at start-up), invalidates the engine's capture.
        Registrations that other threads let go are undone here too (`_free`)."""
        if self.ops is None:
            try:
                self.ops = self._ops_factory(self.words.ctypes.data, self.nbytes)
            except Exception as exc:  # a CUDA error here must cost the cache, not the engine's step
                self.released = True  # spent: not alive, so the engine's link attaches anew
                why = f"{type(exc).__name__}: {exc}"
                pause = refusals.failed(why)
                log.warning("[order] the order words could not be registered with CUDA (%s): the "
                            "cache is off for this connection, and the next registration waits "
                            "%.1f s", why, pause)
                raise DaemonUnavailable(f"the order words could not be registered with CUDA "
                                        f"({why}); this connection is not used") from None
            self._owner = threading.get_ident()
            refusals.worked()
        _undo_deferred()
        return self.ops

    def _queue(self, op: str, stream, word: int, value: int) -> None:
        """Queue a stream operation on a word; a CUDA error spends the connection and comes as
        DaemonUnavailable (the engine goes on without the cache, never raises in its step)."""
        ops = self._stream_ops()
        try:
            getattr(ops, op)(self._stream(stream).cuda_stream, word, value)
        except Exception as exc:
            self.released = True
            raise DaemonUnavailable(f"queuing {op} on the order words failed "
                                    f"({type(exc).__name__}: {exc}); this connection is not used") from None

    def revoke(self, fence: int, load: bool = False) -> None:
        """Offloads sent with a fence up to `fence` that have not completed are discarded by
        the daemon (`load`: loads copy no layer more): the engine is about to reuse their
        blocks (the word only grows)."""
        word = LOAD_REVOKE_WORD if load else REVOKE_WORD
        with self._cv:
            if not reached(self.words[word], fence):
                self.words[word] = fence

    def wait_loaded(self, slot: int, layer: int, task_id: int, stream=None) -> None:
        """Make `stream` wait for the daemon's copies of `layer` of load `task_id` (CPU: check
        that the daemon wrote the word before it bumped the counter)."""
        idx = load_word(slot, layer, self.num_layers)
        if not self.cuda:
            if not reached(self.words[idx], task_id):
                raise TaskFailed(f"load {task_id}: layer {layer} counted done but its order word "
                                 f"holds {int(self.words[idx])}", {"loaded": 0})
            return
        self._queue("wait_geq", stream, idx, task_id)
        with self._cv:
            self._pending[idx] = max(self._pending.get(idx, 0), task_id)
            if self._guard is None:
                self._guard = threading.Thread(target=self._watch, name="kvcached-order-guard",
                                               daemon=True)
                self._guard.start()
            self._cv.notify_all()

    def pending(self) -> int:
        """Queued waits whose word was not reached yet."""
        with self._cv:
            self._pending = {i: v for i, v in self._pending.items() if not reached(self.words[i], v)}
            return len(self._pending)

    def release(self, why: str) -> None:
        """Let every stream wait on a progress word go on (the daemon will not write them)."""
        with self._cv:
            if self._pending:
                log.warning("[order] releasing %d engine stream wait(s): %s", len(self._pending), why)
            self.words[FENCE_WORDS:] = RELEASED
            self.released_loads.update(self._pending.values())
            self._pending.clear()
            self.released = True
            self._cv.notify_all()

    def _watch(self) -> None:
        while True:
            with self._cv:
                while not self._pending and self._closed_at is None:
                    self._cv.wait(IDLE_WAIT_S)  # woken by a new wait or the close; bounded all the same
            if not self.pending():
                if self._closed_at is not None:
                    self._free()
                    return
                continue
            closed_long = self._closed_at is not None and \
                time.monotonic() - self._closed_at > CLOSED_RELEASE_S
            if self._lost() or closed_long:
                self.release("the daemon died or stopped beating with its copies unfinished"
                             if not closed_long else "the client closed and the daemon did not "
                             f"finish its copies in {CLOSED_RELEASE_S:g} s")
            time.sleep(GUARD_PERIOD_S)

    def close(self, lost: Callable[[], bool] | None = None) -> None:
        """Unlink the segment; the mapping and its CUDA registration go once no stream waits on
        it (the guard keeps watching them, with `lost` as the liveness test)."""
        from .kv_alloc import _unlink

        _unlink(self.name)
        with self._cv:
            if lost is not None:
                self._lost = lost
            self._closed_at = time.monotonic()
            self._cv.notify_all()
            guarded = self._guard is not None
        if not guarded:
            self._free()

    def _free(self) -> None:
        """Undo the CUDA registration: now on the thread that made it, else at that thread's
        next stream operation (the guard, a hold keeper or a reattach thread may close a client;
        the mapping stays until then)."""
        if self.ops is None:
            return
        if threading.get_ident() == self._owner:
            self.ops.unregister()
        else:
            with _deferred_lock:
                _deferred.append((self.ops, self._mm))


_deferred_lock = threading.Lock()
_deferred: list = []  # (ops, mapping) whose registration another thread let go


def _undo_deferred() -> None:
    if not _deferred:
        return
    with _deferred_lock:
        undo, _deferred[:] = list(_deferred), []
    for ops, _mapping in undo:
        ops.unregister()
