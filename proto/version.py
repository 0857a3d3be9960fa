"""The protocol version: one place, separate from the package version.

Major changes break compatibility (a daemon refuses a different major); minor changes add
optional fields or ops only.
"""
PROTOCOL_VERSION = (1, 6)
