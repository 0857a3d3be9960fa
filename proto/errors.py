"""Typed exceptions shared by the daemon and the client."""
from __future__ import annotations

from .ops import ErrorCode


class KvcachedError(Exception):
    """Base class of every error this project raises on purpose."""


class CodedError(KvcachedError):
    """An error that carries the code of the error reply it becomes (`messages.reply_for`)."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{ErrorCode(code).name}: {message}")
        self.code = ErrorCode(code)
        self.message = message


class ProtocolError(CodedError):
    """A frame or field that breaks the wire protocol."""


class RequestError(KvcachedError):
    """The daemon answered a request with an error."""

    def __init__(self, code: int, message: str):
        try:
            name = ErrorCode(code).name
        except ValueError:
            name = f"code {code}"
        super().__init__(f"{name}: {message}")
        self.code = code
        self.message = message


class Busy(RequestError):
    """The daemon's queues are full; the request changed nothing and may be retried."""


class DaemonUnavailable(KvcachedError):
    """The daemon is not running, died, or stopped answering."""


class DaemonStopping(DaemonUnavailable):
    """The daemon is stopping gracefully: it answers no request, but runs the tasks queued
    before its stop and sends their ends (a wait for one of them goes on)."""


class KvcachedTimeout(KvcachedError, TimeoutError):
    """A wait ran past its timeout; the message names the knob that sets it."""


class TaskFailed(KvcachedError):
    """A task ended in failure; `result` holds what the daemon reported (e.g. blocks valid)."""

    def __init__(self, message: str, result: dict | None = None):
        super().__init__(message)
        self.result = result or {}


def request_error(code: int, message: str) -> RequestError:
    cls = Busy if code == ErrorCode.BUSY else RequestError
    return cls(code, message)
