"""Daemon configuration: one dataclass, validated once, built from CLI flags."""
from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

from kvcached_proto.paths import check_instance, resolve_run_dir

from .errors import StartupError

HOST_LAYOUTS = ("layer_first", "page_first")
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass
class DaemonConfig:
    instance: str = "default"
    run_dir: str = ""
    device: str = "cpu"
    host_cache_gb: float = 1.0
    host_layout: str = "layer_first"
    eviction: str = "lru"
    numa: str = "auto"
    listen: list[str] = field(default_factory=list)
    max_queued_tasks: int = 4096
    copy_threads: int = 0  # 0: half the cores (at least 1, at most 4), the rest stay the engine's
    log_level: str = "INFO"

    def validate(self) -> "DaemonConfig":
        try:
            check_instance(self.instance)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        self.run_dir = resolve_run_dir(self.run_dir or None)
        if not _DEVICE_RE.match(self.device):
            raise StartupError(f"--device {self.device!r}: expected cpu or cuda:N")
        if not 0 < self.host_cache_gb <= 4096:
            raise StartupError(f"--host-cache-gb {self.host_cache_gb}: expected a size in (0, 4096]")
        if self.host_layout not in HOST_LAYOUTS:
            raise StartupError(f"--host-layout {self.host_layout!r}: expected one of {HOST_LAYOUTS}")
        if self.numa not in ("auto", "off") and not self.numa.isdigit():
            raise StartupError(f"--numa {self.numa!r}: expected auto, off or a node number")
        if self.copy_threads < 0 or self.copy_threads > 256:
            raise StartupError(f"--copy-threads {self.copy_threads}: expected 0..256")
        if self.copy_threads == 0:
            self.copy_threads = max(1, min(4, (os.cpu_count() or 2) // 2))
        if self.max_queued_tasks < 1:
            raise StartupError("--max-queued-tasks must be >= 1")
        for endpoint in self.listen:
            check_listen(endpoint)
        return self

    @property
    def host_cache_bytes(self) -> int:
        return int(self.host_cache_gb * (1 << 30))

    def as_dict(self) -> dict:
        return asdict(self)


def check_listen(endpoint: str) -> None:
    """Only loopback TCP is allowed without CURVE keys."""
    url = urlparse(endpoint)
    if url.scheme != "tcp" or not url.hostname or url.port is None:
        raise StartupError(f"--listen {endpoint!r}: expected tcp://127.0.0.1:PORT")
    try:
        loopback = ipaddress.ip_address(url.hostname).is_loopback
    except ValueError:
        loopback = url.hostname == "localhost"
    if not loopback:
        raise StartupError(
            f"--listen {endpoint!r}: non-loopback addresses need CURVE keys, which this build "
            "does not enable; bind to 127.0.0.1 or use the ipc:// socket in the run dir"
        )


def prepare_run_dir(path: str) -> None:
    """Create the run dir 0700, or check that an existing one is ours and private."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise StartupError(f"run dir {path} belongs to uid {st.st_uid}, not to us ({os.getuid()})")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
