"""Benchmarks: each prints a ratio against a raw baseline measured in the same run."""
from __future__ import annotations

import importlib
import socket

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
