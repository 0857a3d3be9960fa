"""Daemon-only exceptions (wire-visible errors live in kvcached_proto.errors)."""
from kvcached_proto.errors import KvcachedError


class StartupError(KvcachedError):
    """The daemon cannot start (instance already running, bad run dir, bad flag value)."""


class OpError(KvcachedError):
    """A request that the daemon refuses; becomes an error reply with this code."""

    def __init__(self, code, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
