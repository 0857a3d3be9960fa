"""The protocol version: one place, separate from the package version.

Major changes break compatibility (a daemon refuses a different major); minor changes add
optional fields or ops only.
"""
PROTOCOL_VERSION = (1, 15)
# The oldest version of this major either side talks to: a daemon refuses requests of an older
# minor, a client refuses a daemon whose hello says an older one (nothing of the minors before
# it is kept: 1.3's per-tensor registration entries, 1.5 clients that never send host_only).
PROTOCOL_FLOOR = (1, 6)


def check_version(theirs, speaker: str) -> None:
    """ProtocolError UNSUPPORTED_VERSION unless `theirs` ([major, minor], what `speaker` - "client"
    or "the daemon" - speaks) is of this major and not below the floor."""
    theirs = tuple(theirs)
    if theirs[:1] != PROTOCOL_VERSION[:1] or theirs < PROTOCOL_FLOOR:
        from .errors import ProtocolError  # here: every request checks, few fail (and no cycle)
        from .ops import ErrorCode

        ours = f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}"
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"{speaker} speaks protocol {'.'.join(map(str, theirs))}, "
            f"{'the daemon' if speaker == 'client' else 'this client'} speaks {ours} and talks to "
            f"{PROTOCOL_FLOOR[0]}.{PROTOCOL_FLOOR[1]} or later of it; upgrade the older side")
