"""Benchmarks: each prints a ratio against a raw baseline measured in the same run."""
from __future__ import annotations

import importlib
import socket
import threading

BENCHES = ("ipc", "transfer", "storage", "disk_index", "faults", "all")


def run(what: str, **kwargs) -> dict:
    return importlib.import_module(f"kvcached.bench.{what}").run(**kwargs)


def format_result(result: dict) -> str:
    return importlib.import_module(f"kvcached.bench.{result['bench']}").format_result(result)


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (a daemon's --listen or --metrics-port, a server's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_line(proc, what: str, timeout_s: float = 60.0) -> str:
    """The next line `proc` (a helper started with stdout=PIPE, text=True) prints, stripped;
    a helper silent for `timeout_s` is killed and named (a hung helper never hangs the bench)."""
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if reader.is_alive():
        proc.kill()  # its pipe closes: the reading thread ends
        raise RuntimeError(f"{what} said nothing within {timeout_s:g} s")
    return line[0].strip() if line else ""  # (the read itself failed: nothing said)


def expect_line(proc, word: str, what: str, timeout_s: float = 60.0) -> None:
    """`proc`'s next line is `word` (e.g. "ready"), else a RuntimeError naming `what`."""
    got = read_line(proc, what, timeout_s)
    if got != word:
        raise RuntimeError(f"{what} did not start (it said {got!r}, not {word!r})")
