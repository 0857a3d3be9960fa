"""What the disk tier may trust: directories and files owned by the daemon's uid that no other
user can write. A record in a directory another user can write could have been planted (its
checksum carries no secret and keys are predictable), so:

- the root must be the daemon's; one that group or others may write is made 0700 (with a
  warning), as the run dir is; one of another user is refused at start;
- a shard directory that is a link, or is not the daemon's, is removed (a link: its first put
  makes the directory) or left unused (another user's), with a warning; one of another mode
  than 0700 is made 0700;
- a record file of another owner is damage: removed at start, a miss when read.
"""
from __future__ import annotations

import logging
import os
import stat

log = logging.getLogger(__name__)

PRIVATE = 0o700


def is_ours(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid()


def secure_root(root: str, tighten: bool = True) -> tuple[int, int]:
    """Raise PermissionError for a root the daemon must not use; tighten one it may (a reader,
    tighten=False, which may see the writer's directory read-only: refuse one others may
    write). Its (device, inode): which directory the tier is on (disk_health.py checks it)."""
    st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{root} is not a directory")
    if not is_ours(st):
        raise PermissionError(f"{root} belongs to uid {st.st_uid}, not to this daemon's "
                              f"({os.geteuid()}): records another user can write are never served")
    if st.st_mode & 0o077 and not tighten:
        raise PermissionError(f"{root} is mode {stat.S_IMODE(st.st_mode):o}: another user could "
                              "plant records there (its writer makes it 0700)")
    if st.st_mode & 0o077:
        log.warning("[disk] %s was mode %o: another user could plant records there; made 0700",
                    root, stat.S_IMODE(st.st_mode))
        os.chmod(root, PRIVATE)
    return st.st_dev, st.st_ino


def usable_shard(path: str) -> bool:
    """Make the shard directory at path one the tier may use; False when it must stay unused.
    A missing one is left to its first put to make (disk_write.py): made here, all 256 of them
    took inodes a filesystem short of them needed for records, and a mkdir that failed (no
    inode, no byte left) failed the whole index rebuild."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        log.warning("[disk] %s is not a directory of its own (a link or a file): removed (its "
                    "first put makes the directory); records reached through it are not served",
                    path)
        os.unlink(path)
        return True
    if not is_ours(st):
        log.error("[disk] shard %s belongs to uid %d: left unused (no record in it is served or "
                  "written); remove it to use it again", path, st.st_uid)
        return False
    if stat.S_IMODE(st.st_mode) != PRIVATE:  # (0o000 or 0o500 too: the listing needs rwx)
        log.warning("[disk] shard %s was mode %o: made 0700", path, stat.S_IMODE(st.st_mode))
        os.chmod(path, PRIVATE)
    return True
