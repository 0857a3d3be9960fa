"""An engine in a child process for the GPU kill tests: a hung CUDA call cannot be interrupted,
so the test bounds the child instead and says what hung."""
from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import sweep_crashed


def run_engine(code: str, instance: str, timeout: float, hung: str) -> str:
    """Run `code` in a child python; its output (stdout and stderr). Killed and failed with
    `hung` past `timeout` s; the daemon `instance` leaves no segment behind either way."""
    engine = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = engine.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        engine.kill()
        out, _ = engine.communicate()
        pytest.fail(f"{hung}:\n" + out[-3000:])
    finally:
        sweep_crashed(instance)
    return out
