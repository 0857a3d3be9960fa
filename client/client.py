"""The thin engine-side client: one DEALER socket, a handshake, typed errors, timeouts.

Whichever thread holds the socket lock reads the socket and files what arrives: replies by
request id, task events by task id. Every wait checks the daemon's pid, `up` flag and heartbeat
in shared memory, so a dead daemon is reported as DaemonUnavailable within a second, not a hang.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import zmq

from kvcached_proto import (DaemonUnavailable, ErrorCode, KvcachedError, KvcachedTimeout, Op, ProtocolError,
                            RequestError, decode, encode_request, pack_block_ids, pack_keys, request_error)
from kvcached_proto.codec import KEY_BYTES, MAX_KEYS_PER_REQUEST
from kvcached_proto.messages import ROLES, TaskStatus
from kvcached_proto.paths import DEFAULT_INSTANCE, check_instance, request_endpoint, resolve_run_dir
from kvcached_proto.order_words import LOAD_REVOKE_WORD, REVOKE_WORD
from kvcached_proto.version import PROTOCOL_VERSION, check_version

from .curve_keys import set_curve
from .daemon_ops import AsksDaemon
from .forks import check_not_forked, current_pid
from .holds import KeepsHolds
from .key_events import FollowsKeys
from .key_table import KeyTableReader, LookupNotes, SendsNotes
from .loads import SendsLoads
from .kv_alloc import describe_kv_cache
from .renamed import Renamed
from .run_dir_hint import check_run_dir
from .status_block import StatusReader, hang_threshold
from .tasks import Task

if TYPE_CHECKING:
    from .reattach import Reattacher

DEFAULT_TIMEOUT_S = 5.0
POLL_SLICE_MS = 20
SEND_TIMEOUT_MS = 1000
HELLO_AGAIN_S = 1.0  # a hello unanswered this long is sent again (its connection may be gone)
BYE_LINGER_MS = 100
KEY_TABLE_ENV = "KVCACHED_KEY_TABLE"  # "0": every lookup is a message (the key table unused)


class Client(AsksDaemon, KeepsHolds, SendsNotes, SendsLoads, FollowsKeys):
    """Connect with `Client.connect(instance=..., run_dir=..., timeout=...)`."""

    def __init__(self, instance: str = DEFAULT_INSTANCE, run_dir: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S, name: str = "", endpoint: str | None = None,
                 curve_server_key_file: str | None = None, curve_client_key_file: str | None = None,
                 role: str = "engine", hang_s: float | None = None, key_table: bool | None = None):
        if role not in ROLES:
            raise ValueError(f"role {role!r}: expected one of {ROLES}")
        self.instance = check_instance(instance)
        self.role = role
        self.run_dir = resolve_run_dir(run_dir)
        self.timeout = timeout
        self.hang_s = hang_threshold(hang_s)
        self.name = name
        self.client_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._pid = current_pid()  # (a forked child's calls raise: forks.py)
        self._endpoint = endpoint or request_endpoint(self.run_dir, self.instance)
        self._curve = (curve_server_key_file, curve_client_key_file)
        self._rid = itertools.count(1)
        self._lock = threading.RLock()
        self._replies: dict[int, dict] = {}
        self._events: dict[int, dict] = {}
        self._sock: zmq.Socket | None = None
        self.status_block: StatusReader | None = None
        self.info: dict = {}
        self._kv_tensors = None
        self.order = None  # EngineOrder while KV is registered (cuda_order.py)
        self._holds: dict[int, list[int]] = {}  # task id -> device blocks it may still write
        self._unanswered: dict[int, int] = {}  # rid of a load whose reply did not come -> its hold
        self._late_loads: dict[int, int] = {}  # task id of such a load, once it came -> its hold
        self._init_task_books()  # the ids of tasks ended, and of Tasks let go (holds.py)
        if key_table is None:
            key_table = os.environ.get(KEY_TABLE_ENV, "1") != "0"
        self._use_key_table = key_table
        self.key_table: KeyTableReader | None = None  # lookups without a message (key_table.py)
        self._notes = LookupNotes()
        self._notes_stop = threading.Event()
        self._notes_thread: threading.Thread | None = None  # sends the notes of an idle client
        self._discard: set[int] = set()  # request ids whose replies nobody waits for (notes)
        self._gone_after_close = lambda: False  # closed: is the daemon it talked to gone?
        self._closed = False

    @classmethod
    def connect(cls, instance: str = DEFAULT_INSTANCE, run_dir: str | None = None,
                timeout: float = DEFAULT_TIMEOUT_S, name: str = "", endpoint: str | None = None,
                curve_server_key_file: str | None = None,
                curve_client_key_file: str | None = None, role: str = "engine",
                hang_s: float | None = None, key_table: bool | None = None) -> "Client":
        """endpoint: a tcp:// address of the daemon's --listen instead of its ipc socket; TCP
        needs the daemon's public key file and this client's secret key file (CURVE; the
        client's public key must be in the daemon's --curve-allow-dir).
        role: "engine" (default), or "operator" (ipc socket only): an operator may send the
        ops that change the daemon for every engine (clear, pause, resume, unregister_kv,
        shutdown), which an engine may send only while its KV cache is the registered one.
        hang_s: how long the daemon may miss its heartbeat before it counts as hung (every wait then
        raises DaemonUnavailable; default $KVCACHED_HANG_S or 2 s); a daemon gone is seen at once.
        key_table: answer lookups from the daemon's key table in shared memory where it can
        (default: yes, unless $KVCACHED_KEY_TABLE is "0"); False sends every lookup."""
        client = cls(instance, run_dir, timeout, name, endpoint, curve_server_key_file,
                     curve_client_key_file, role, hang_s, key_table)
        try:
            client._open()
        except BaseException:
            client.close()
            raise
        return client

    @classmethod
    def reattacher(cls, kv_caches=None, **connect_kwargs) -> "Reattacher[Client]":
        """For an engine that drives a Client itself: a Reattacher whose take() answers at once
        with a Client connected in the background (kv_caches registered, when given) or None.
        Hold one while no daemon is attached; a Client itself is one connection, and every
        call on it raises DaemonUnavailable once its daemon is gone."""
        from .reattach import Reattacher

        prepare = (lambda c: c.register_kv_cache(kv_caches)) if kv_caches is not None else None
        return Reattacher(lambda: cls.connect(**connect_kwargs), prepare,
                          name=connect_kwargs.get("name") or "client")

    def _open(self) -> None:
        try:
            self.status_block = StatusReader(self.instance, self.hang_s, run_dir=self.run_dir)
        except DaemonUnavailable as exc:
            if self._endpoint.startswith("tcp://"):  # say why a remote daemon cannot do
                raise DaemonUnavailable(
                    f"{exc}. A client over TCP still needs the daemon's status segment in this "
                    "host's /dev/shm (liveness and layer-by-layer load progress travel through it, "
                    "and KV is shared through CUDA IPC or /dev/shm): kvcached serves engines on "
                    "its own host; --listen is for clients in another network namespace of that "
                    "host that share its /dev/shm") from None
            raise
        self.status_block.check_alive()
        if self._endpoint == request_endpoint(self.run_dir, self.instance):
            check_run_dir(self.instance, self.run_dir, self.status_block.pid)  # at once, not a timeout
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a daemon that is not there
        # taken off the connection as it comes, read late or not (the daemon closes a connection its replies fill)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        if any(self._curve):
            set_curve(self._sock, *self._curve)
        self._sock.connect(self._endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self.info = self._hello()
        check_version(self.info.get("protocol_version", (0, 0)), "the daemon")
        if self.info["epoch"] != self.status_block.epoch:
            raise DaemonUnavailable("the daemon restarted during the handshake; connect again")
        if self._use_key_table and "key_table" in self.info.get("capabilities", ()):
            self.key_table = KeyTableReader(self.instance, self.info["epoch"], self.status_block)

    def _hello(self) -> dict:
        """The handshake, within the client's timeout. The connection may take a while (a TCP
        and CURVE handshake behind a flood of them), and a hello may go out on a connection the
        daemon shuts at once (past its per-peer cap, while others of this process or address
        are still counted): zmq connects again, and the hello is sent again every
        HELLO_AGAIN_S until it is answered."""
        fields = dict(pid=os.getpid(), name=self.name, role=self.role)
        deadline, sent = time.monotonic() + self.timeout, False
        while True:
            left = deadline - time.monotonic()
            try:
                rid = self._send(Op.HELLO, fields, reach_s=max(0.0, min(left, HELLO_AGAIN_S)))
                sent = True
                return self._checked(self._reply(rid, Op.HELLO, max(0.0, min(left, HELLO_AGAIN_S))))
            except (DaemonUnavailable, KvcachedTimeout, RequestError) as exc:
                if isinstance(exc, RequestError) and exc.code != ErrorCode.BUSY:
                    raise  # (BUSY: read after its connection was shut; the next one is new)
                self._check_daemon()  # gone: said at once
                if time.monotonic() >= deadline:
                    if not sent:  # (a listener that refuses the handshake: no connection ever)
                        raise DaemonUnavailable(f"cannot reach the daemon at {self._endpoint} "
                                                f"within {self.timeout:g} s") from None
                    raise KvcachedTimeout(f"no hello reply within {self.timeout:g} s "
                                          "(set Client(timeout=...))") from None

    # context manager ------------------------------------------------------
    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        forked = current_pid() != self._pid  # a child's copies: nothing sent, nothing unlinked
        if self._sock is not None:
            if self.info and not forked:
                # said hello: the notes left (answered: a close's linger could drop them), then
                # bye, best effort, without waiting for a reply
                self._notes_stop.set()
                self._notes_at_close()
                try:
                    self._sock.send(encode_request(Op.BYE, next(self._rid), self.client_id),
                                    zmq.NOBLOCK)
                except zmq.ZMQError as exc:
                    self._bye_error = exc  # the daemon is gone or unreachable: nothing to tell it
            if not forked:  # (pyzmq leaves the parent's socket alone in a child)
                self._sock.close(linger=BYE_LINGER_MS)
            self._sock = None
        if self.order is not None and not forked:
            self.order.close(self.status_block.identity_check() if self.status_block is not None else None)
        self.order = None
        if self.key_table is not None:
            self.key_table.close()
        if self.status_block is not None:
            self._gone_after_close = self.status_block.identity_check()  # holds still need it
            self.status_block.close()
            self.status_block = None

    # plumbing -------------------------------------------------------------
    def _send(self, op: Op, fields: dict, reach_s: float = SEND_TIMEOUT_MS / 1000) -> int:
        """Send one request; DaemonUnavailable when the daemon is gone, or not connected
        within reach_s."""
        if self._sock is None:
            raise DaemonUnavailable("client is closed")
        check_not_forked(self._pid)
        rid = next(self._rid)
        frame = encode_request(op, rid, self.client_id, **fields)
        deadline = time.monotonic() + reach_s
        with self._lock:
            if self._notes.pending:  # what local lookups saw reaches the daemon before this op
                self._send_notes()
            while True:
                try:
                    self._sock.send(frame, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    pass  # not connected (yet): make sure the daemon lives, then wait a little
                self._check_daemon()
                if time.monotonic() > deadline:
                    raise DaemonUnavailable(
                        f"cannot reach the daemon at {self._endpoint} within {reach_s:g} s")
                self._sock.poll(POLL_SLICE_MS, zmq.POLLOUT)
        return rid

    def _request(self, op: Op, timeout: float | None = None, **fields) -> dict:
        return self._checked(self._reply(self._send(op, fields), op, timeout))

    def _reply(self, rid: int, op: Op, timeout: float | None, forget: bool = True) -> dict:
        """The reply to request `rid`, whatever it says. One that does not come in time is
        dropped when it comes later (the error raised is the caller's answer); forget=False
        leaves that to the caller (a load's: `_hold_unanswered`)."""
        replies = self._replies
        reply = replies.pop(rid, None)  # read already while waiting for an earlier request
        # fast path: one blocking poll usually brings the reply (none past the timeout)
        slice_s = POLL_SLICE_MS / 1000 if timeout is None else max(0.0, min(POLL_SLICE_MS / 1000, timeout))
        if reply is None and self._lock.acquire(timeout=slice_s):
            try:
                self._pump(slice_s)
            finally:
                self._lock.release()
            reply = replies.pop(rid, None)
        if reply is None:
            try:
                reply = self._wait(lambda: replies.pop(rid, None), timeout, op, "Client(timeout=...)")
            except KvcachedError:
                if forget:
                    if len(self._discard) > 4096:  # a daemon that stopped answering: forget the oldest
                        self._discard.clear()
                    self._discard.add(rid)
                raise
        return reply

    @staticmethod
    def _checked(reply: dict) -> dict:
        if not reply.get("ok"):
            err = reply.get("error") or {}
            raise request_error(err.get("code", 0), err.get("message", "no message"))
        return reply

    def _wait(self, take: Callable[[], object], timeout: float | None, what, knob: str, drains=False):
        """Pump the socket until take() returns something; check the daemon (_check_daemon)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            got = take()
            if got is not None:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                self._check_daemon(drains)
                what = f"{what.name.lower()} reply" if isinstance(what, Op) else what
                raise KvcachedTimeout(f"no {what} within {timeout:.3g} s (set {knob})")
            slice_s = min(left, POLL_SLICE_MS / 1000)
            received = False
            if self._lock.acquire(timeout=slice_s):
                try:
                    received = self._pump(slice_s)
                finally:
                    self._lock.release()
            if not received:
                self._check_daemon(drains)  # silence: make sure the daemon is still there

    def _pump(self, wait_s: float) -> bool:
        """Read and file every frame that is waiting; True if at least one arrived."""
        sock = self._sock
        if sock is None:
            raise DaemonUnavailable("client is closed")
        check_not_forked(self._pid)
        timeout_ms = int(wait_s * 1000)
        received = False
        while self._poller.poll(timeout_ms):
            timeout_ms = 0  # after the first frame, take only what is already there
            received = True
            try:
                msg = decode(sock.recv(zmq.NOBLOCK))
            except ProtocolError as exc:
                raise KvcachedError(f"undecodable frame from the daemon: {exc}") from None
            if "event" in msg:
                self._ended(msg)
            elif msg.get("rid", 0) in self._unanswered:
                self._late_load(msg)
            elif msg.get("rid", 0) in self._discard:
                self._discard.discard(msg.get("rid", 0))  # a note's reply: nobody waits for it
            else:
                self._replies[msg.get("rid", 0)] = msg
        return received

    def alive(self) -> bool:
        """The daemon is up, beating and not gone (shared memory only: cheap, never raises)."""
        sig = self.status_block
        if sig is None:
            return False
        try:
            self._check_daemon()
            return True
        except Exception:  # DaemonUnavailable, or a reader closed under us by another thread
            return False

    def _check_daemon(self, drains: bool = False) -> None:
        """DaemonUnavailable unless the daemon is up (`drains`: or stopping, StatusReader.check_alive)."""
        if self.status_block is None:
            raise DaemonUnavailable("client is closed")
        check_not_forked(self._pid)
        self.status_block.check_alive(drains)
        if self.order is not None and self.order.released:
            # its progress words say "landed" for good: no later layer wait would hold
            raise DaemonUnavailable("this connection's order words were released (its daemon "
                                    "was lost past the hang threshold): connect again")

    # earlier name
    signals = Renamed("status_block")

    @property
    def epoch(self) -> int:
        return self.info.get("epoch", 0)

    @property
    def protocol_version(self) -> tuple[int, int]:
        return PROTOCOL_VERSION

    # KV and data ops ------------------------------------------------------
    def register_kv_cache(self, tensors, timeout: float | None = None) -> dict:
        """Register the engine's KV cache: a list per layer of a (K, V) pair or one tensor.
        With it goes a new order-words segment (cuda_order.py) that this connection's copies
        are ordered by."""
        reply = self.register_layout(describe_kv_cache(tensors), timeout)
        self._kv_tensors = tensors
        return reply

    def register_layout(self, layout: dict, timeout: float | None = None) -> dict:
        """Register a layout already described (kvcached_proto.layout), with a new order-words
        segment: register_kv_cache's second half, and host_memory.register_host_memory's."""
        from .cuda_order import EngineOrder, refusals

        if str(layout["device"]).startswith("cuda"):
            refusals.check()  # CUDA refused the last order words: not at every engine step
        order = EngineOrder(layout["device"], layout["num_layers"], self._daemon_lost)
        layout["order_segment"] = order.name
        layout["revoke_word"] = REVOKE_WORD
        layout["load_revoke_word"] = LOAD_REVOKE_WORD  # (a daemon before 1.14 ignores it)
        try:
            reply = self._request(Op.REGISTER_KV, timeout, layout=layout)
        except BaseException:
            order.close()
            raise
        if self.order is not None:
            self.order.close(self.status_block.identity_check() if self.status_block else None)
        self.num_layers = layout["num_layers"]
        self.order = order
        if self.key_table is not None:  # a new geometry has a new table: open it at the next lookup
            self.key_table.close()
        return reply

    def _daemon_lost(self) -> bool:
        status_block = self.status_block
        return status_block is None or status_block.lost()

    def unregister_kv_cache(self, timeout: float | None = None) -> None:
        self._request(Op.UNREGISTER_KV, timeout)
        self._kv_tensors = None
        if self.order is not None:
            self.order.close(self.status_block.identity_check() if self.status_block else None)
            self.order = None

    def _fence(self, stream) -> dict:
        """The fence fields of an offload or a load: ordered after the work queued so far on
        `stream` (CUDA; default: the current stream)."""
        if self.order is None:
            return {}
        return self.order.fence(stream, self.timeout)

    def offload(self, device_blocks: Sequence[int] | np.ndarray, keys: Sequence[bytes], priority: int = 0,
                timeout: float | None = None, stream=None, parent: bytes | None = None) -> Task:
        """Copy `device_blocks` to the host tier under `keys`; `parent`: the key of the block
        before keys[0] in its request (an earlier offload's last), so the tiers keep the request's
        head before its tail (told to daemons of protocol 1.15 on). CUDA KV: the daemon's copies
        wait (on the GPU) for the work queued so far on `stream` (default: the current stream),
        so the engine calls this right after queuing its KV writes, with no synchronize. The
        blocks stay the daemon's to read until the task ends; an offload whose reply does not
        come (KvcachedTimeout, DaemonUnavailable, an interrupt while waiting) is revoked before
        the error is raised: the blocks are the caller's again."""
        if parent is not None and (not isinstance(parent, bytes) or len(parent) != KEY_BYTES):
            raise ValueError(f"parent: not a {KEY_BYTES}-byte key")
        fields = {"keys": pack_keys(keys), "blocks": pack_block_ids(device_blocks),
                  "priority": priority, **self._fence(stream)}
        if parent is not None and tuple(self.info.get("protocol_version", (0, 0))) >= (1, 15):
            fields["parent"] = parent
        try:
            reply = self._request(Op.OFFLOAD, timeout, **fields)
        except BaseException as exc:
            # no reply (a timeout, a daemon hung or gone, an interrupt while waiting): a daemon
            # that is slow or hung may still take it and read the blocks after the caller
            # reused them; revoked, it stores nothing of it (a refusal copies nothing)
            if isinstance(exc, (KvcachedTimeout, DaemonUnavailable)) or not isinstance(exc, KvcachedError):
                self._revoke(fields.get("fence", 0))
            raise
        reply["fence"] = fields.get("fence", 0)
        return Task(self, reply["task"], "offload", reply)

    def lookup(self, keys: Sequence[bytes], timeout: float | None = None) -> tuple[int, int]:
        """(host hits, storage hits past them): how many leading keys the host tier holds, and
        how many after those the storage tiers hold. Answered from the daemon's key table in
        shared memory where it can (no message; the daemon hears of it later, in a batch), else
        by the lookup op. Either answer pins nothing: a load plans from what is there then."""
        table = self.key_table
        if table is not None:
            check_not_forked(self._pid)
            if not isinstance(keys, (list, tuple, bytes)):
                keys = list(keys)
            if len(keys) <= MAX_KEYS_PER_REQUEST:
                got = table.lookup(keys)
                if got is not None:
                    host, storage, packed = got
                    if packed and self._notes.add(packed, storage):
                        self._send_notes()
                    elif self._notes_thread is None:
                        self._start_notes_thread()
                    return host, storage
        reply = self._request(Op.LOOKUP, timeout, keys=pack_keys(keys))
        return reply["host"], reply["storage"]

    def prefetch(self, keys: Sequence[bytes], policy: str = "best_effort", timeout_ms: int = 0,
                 block_tokens: int = 1, priority: int = 0, timeout: float | None = None) -> Task:
        """Warm the host tier from storage with the keys past the host prefix. The daemon
        skips it (task id 0, done at once) when the storage hit is under its threshold.
        policy: best_effort (use whatever arrived), wait_complete (wait() for all), timeout
        (the daemon stops after timeout_ms)."""
        reply = self._request(Op.PREFETCH, timeout, keys=pack_keys(keys), policy=policy,
                              timeout_ms=timeout_ms, block_tokens=block_tokens, priority=priority)
        task = Task(self, reply["task"], "prefetch", reply)
        if reply["task"] == 0:
            task.status, task.result = TaskStatus.SKIPPED, {"prefetched": 0, "reason": reply.get("skipped")}
        return task

    def flush(self, timeout: float | None = None) -> Task:
        """A task that completes once the offloads the daemon accepted so far ended and the storage
        backups queued so far (theirs included) are written (before protocol 1.11: the backups only)."""
        return Task(self, self._request(Op.FLUSH, timeout)["task"], "flush", {})

    def cancel(self, task_id: int, timeout: float | None = None) -> str:
        return self._request(Op.CANCEL, timeout, task=task_id)["state"]

    def delete(self, keys: Sequence[bytes], timeout: float | None = None) -> int:
        """Delete keys from the host tier and the storage tiers; returns host blocks deleted."""
        return self._request(Op.DELETE, timeout, keys=pack_keys(keys))["deleted"]

    def clear(self, tier: str = "all", weights_update: bool = False, timeout: float | None = None) -> int:
        return self._request(Op.CLEAR, timeout, tier=tier, weights_update=weights_update)["cleared"]

    def pause(self, timeout: float | None = None) -> None:
        self._request(Op.PAUSE, timeout)

    def resume(self, timeout: float | None = None) -> None:
        self._request(Op.RESUME, timeout)

