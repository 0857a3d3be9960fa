"""Small statistics helpers shared by the benchmarks."""
from __future__ import annotations

import numpy as np


def percentiles_us(samples_s) -> dict:
    arr = np.asarray(samples_s) * 1e6
    return {"p50_us": round(float(np.percentile(arr, 50)), 2),
            "p99_us": round(float(np.percentile(arr, 99)), 2), "n": int(arr.size)}


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("inf")
