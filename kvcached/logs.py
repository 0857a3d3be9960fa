"""Logging set-up for the daemon: text lines or one JSON object per line, stable [tags].

The daemon's threads never write the log themselves: a record goes into a bounded queue and a
thread of its own writes it to stderr (LogQueue). A stderr that does not take what it is given -
a pipe nobody reads, a container log driver that blocks - holds that thread alone: before, the
request thread blocked in its next log line and stopped answering every engine (a daemon started
with its stderr an unread pipe answered no hello after 13 sessions), and SIGTERM could not stop
it. Past QUEUE_RECORDS waiting, records are dropped and counted (status `log_lines_dropped`);
the next line written says how many went.
"""
from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time

QUEUE_RECORDS = 4096
FLUSH_S = 2.0  # at the stop: how long the writer may take to write what waits


def shown(text) -> str:
    """Words that may come from a client (its name, its layout's name) as a terminal or a log
    line may carry them: what is not printable escaped, so an escape sequence cannot drive the
    operator's terminal and a newline cannot forge a log line."""
    text = str(text)
    if text.isprintable():  # nearly every line: no per-character pass
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class TextFormatter(logging.Formatter):
    """A text line per record: its message printable (shown); a traceback follows as usual."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = shown(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                  + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class LineBudget:
    """At most `lines` log lines of one kind per `window_s` seconds; the rest are counted and
    said by the next line of that kind that goes out. What clients repeat - a hello, a bye, a
    message refused - is logged per occurrence, and one client doing it in a loop wrote 250 KB
    of log a second (7,464 hellos in 3 s): the operator's disk is not the clients' to fill.
    A kind may be a peer (a process, an address): past MAX_KINDS, those quiet for a window are
    forgotten, so peers that come and go hold no memory for ever."""

    MAX_KINDS = 4096

    def __init__(self, lines: int = 20, window_s: float = 10.0):
        self.lines, self.window_s = lines, window_s
        self._kinds: dict[str, list] = {}  # kind -> [window start, lines in it, not logged]

    def log(self, logger: logging.Logger, level: int, kind: str, msg: str, *args) -> None:
        now = time.monotonic()
        if kind not in self._kinds and len(self._kinds) >= self.MAX_KINDS:
            self._kinds = {k: v for k, v in self._kinds.items() if now - v[0] < self.window_s}
        state = self._kinds.setdefault(kind, [now, 0, 0])
        if now - state[0] >= self.window_s:
            state[0], state[1] = now, 0
        if state[1] >= self.lines:
            state[2] += 1
            return
        state[1] += 1
        if state[2]:
            msg, args = msg + " (%d more such lines not logged)", (*args, state[2])
            state[2] = 0
        logger.log(level, msg, *args)


class LogQueue(logging.Handler):
    """Formats a record in the logging thread and queues the line, never waiting; a writer
    thread takes the lines to the stream."""

    def __init__(self, stream=None, records: int = QUEUE_RECORDS):
        super().__init__()
        self.stream = stream if stream is not None else sys.stderr
        self.dropped = 0  # lines that found the queue full
        self._told = 0  # of them, said in the log
        self._lines: queue.Queue = queue.Queue(maxsize=records)
        self._writer = threading.Thread(target=self._write, name="kvcached-log", daemon=True)
        self._writer.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # noqa: BLE001 - a bad record is not the caller's failure
            self.handleError(record)
            return
        try:
            self._lines.put_nowait(line)
        except queue.Full:
            self.dropped += 1

    def _write(self) -> None:
        while True:
            line = self._lines.get()
            if line is None:
                return
            if self.dropped > self._told:
                gone, self._told = self.dropped - self._told, self.dropped
                line = f"[log] {gone} log lines dropped: stderr did not take them in time\n{line}"
            try:
                self.stream.write(line + "\n")
                self.stream.flush()
            except Exception:  # noqa: BLE001 - stderr closed or none: nothing to tell it
                pass

    def close(self) -> None:
        """Write what waits, for at most FLUSH_S (a stderr that takes nothing keeps it)."""
        try:
            self._lines.put(None, timeout=FLUSH_S)
        except queue.Full:
            pass
        self._writer.join(FLUSH_S)
        super().close()


def setup_logging(level: str, fmt: str) -> LogQueue:
    handler = LogQueue()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    return handler


def lines_dropped() -> int:
    """Log lines the daemon's LogQueue dropped (0 without one: an embedding's own logging)."""
    return sum(h.dropped for h in logging.getLogger().handlers if isinstance(h, LogQueue))
