"""A FUSE filesystem with one regular file whose reads never return: a hung network filesystem
in place of one disk-tier record, made with the kernel's FUSE protocol over /dev/fuse (no
libfuse). It answers lookups, attributes, directory listings, opens and closes; a READ is held
until `release_reads()` answers it with EIO. With hang="readdir" the directory listing is held
instead (a slow index rebuild), until `release_listing()` answers it; with hang="lookup" every
lookup of a name (a stat, a mkdir under the root) until `release_reads()`, then EIO to those
and to every lookup after. Needs root (mount) and /dev/fuse.

    fs = HangFS(mountpoint, "0123...cdef.kvb", size)   # mounted; a thread serves it
    ...                                               # reads of the file block in the kernel
    fs.release_reads(); fs.close()                    # EIO to the held reads, unmounted

`die()` ends its server with the mount in place: a FUSE filesystem whose daemon was killed.
"""
from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import threading
import time

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, extlen, pad
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr (88 bytes)
ENTRY_OUT = struct.Struct("<QQQQII")  # nodeid, generation, entry/attr valid (+ nsec); then attr
ATTR_OUT = struct.Struct("<QII")  # attr_valid, attr_valid_nsec, dummy; then attr
OPEN_OUT = struct.Struct("<QIi")
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")
READ_IN = struct.Struct("<QQII")  # fh, offset, size, read_flags (the rest unused here)
DIRENT = struct.Struct("<QQII")  # ino, off, namelen, type
KSTATFS = struct.Struct("<QQQQQIIII24x")

LOOKUP, FORGET, GETATTR, OPEN, READ, STATFS, RELEASE, FLUSH, INIT = 1, 2, 3, 14, 15, 17, 18, 25, 26
OPENDIR, READDIR, RELEASEDIR, INTERRUPT, BATCH_FORGET = 27, 28, 29, 36, 42
NO_REPLY = {FORGET, INTERRUPT, BATCH_FORGET}
ROOT, FILE = 1, 2
VALID_S = 3600
MNT_DETACH = 2


def available() -> str:
    """'' when a HangFS can be mounted here, else why not."""
    if os.getuid() != 0:
        return "mounting FUSE needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return ""


class HangFS:
    def __init__(self, mountpoint: str, name: str, size: int, hang: str = "read"):
        self.mountpoint, self.name, self.size, self.hang = mountpoint, name.encode(), size, hang
        self.held_listings: list[tuple[int, bytes]] = []  # (unique, body) of READDIRs held
        self.held: list[int] = []  # unique ids of READs not answered
        self._released = False  # after release_reads(): every read fails at once
        self._unmounted = False
        self._lock = threading.Lock()
        self._now = int(time.time())
        self._fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        libc = ctypes.CDLL(None, use_errno=True)
        self._libc = libc
        opts = f"fd={self._fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()}"
        if libc.mount(b"hangfs", mountpoint.encode(), b"fuse.hangfs", 0, opts.encode()) != 0:
            err = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(err, f"mount of a FUSE filesystem failed: {os.strerror(err)}")
        self._thread = threading.Thread(target=self._serve, name="hangfs", daemon=True)
        self._thread.start()

    # serving ------------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            try:
                req = os.read(self._fd, (1 << 20) + 4096)
            except OSError as exc:
                if exc.errno in (errno.ENODEV, errno.EBADF, errno.ECONNABORTED):
                    return  # unmounted, closed, or the connection aborted
                if exc.errno in (errno.EINTR, errno.ENOENT, errno.EAGAIN):
                    continue  # a request interrupted before we read it
                raise
            if not req:
                return  # its fd closed (die())
            _len, opcode, unique, nodeid, *_ = IN_HEADER.unpack_from(req)
            body = req[IN_HEADER.size:]
            if opcode in NO_REPLY:
                continue
            if opcode == READDIR and self.hang == "readdir":
                with self._lock:
                    if not self._released:
                        self.held_listings.append((unique, body))
                        continue
            if opcode == LOOKUP and self.hang == "lookup":
                with self._lock:
                    if not self._released:
                        self.held.append(unique)  # a stat or mkdir of a name waits
                        continue
                self._reply(unique, -errno.EIO, b"")
                continue
            if opcode == READ and nodeid == FILE and self.hang == "read":
                with self._lock:
                    if not self._released:
                        self.held.append(unique)  # the reader waits until release_reads()
                        continue
            hung_read = opcode == READ and self.hang == "read"
            error, payload = (-errno.EIO, b"") if hung_read else self._answer(opcode, nodeid, body)
            self._reply(unique, error, payload)

    def _answer(self, opcode: int, nodeid: int, body: bytes) -> tuple[int, bytes]:
        if opcode == INIT:
            major, minor, readahead = struct.unpack_from("<III", body)
            return 0, INIT_OUT.pack(7, min(minor, 31), readahead, 0, 16, 12, 1 << 17, 1, 0, 0, 0, 0)
        if opcode == LOOKUP:
            if nodeid == ROOT and body.rstrip(b"\0") == self.name:
                return 0, ENTRY_OUT.pack(FILE, 0, VALID_S, VALID_S, 0, 0) + self._attr(FILE)
            return -errno.ENOENT, b""
        if opcode == GETATTR:
            return 0, ATTR_OUT.pack(VALID_S, 0, 0) + self._attr(nodeid)
        if opcode in (OPEN, OPENDIR):
            return 0, OPEN_OUT.pack(nodeid, 0, 0)
        if opcode == READDIR:
            return 0, self._listing(*READ_IN.unpack_from(body)[1:3])
        if opcode in (RELEASE, RELEASEDIR, FLUSH):
            return 0, b""
        if opcode == STATFS:
            return 0, KSTATFS.pack(1 << 20, 1 << 19, 1 << 19, 16, 8, 4096, 255, 4096, 0)
        return -errno.ENOSYS, b""

    def _attr(self, nodeid: int) -> bytes:
        if nodeid == FILE:
            mode, size, nlink = stat.S_IFREG | 0o600, self.size, 1
        else:
            mode, size, nlink = stat.S_IFDIR | 0o700, 0, 2
        t = self._now
        return ATTR.pack(nodeid, size, (size + 511) // 512, t, t, t, 0, 0, 0, mode, nlink,
                         os.getuid(), os.getgid(), 0, 4096, 0)

    def _listing(self, offset: int, size: int) -> bytes:
        entries = [(ROOT, b".", stat.S_IFDIR), (ROOT, b"..", stat.S_IFDIR), (FILE, self.name, stat.S_IFREG)]
        out = b""
        for i, (ino, name, kind) in enumerate(entries[offset:], start=offset + 1):
            rec = DIRENT.pack(ino, i, len(name), kind >> 12) + name
            rec += b"\0" * (-len(rec) % 8)
            if len(out) + len(rec) > size:
                break
            out += rec
        return out

    def _reply(self, unique: int, error: int, payload: bytes) -> None:
        try:
            os.write(self._fd, OUT_HEADER.pack(OUT_HEADER.size + len(payload), error, unique) + payload)
        except OSError as exc:
            # ENOENT: the request was interrupted meanwhile; ENODEV, EBADF: closed under us
            if exc.errno not in (errno.ENOENT, errno.ENODEV, errno.EBADF):
                raise

    # control ------------------------------------------------------------------------------
    def wait_held(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.held:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def release_listing(self) -> None:
        """Answer the held listings (and every later one) properly."""
        with self._lock:
            self._released = True
            held, self.held_listings = self.held_listings, []
        for unique, body in held:
            self._reply(unique, 0, self._listing(*READ_IN.unpack_from(body)[1:3]))

    def release_reads(self) -> None:
        """EIO to the held reads (lookups), and to every one from now on (the kernel retries)."""
        with self._lock:
            self._released = True
            held, self.held = self.held, []
        for unique in held:
            self._reply(unique, -errno.EIO, b"")

    def die(self) -> None:
        """Its server dies, the mount left in place (a FUSE daemon killed): every access to the
        mount fails (ENOTCONN, ECONNABORTED) until close() unmounts it."""
        self.release_listing()
        self.release_reads()
        fd, self._fd = self._fd, -1
        os.close(fd)
        self._thread.join(5)

    def close(self) -> None:
        """Unmounted (once: a second call would unmount what was mounted there since)."""
        if self._unmounted:
            return
        self._unmounted = True
        if self._fd >= 0:
            self.release_listing()
            self.release_reads()
        self._libc.umount2(self.mountpoint.encode(), MNT_DETACH)
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # aborts whatever the kernel still asks
        self._thread.join(5)
