"""Benchmarks: each prints a ratio against a raw baseline measured in the same run."""
from __future__ import annotations

import importlib

BENCHES = ("ipc", "transfer", "storage", "disk_index", "faults", "all")


def run(what: str, **kwargs) -> dict:
    return importlib.import_module(f"kvcached.bench.{what}").run(**kwargs)


def format_result(result: dict) -> str:
    return importlib.import_module(f"kvcached.bench.{result['bench']}").format_result(result)
