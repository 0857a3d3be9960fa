"""`kvcached stop`: the shutdown op; for a daemon that cannot take it (hung, still starting, its
request socket not answering) SIGTERM, which takes the same way out (a graceful stop) once the
daemon runs again; for one already stopping, only the wait for its exit."""
from __future__ import annotations

import signal
import sys
import time

from kvcached_proto import DaemonStopping, DaemonUnavailable, KvcachedTimeout
from kvcached_proto.liveness import pid_alive
from kvcached_proto.shm_layout import State


def cmd_stop(args) -> int:
    from kvcached_client import Client

    try:
        with Client.connect(instance=args.instance, run_dir=args.run_dir, name="kvcached-cli",
                            role="operator") as c:
            pid = c.info["pid"]
            c.shutdown()
    except (DaemonUnavailable, KvcachedTimeout) as exc:
        pid = _without_the_op(args.instance, exc)
    deadline = time.monotonic() + args.timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            print(f"kvcached stop: pid {pid} still running after {args.timeout:g} s (--timeout); "
                  f"`kill -KILL {pid}` ends it now (its next start sweeps what it leaves)",
                  file=sys.stderr)
            return 1
        time.sleep(0.05)
    print(f"stopped instance {args.instance}" + (f" (pid {pid})" if pid else ""))
    return 0


def _without_the_op(instance: str, exc: Exception) -> int:
    """The pid of a daemon that runs but did not take the shutdown op, once it was sent
    SIGTERM (none when it is stopping already; 0 for one whose stop ended meanwhile); `exc`
    again for one that is not there or whose process cannot be told apart from a pid reused
    (another pid namespace, no pidfd)."""
    from kvcached_client.status_block import StatusReader

    try:
        reader = StatusReader(instance)
    except DaemonUnavailable:
        if isinstance(exc, DaemonStopping):
            return 0  # its stop ended meanwhile (its block unlinked)
        raise exc from None  # no daemon: what the connect said
    try:
        if reader.gone():
            raise exc
        pid = reader.pid
        if reader.pidfd < 0:  # the pid may not be the daemon's: neither signalled nor waited on
            raise DaemonUnavailable(f"{exc}; its process is not visible from here (another pid "
                                    "namespace?): stop it where it runs") from None
        if isinstance(exc, DaemonStopping) or reader.view.state == State.STOPPING:
            print(f"kvcached stop: instance {instance} (pid {pid}) is stopping already: "
                  "waiting for its exit", file=sys.stderr)
            return pid
        try:
            signal.pidfd_send_signal(reader.pidfd, signal.SIGTERM)  # this process, not a reuse
        except ProcessLookupError:  # it exited meanwhile
            return pid
        print(f"kvcached stop: {exc}: sent it SIGTERM (it stops gracefully once it runs again; "
              "one still starting ends at once)", file=sys.stderr)
        return pid
    finally:
        reader.close()
