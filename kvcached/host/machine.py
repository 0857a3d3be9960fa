"""What this machine can give the daemon, checked before it takes it: memory for the host
pool (an anonymous mapping over-commits and the OOM killer would end the daemon while it
touches its pages) and the GPU a CUDA daemon was asked for."""
from __future__ import annotations

import os

from ..errors import StartupError

MEMORY_MARGIN = 0.9  # the pool may take this share of what is available: the rest is the daemon's


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cgroup_available() -> int | None:
    """Room left under this process's cgroup memory limit (v2, else v1), None when unlimited."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                raw = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if raw == "max" or not raw.isdigit() or int(raw) >= 1 << 60:
            return None
        return max(0, int(raw) - usage)
    return None


def available_memory() -> tuple[int | None, str]:
    """Bytes this process can still take, and where the bound comes from."""
    found = [(n, why) for n, why in ((_meminfo_available(), "MemAvailable"),
                                     (_cgroup_available(), "the cgroup's memory limit"))
             if n is not None]
    return min(found) if found else (None, "")


def check_host_memory(nbytes: int, flag: str = "--host-cache-gb") -> None:
    avail, source = available_memory()
    if avail is None or nbytes <= avail * MEMORY_MARGIN:
        return
    raise StartupError(
        f"{flag} {nbytes / 2**30:g}: this machine can give {avail / 2**30:.1f} GiB now "
        f"({source}); the host pool may take at most {avail * MEMORY_MARGIN / 2**30:.1f} GiB of it")


def check_device(device: str) -> None:
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise StartupError(f"--device {device}: this machine's torch sees no CUDA device "
                           f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use --device cpu")
    index = torch.device(device).index or 0
    count = torch.cuda.device_count()
    if index >= count:
        raise StartupError(f"--device {device}: this machine's torch sees {count} CUDA "
                           f"device(s): cuda:0..cuda:{count - 1}")
