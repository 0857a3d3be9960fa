"""The protocol version: one place, separate from the package version.

Major changes break compatibility (a daemon refuses a different major); minor changes add
optional fields or ops only.
"""
PROTOCOL_VERSION = (1, 6)
# The oldest version of this major either side talks to: a daemon refuses requests of an older
# minor, a client refuses a daemon whose hello says an older one (nothing of the minors before
# it is kept: 1.3's per-tensor registration entries, 1.5 clients that never send host_only).
PROTOCOL_FLOOR = (1, 6)
