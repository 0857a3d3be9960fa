"""A Client does not cross a fork.

The child of a fork inherits the Client's zmq socket, but not the I/O thread of the socket's
context, which stayed in the parent: a request from the child waited forever (its zmq_poll never
returned, whatever the timeout), so an engine's forked worker that used the client it inherited
hung. And the finalizers a child inherits ran in the child: one that garbage-collected the
inherited KV tensors, or exited through the interpreter, unlinked the parent's KV segments.

In a child, every call that would reach the daemon raises DaemonUnavailable at once (an engine
goes on without the cache, as for a daemon that is gone), and close() lets go of the child's own
copies only: no bye, no segment unlinked. A child connects a Client of its own.
"""
from __future__ import annotations

import os

from kvcached_proto import DaemonUnavailable

_pid = [os.getpid()]


def _forked() -> None:
    _pid[0] = os.getpid()


os.register_at_fork(after_in_child=_forked)


def current_pid() -> int:
    """This process's pid, kept across forks (no system call)."""
    return _pid[0]


def check_not_forked(owner: int) -> None:
    """DaemonUnavailable in a forked child of the process `owner`, which made the caller."""
    if _pid[0] != owner:
        raise DaemonUnavailable(
            f"this Client was made in process {owner} and this is a child it forked ({_pid[0]}): "
            "a Client does not cross a fork (its socket's I/O thread stayed in the parent); "
            "connect a Client in this process")
