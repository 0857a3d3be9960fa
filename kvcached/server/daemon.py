"""The daemon: sockets, dispatch and lifecycle.

One thread owns the ROUTER request socket and dispatches every request; worker threads hand
task completions back through an EventSink (a queue and an eventfd polled beside the socket;
task_events.py), so only this thread ever writes to the ROUTER. Who may send which op is
access.py's. The status REP socket and the fd socket (fd_inbox.py) have threads of their own, so
a busy data path cannot starve them.
Signals only set the stop flag; SIGTERM, SIGINT and the `shutdown` op take one path out.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING

import zmq

from kvcached_proto import (OP_SPECS, ErrorCode, Op, ProtocolError, decode_request, encode, ok_reply,
                            parse_request)
from kvcached_proto.errors import CodedError
from kvcached_proto.liveness import pid_alive
from kvcached_proto.messages import reply_for
from kvcached_proto.paths import fd_socket_path, request_endpoint, status_endpoint
from kvcached_proto.request_frame import WHOLE_BYTES
from kvcached_proto.shm_layout import Flag, State
from kvcached_proto.version import PROTOCOL_VERSION

from .. import __version__
from ..config import DaemonConfig
from ..copy import sigbus
from ..errors import OpError, StartupError
from ..host import machine
from ..logs import LineBudget, lines_dropped
from .access import ClientInfo, check_admin, check_kv_owner
from .control import ENGINES, OTHERS, ControlWorker
from .kv_sweep import sweep_kv_segments
from .connections import STATUS_PER_PEER, ConnectionGuard, connection_caps, raise_files_limit
from .metrics import Metrics
from .fd_inbox import FdInbox
from .heap_trim import LARGE_BYTES, HeapTrim
from .instance_files import HealsFiles
from .daemon_stop import StopsDaemon
from .run_dir import prepare_run_dir, sweep_socket_files, take_instance_lock
from .sockets import curve_router, io_threads, ipc_router
from .status import StatusThread
from .status_report import degraded, for_tcp_peer, health, stats_line
from .stack_dump import StackDumps
from .status_block import StatusSegment
from .task_events import EventSink

if TYPE_CHECKING:  # imported in _start: it imports torch, which a refused start never needs
    from ..service.cache_service import CacheService

log = logging.getLogger(__name__)

POLL_MS = 50
LOOP_STALL_S = 5.0  # the request loop not turning for this long makes status `degraded`
CURVE_TAG = b"C"  # ROUTER-made ids start with 0x00: this prefix cannot collide
CLIENT_REAP_PERIOD_S = 0.25
KEY_TABLE_REFRESH_S = 0.1  # how soon the key table says a disk tier stopped (or started) answering
MAX_BATCH = 256  # requests handled per wake before events get their turn,
BATCH_S = 0.002  # or this long: 256 costly frames (a flood's) kept a task's event 2 s
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # ints: `&` on zmq's enums costs ~0.7 us
DEFERRED = object()  # _dispatch's answer for an op the control worker replies to
# a frame that is no valid request (what a flood of junk gets): counted as refused in status
REFUSED_CODES = frozenset((ErrorCode.BAD_FRAME, ErrorCode.FRAME_TOO_LARGE, ErrorCode.BAD_HEADER,
                           ErrorCode.UNSUPPORTED_VERSION, ErrorCode.UNKNOWN_OP,
                           ErrorCode.BAD_FIELD, ErrorCode.TOO_MANY_ITEMS))


class Daemon(StopsDaemon, HealsFiles):
    def __init__(self, config: DaemonConfig):
        self.cfg = config
        self.started_ns = time.monotonic_ns()
        self._loop_turned = time.monotonic()  # the request loop's last turn (status reads it)
        self.stop_requested = threading.Event()
        self.clients: dict[bytes, ClientInfo] = {}
        self._lock_fd: int | None = None
        self._ctx: zmq.Context | None = None
        self._router: zmq.Socket | None = None
        self._curve_router: zmq.Socket | None = None  # TCP with CURVE, when keys are given
        self._monitors: list[zmq.Socket] = []  # ACCEPTED/DISCONNECTED of the request and status sockets
        self._status_ep = ""
        self._said = LineBudget()  # what clients repeat is logged a bounded number of times
        self.connections: ConnectionGuard | None = None
        self._fd_clients: dict[int, bytes] = {}  # connection fd -> routing id (said hello)
        self._last_fd, self._last_frame = -1, None  # the message's connection (its SRCFD, peer)
        self._heap = HeapTrim()
        self._gone_pids: set[int] = set()  # disconnected clients whose segments await sweeping
        self._said_bye: set[int] = set()  # pids that said bye: swept once dead, never waited for
        self.requests = {"handled": 0, "refused": 0}  # frames answered; invalid ones among them
        self._auth = None
        self.events: EventSink | None = None
        self.control: ControlWorker | None = None
        self.status_block: StatusSegment | None = None
        self.dumps = StackDumps()  # every thread's stack in the log: on USR1, a stalled loop
        self.service: CacheService | None = None
        self._status_thread: StatusThread | None = None
        self.fd_inbox: FdInbox | None = None
        self.metrics: Metrics | None = None
        self._handlers = {  # the ops a client may send before hello
            Op.HELLO: self._op_hello,
            Op.PING: lambda ident, req: {},
            Op.STATUS: self._op_status,
            Op.BYE: self._op_bye,
        }

    # lifecycle ------------------------------------------------------------
    def serve(self) -> int:
        """Run until shutdown; returns the process exit code."""
        try:
            self._start()
        except BaseException:
            self._close()
            raise
        try:
            self._loop()
        finally:
            self._close()
        return 0

    def _start(self) -> None:
        cfg = self.cfg
        os.umask(0o077)  # socket files and anything else we create: owner only
        sigbus.install()  # a client's shrunken KV segment must not kill the daemon
        self.dumps.listen_for_usr1()  # (the heartbeat writes the stacks: stack_dump.py)
        machine.check_device(cfg.device)
        machine.check_host_memory(cfg.host_cache_bytes)
        files = raise_files_limit()
        per_socket, status_cap = connection_caps(cfg.max_connections, files, 1 + len(cfg.listen))
        self.connections = ConnectionGuard(per_socket, cfg.max_connections_per_peer)
        log.info("[startup] open-files limit %d: at most %d connections per request socket, %d on "
                 "the status socket, %d per peer", files, self.connections.max_connections,
                 status_cap, self.connections.max_per_peer)
        prepare_run_dir(cfg.run_dir)
        self._lock_fd = take_instance_lock(cfg.run_dir, cfg.instance)
        sweep_socket_files(cfg.run_dir, cfg.instance)
        self.status_block = StatusSegment(cfg.instance, self.dumps)
        self._ctx = zmq.Context(io_threads=io_threads(bool(cfg.curve_secret_key_file)))
        self.events = EventSink()
        self._router = ipc_router(self._ctx, request_endpoint(cfg.run_dir, cfg.instance))
        if cfg.curve_secret_key_file:  # config validation refuses --listen without it
            self._curve_router, self._auth = curve_router(self._ctx, cfg)
        for sock in (self._router, self._curve_router):
            if sock is not None:
                self._monitors.append(
                    sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED))
        # torch (1.1 s of one core) only now: a start refused above (a running instance, an
        # unsafe run dir or allow dir, a port in use) is said within a few tenths of a second
        from ..service.cache_service import CacheService

        self.service = CacheService(cfg, self.status_block, self.events)
        self._loop_turned = time.monotonic()  # (not the pool's pinning: status and /health read it)
        self.control = ControlWorker(self.events)  # ops that may block, off the request thread
        self.control.start()
        self.service.defer = self.control.run_later  # a gone client's KV mapping: after a drain
        try:
            self.metrics = Metrics(cfg.instance, self.status, cfg.metrics_port, cfg.metrics_addr,
                                   self.health)
        except OSError as exc:
            raise StartupError(f"--metrics-port {cfg.metrics_port}: cannot listen on "
                               f"{cfg.metrics_addr}: {exc.strerror}") from None
        self.service.table.on_task_end = self.metrics.observe
        self._status_thread = StatusThread(
            self._ctx, status_endpoint(cfg.run_dir, cfg.instance), self.status
        )
        self._status_ep = self._status_thread.endpoint
        self.connections.limit(self._status_ep, status_cap, "the status socket's cap", STATUS_PER_PEER)
        self._monitors.append(self._status_thread.monitor)
        self._status_thread.start()
        self.fd_inbox = FdInbox(fd_socket_path(cfg.run_dir, cfg.instance))  # engines' memfds
        self.fd_inbox.start()
        self.service.fd_inbox = self.fd_inbox
        self._install_signal_handlers()
        self.status_block.set_state(State.NORMAL)
        self.status_block.set_flag(Flag.UP)
        log.info(
            "[startup] instance %s ready: pid %d epoch %x run dir %s device %s",
            cfg.instance, os.getpid(), self.status_block.epoch, cfg.run_dir, cfg.device,
        )

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        def request_stop(signum, _frame):
            self.stop_requested.set()
            self.events.wake()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # (HUP: a terminal closed)
            signal.signal(signum, request_stop)

    # main loop ------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        if self._curve_router is not None:
            poller.register(self._curve_router, zmq.POLLIN)
        poller.register(self.events.pull, zmq.POLLIN)
        for mon in self._monitors:
            poller.register(mon, zmq.POLLIN)
        next_reap = time.monotonic() + CLIENT_REAP_PERIOD_S
        next_stats = time.monotonic() + self.cfg.stats_interval_s
        next_keys = 0.0
        self._loop_turned = time.monotonic()
        self.status_block.watch_loop(lambda: time.monotonic() - self._loop_turned, LOOP_STALL_S)
        while not self.stop_requested.is_set():
            self._loop_turned = time.monotonic()
            ready = dict(poller.poll(POLL_MS))
            for mon in self._monitors:  # before requests: a closed fd may be reused meanwhile
                if mon in ready:
                    self._on_connection_events(mon)
            if self._router in ready:
                self._requests(self._router, b"")
            if self._curve_router is not None and self._curve_router in ready:
                self._requests(self._curve_router, CURVE_TAG)
            if self.events.pull in ready:
                self._forward_events()
            if time.monotonic() >= next_keys:  # the key table says whether its disk tiers answer
                self.service.keys.refresh()
                next_keys = time.monotonic() + KEY_TABLE_REFRESH_S
            if time.monotonic() >= next_reap:
                self._reap_dead_clients()
                self.service.expire_parked()
                self._heap.maybe_trim(time.monotonic())
                self._heal_files()  # (once a second: instance_files.py)
                next_reap = time.monotonic() + CLIENT_REAP_PERIOD_S
            if time.monotonic() >= next_stats:
                log.info("[stats] %s", stats_line(self.status()))
                next_stats = time.monotonic() + self.cfg.stats_interval_s

    def _requests(self, sock: zmq.Socket, tag: bytes) -> None:
        """The requests waiting, until MAX_BATCH or BATCH_S: then the events' turn."""
        until = time.monotonic() + BATCH_S
        for _ in range(MAX_BATCH):  # EVENTS instead of catching zmq.Again: cheaper
            if not sock.getsockopt(_EVENTS) & _POLLIN or time.monotonic() > until:
                break
            self._handle(self._recv(sock, tag))
            self._last_frame = None  # (a flood's large frame is not kept until the next one)

    def _recv(self, sock: zmq.Socket, tag: bytes) -> list:
        """One message: [routing id, frames as buffers...] (nothing copied: a frame is decoded
        from zmq's own memory); notes the connection's fd (for hello)."""
        frames = [tag + sock.recv(zmq.NOBLOCK)]
        first = None
        while sock.getsockopt(zmq.RCVMORE):
            part = sock.recv(zmq.NOBLOCK, copy=False)
            first = first or part
            frames.append(part.buffer)
        self._last_fd = first.get(zmq.SRCFD) if first is not None else -1
        self._last_frame = first
        return frames

    def _on_connection_events(self, mon: zmq.Socket) -> None:
        """Connections accepted (counted, or refused past the caps) and closed."""
        from zmq.utils.monitor import recv_monitor_message

        while mon.poll(0):
            event = recv_monitor_message(mon, zmq.NOBLOCK)
            fd, endpoint = int(event["value"]), event["endpoint"].decode(errors="replace")
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.connections.accepted(fd, endpoint)
            else:
                self.connections.closed(fd, endpoint)
                if endpoint != self._status_ep:  # (no client's: a status reader's)
                    self._on_disconnect(fd, endpoint)

    def _on_disconnect(self, fd: int, endpoint: str) -> None:
        """A client's connection closed (it died, in any pid namespace): release its work. Only
        a close on the client's own kind of listener is its (ipc clients come through the ipc
        socket, CURVE-tagged ones through TCP): a TCP connection's close can be read after an
        ipc client's connection took its fd number."""
        routing_id = self._fd_clients.get(fd)
        if routing_id is None or endpoint.startswith("ipc://") == (routing_id[:1] == CURVE_TAG):
            return
        del self._fd_clients[fd]
        client = self.clients.get(routing_id)
        if client is None or client.fd != fd:
            return
        self._said.log(log, logging.WARNING, "closed", "[clients] client %s (pid %d) closed its "
                       "connection; releasing its work", client.client_id, client.pid)
        del self.clients[routing_id]
        self.service.drop_client(client, dead=True)
        if client.pid_visible and not pid_alive(client.pid):
            sweep_kv_segments(client.pid)
        elif client.pid_visible:
            self._gone_pids.add(client.pid)  # its KV segments go once the process has

    def _forward_events(self) -> int:
        sent = 0
        for routing_id, payload in self.events.drain():
            try:
                self._send_to(routing_id, payload)
                sent += 1
            except zmq.Again:
                log.warning("[events] send queue of a client is full; event dropped")
        return sent

    def _handle(self, frames: list[bytes]) -> None:
        routing_id, body = frames[0], frames[1:]
        msg: dict = {}  # what was decoded, also of a frame refused part way (its rid)
        self.requests["handled"] += 1
        fd, costly, size = self._last_fd, False, sum(len(b) for b in body)
        if size > LARGE_BYTES:
            self._heap.took(size)
        if fd >= 0 and self.connections.unread(fd, self._last_frame):
            return  # shut: it reads none of its replies (connections.py)
        try:
            if len(body) != 1:
                raise ProtocolError(ErrorCode.BAD_FRAME, f"expected one frame, got {len(body)}")
            req = parse_request(decode_request(body[0], msg))
            self.connections.valid(fd)
            result = self._dispatch(routing_id, req)
            if result is DEFERRED:
                return
            reply = ok_reply(req.rid, **result)
        except CodedError as exc:
            if exc.code in REFUSED_CODES:
                self.requests["refused"] += 1
                costly = size > WHOLE_BYTES  # a large frame of no use
            reply = reply_for(_rid_of(msg), exc)
        except Exception as exc:  # a bug: report it to the caller and keep serving others
            log.exception("[dispatch] internal error")
            reply = reply_for(_rid_of(msg), exc)
        try:
            if routing_id[:1] == CURVE_TAG:
                self._send_to(routing_id, encode(reply))
            else:
                self._router.send(routing_id, zmq.SNDMORE)  # two sends: cheaper than send_multipart
                self._router.send(encode(reply))
        finally:
            if self.service is not None:
                self.service.replied()  # the copies the request queued start now
        if costly:
            self.connections.strike(fd, self._last_frame)

    def _send_to(self, routing_id: bytes, payload: bytes) -> None:
        """Send on the socket the client came in on (CURVE clients' ids carry CURVE_TAG)."""
        if routing_id[:1] == CURVE_TAG:
            if self._curve_router is not None:
                self._curve_router.send_multipart([routing_id[1:], payload], zmq.NOBLOCK)
            return
        self._router.send_multipart([routing_id, payload], zmq.NOBLOCK)

    def _dispatch(self, routing_id: bytes, req) -> dict:
        handler = self._handlers.get(req.op)
        if handler is not None:
            return handler(routing_id, req)
        client = self.clients.get(routing_id)
        if client is None:
            raise OpError(ErrorCode.NOT_HELLO, f"{req.op.name.lower()} before hello")
        spec = OP_SPECS[req.op]
        kv = self.service.kv_for(client.client_id) if self.service is not None else None
        if spec.admin:
            check_admin(kv, client, req.op)
        if spec.needs_kv:
            check_kv_owner(kv, client, req.op)
        if req.op == Op.SHUTDOWN:
            return self._op_shutdown(routing_id, req)
        if self.stop_requested.is_set():
            raise OpError(ErrorCode.SHUTTING_DOWN, "the daemon is stopping")
        if req.op == Op.REGISTER_KV:
            self._reap_dead_clients()  # an engine that died a moment ago holds no registration
        if spec.blocking:  # a drain or storage I/O: the control worker replies when done
            engine = client.role == "operator" or (kv is not None and kv.owner == client.client_id)
            self.control.submit(routing_id, req.rid, lambda: self.service.handle(client, req),
                                ENGINES if engine else OTHERS)
            return DEFERRED
        return self.service.handle(client, req)

    # lifecycle ops --------------------------------------------------------
    def _op_status(self, routing_id: bytes, req) -> dict:
        # an invariant walk of the index and the host pool (tests, fuzzing); first, so that one
        # refused (BUSY: walked too often) costs no status snapshot
        walked = self.service.check() if req.body["check"] else None
        out = {"status": self.status(tcp_peer=routing_id[:1] == CURVE_TAG)}
        if walked is not None:
            out["check"] = walked
        return out

    def _op_hello(self, routing_id: bytes, req) -> dict:
        # A closed connection's fd may already be this new connection's: libzmq queues the
        # close's monitor event before the fd is closed, so it is readable now. Handle it
        # first, or it would be taken for this client's close.
        for mon in self._monitors:
            self._on_connection_events(mon)
        role = req.body["role"]
        if role == "operator" and routing_id[:1] == CURVE_TAG:
            raise OpError(ErrorCode.FORBIDDEN, "the operator role is for the ipc socket in the "
                          "run dir only, not for TCP clients")
        for rid_other, other in self.clients.items():
            if other.client_id == req.client and rid_other != routing_id:
                raise OpError(ErrorCode.CLIENT_ID_IN_USE,
                              f"client id {req.client!r} is in use by another connection "
                              f"(pid {other.pid}); every connection needs its own id")
        fd = self._last_fd
        if fd >= 0 and not self.connections.is_open(fd, self._last_frame):
            # shut at accept (past a cap) or closed since: no reply reaches it, and a client
            # registered for it would stay (its close is handled already, or its fd another's);
            # the client's hello goes again on its next connection
            raise OpError(ErrorCode.BUSY, "this connection was closed before its hello was handled")
        old = self.clients.get(routing_id)
        if old is not None and old.client_id != req.client:
            self.service.drop_client(old)
        self.clients[routing_id] = ClientInfo(
            req.client, routing_id, req.body["pid"], req.body["name"], time.monotonic_ns(),
            pid_visible=pid_alive(req.body["pid"]), fd=fd, role=role,
        )
        if fd >= 0:
            self._fd_clients[fd] = routing_id
        self._said.log(log, logging.INFO, "hello", "[handshake] client %s (pid %d %s, %s)", req.client,
                       req.body["pid"], req.body["name"], role)
        return {
            "daemon_version": __version__,
            "protocol_version": list(PROTOCOL_VERSION),
            "instance": self.cfg.instance,
            "epoch": self.status_block.epoch,
            "pid": os.getpid(),
            "device": self.cfg.device,
            "shm": self.status_block.name,
            "capabilities": self.service.capabilities(),
        }

    def _op_shutdown(self, routing_id: bytes, req) -> dict:
        log.info("[shutdown] requested by client %s", req.client)
        self.stop_requested.set()
        return {}

    def _op_bye(self, routing_id: bytes, req) -> dict:
        client = self.clients.pop(routing_id, None)
        if client is not None:
            self._said.log(log, logging.INFO, "bye", "[clients] client %s said bye", client.client_id)
            # its KV mapping goes with it: an engine that closes its client is done with the
            # memory, and a mapping nobody owns would pin it in the daemon
            self.service.drop_client(client, dead=True)
            if client.pid_visible:  # its KV segments go once its process has (vLLM kills its
                self._said_bye.add(client.pid)  # workers right after they said bye)
        return {}

    def _reap_dead_clients(self) -> None:
        for routing_id, client in list(self.clients.items()):
            if client.pid_visible and not pid_alive(client.pid):
                log.warning("[clients] client %s (pid %d) is gone; releasing its work",
                            client.client_id, client.pid)
                del self.clients[routing_id]
                self.service.drop_client(client, dead=True)
                sweep_kv_segments(client.pid)
        for pid in [p for p in self._said_bye if not pid_alive(p)]:
            self._said_bye.discard(pid)
            sweep_kv_segments(pid)
        for pid in [p for p in self._gone_pids if not pid_alive(p)]:
            self._gone_pids.discard(pid)
            sweep_kv_segments(pid)

    # status ---------------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        """GET /health on the metrics port (status_report.health): no lock, no snapshot."""
        sig = self.status_block
        return health(sig.state.name.lower() if sig else "stopping",
                      time.monotonic() - self._loop_turned, self.stop_requested.is_set(), LOOP_STALL_S)

    def status(self, tcp_peer: bool = False) -> dict:
        """The daemon's status; for a client on a CURVE socket, without the names and paths
        `for_tcp_peer` leaves out."""
        sig = self.status_block
        status = {
            "instance": self.cfg.instance, "pid": os.getpid(), "epoch": sig.epoch if sig else 0,
            "state": sig.state.name.lower() if sig else "stopping",
            "protocol_version": list(PROTOCOL_VERSION), "daemon_version": __version__,
            "uptime_s": round((time.monotonic_ns() - self.started_ns) / 1e9, 3),
            "device": self.cfg.device,
            "run_dir": self.cfg.run_dir,
            "clients": len(self.clients),
            "client_names": sorted(c.name or c.client_id for c in self.clients.values()),
            "connections": {**(self.connections.status() if self.connections else {}),
                            **({"auth_denied": self._auth.denied} if self._auth else {})},
            "requests": dict(self.requests),
            "heartbeat_max_gap_s": round(sig.max_gap_s, 3) if sig else 0.0,
            "heartbeat_late_beats": sig.late_beats if sig else 0,
            "log_lines_dropped": lines_dropped(),  # (stderr did not take them: logs.py)
        }
        if self.service is not None:
            status.update(self.service.status())
        if tcp_peer:
            status = for_tcp_peer(status)
        lag = time.monotonic() - self._loop_turned
        status["stalled"] = lag > LOOP_STALL_S and not self.stop_requested.is_set()
        status["degraded"] = degraded(status, lag)
        return status


def _rid_of(msg: dict) -> int:
    """A refused request's rid, when it got far enough to carry a valid one; else 0."""
    rid = msg.get("rid")
    return rid if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 2**64 else 0
