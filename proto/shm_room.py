"""Room in /dev/shm. A POSIX shared-memory segment is a file on a tmpfs, made sparse: its
pages are taken at their first write, and a write to a page the tmpfs has no room for is a
SIGBUS that kills the writer (Docker's default /dev/shm is 64 MiB). Every segment kvcached makes
takes its memory when it is made (`reserve`), so a /dev/shm without room is an error there,
with the size asked for and what is free, never a signal later."""
from __future__ import annotations

import os

from .paths import SHM_DIR

ADVICE = ("give the container a larger /dev/shm (docker run --shm-size=..., or --ipc host; "
          "Kubernetes: an emptyDir with medium Memory mounted there)")


class NoShmRoom(OSError):
    """posix_fallocate refused a segment's memory (ENOSPC, or a tmpfs limit)."""


def free_bytes() -> int:
    fs = os.statvfs(SHM_DIR)
    return fs.f_bavail * fs.f_frsize


def size_text(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def reserve(fd: int, nbytes: int, what: str) -> None:
    """Take the memory of the segment open as `fd` (its first nbytes) now; NoShmRoom names
    `what`, the size and what /dev/shm has free."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        raise NoShmRoom(exc.errno, f"/dev/shm has no room for {size_text(nbytes)} of {what} "
                                   f"({size_text(free_bytes())} free: {exc.strerror})") from None
