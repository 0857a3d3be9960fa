"""Daemon-only exceptions (wire-visible errors live in kvcached_proto.errors)."""
from kvcached_proto.errors import CodedError, KvcachedError


class StartupError(KvcachedError):
    """The daemon cannot start (instance already running, bad run dir, bad flag value)."""


class OpError(CodedError):
    """A request that the daemon refuses; becomes an error reply with this code."""
