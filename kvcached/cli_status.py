"""`kvcached status`: the status socket asked, or why no daemon answers - none runs (its lock
not held), it is starting (its lock held, no status socket yet: exit 5, not "no daemon"), it is
stopping, or its status socket file was removed and did not come back (a running daemon binds it
again about once a second: waited for that long, three times over)."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import zmq

from kvcached_proto import DaemonUnavailable, KvcachedError, Op, decode, encode, make_request
from kvcached_proto.paths import resolve_run_dir, status_endpoint

from .server.instance_files import CHECK_EVERY_S
from .server.status_report import format_status

SOCKET_BACK_S = 3 * CHECK_EVERY_S  # how long a removed status socket file is waited for


def cmd_status(args) -> int:
    stop: list[bool] = []
    if args.watch:  # Ctrl-C ends the watch between two refreshes, never inside a socket call
        signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    try:
        return _status_loop(args, stop)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `status --watch | head`: the reader is done, and so are we
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _status_loop(args, stop: list[bool]) -> int:
    said = ""  # (a watch says a start once, not at every refresh)
    while not stop:
        try:
            s = fetch_status(args.instance, args.run_dir, args.timeout)
        except DaemonStarting as exc:
            if str(exc) != said:
                print(f"kvcached status: {exc}", file=sys.stderr, flush=True)
            if not args.watch:
                return 5
            s, said = None, str(exc)
        except DaemonUnavailable as exc:
            print(f"kvcached status: {exc}", file=sys.stderr)
            return 3
        if args.watch and s is not None:
            print("\033[2J\033[H" + time.strftime("%H:%M:%S"), flush=False)
        if s is not None:
            print(json.dumps(s, indent=2, sort_keys=True) if args.json else format_status(s), flush=True)
        if not args.watch:
            return 4 if s.get("stalled") else 0
        until = time.monotonic() + args.watch
        while not stop and time.monotonic() < until:
            time.sleep(min(0.05, args.watch))
    return 0


def fetch_status(instance: str, run_dir: str | None, timeout: float) -> dict:
    """Ask the status socket. Raises DaemonUnavailable at once when no daemon of that name
    runs (no socket, or its process is gone), else when nobody answers in time."""
    run_dir = resolve_run_dir(run_dir)
    _check_running(instance, run_dir)
    endpoint = status_endpoint(run_dir, instance)
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(encode(make_request(Op.STATUS, 1, "kvcached-cli")))
        if not sock.poll(int(timeout * 1000)):
            raise DaemonUnavailable(f"daemon {instance!r} did not answer at {endpoint} within "
                                    f"{timeout} s (--timeout)")
        reply = decode(sock.recv())
    finally:
        sock.close(linger=0)
    if not reply.get("ok"):
        raise KvcachedError(f"status failed: {reply.get('error')}")
    return reply["status"]


class StatusSocketGone(DaemonUnavailable):
    """The instance's daemon runs but its status socket file is not there (removed from the
    run dir while it ran) and did not come back."""


class DaemonStarting(DaemonUnavailable):
    """The instance's daemon lives but has not bound its status socket yet (it allocates and
    pins its host pool first: up to minutes for tens of GiB)."""


def _check_running(instance: str, run_dir: str) -> None:
    """A daemon holds its instance lock (flock) while it lives; the kernel drops it when the
    process dies, however it died - unlike its pid, which another pid namespace cannot see,
    and its heartbeat, fresh for seconds after a kill -9."""
    from kvcached_proto.paths import socket_paths

    held = _lock_held(run_dir, instance)
    path = socket_paths(run_dir, instance)[1]
    if not os.path.exists(path):
        if held:  # before its status socket (starting), after it (stopping), or its file removed
            exc = _starting_or_stopping(instance)
            if not isinstance(exc, StatusSocketGone) or not _bound_again(path):
                raise exc
            return
        raise DaemonUnavailable(f"no daemon {instance!r} is running in {run_dir} (no status socket)")
    if held is None:
        raise DaemonUnavailable(f"no daemon {instance!r} is running in {run_dir} (no instance "
                                "lock; its sockets are left from a daemon that died)")
    if not held:
        raise DaemonUnavailable(f"no daemon {instance!r} is running in {run_dir} (its process is "
                                "gone; its files are left from a daemon that died)")


def _lock_held(run_dir: str, instance: str) -> bool | None:
    """Whether a process holds the instance's lock; None when there is no lock file."""
    import fcntl

    from kvcached_proto.paths import lock_path

    try:
        fd = os.open(lock_path(run_dir, instance),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True  # held: the daemon lives
    finally:
        os.close(fd)  # drops a shared lock we may have taken
    return False


def _starting_or_stopping(instance: str) -> DaemonUnavailable:
    """What a live daemon without its status socket is doing, from its status block."""
    from kvcached_client.status_block import StatusReader
    from kvcached_proto.shm_layout import State

    try:
        reader = StatusReader(instance)
    except DaemonUnavailable:  # its block not made yet, or unlinked already by its stop
        return DaemonUnavailable(f"daemon {instance!r} holds its lock but has no status socket "
                                 "(starting or stopping)")
    try:
        pid, state = reader.pid, reader.view.state
    finally:
        reader.close()
    if state == State.STARTING:
        return DaemonStarting(f"daemon {instance!r} (pid {pid}) is starting: no status socket "
                              "yet (its host pool is being allocated and pinned)")
    if state == State.STOPPING:
        return DaemonUnavailable(f"daemon {instance!r} (pid {pid}) is stopping: its sockets are closed")
    return StatusSocketGone(f"daemon {instance!r} (pid {pid}) runs ({state.name.lower()}) but its "
                            "status socket file is gone (removed by hand?) and was not bound again "
                            f"within {SOCKET_BACK_S:g} s (the daemon binds it again about once a "
                            "second): its status thread may be stuck; see the daemon's log")


def _bound_again(path: str) -> bool:
    """The status socket's file back within SOCKET_BACK_S: a running daemon's status thread
    binds it again about once a second (kvcached/server/status.py)."""
    deadline = time.monotonic() + SOCKET_BACK_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if os.path.exists(path):
            return True
    return False
