"""Daemon configuration: one dataclass, validated once (sources: config_sources.py)."""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

from kvcached_proto.paths import check_instance, resolve_run_dir

from .errors import StartupError
from .storage.tiers import WRITE_POLICIES

HOST_LAYOUTS = ("layer_first", "page_first")
# how blocks move (copy/strategies.py, copy/cuda_copier.py); named here, where no torch is imported,
# so that checking a flag does not cost torch's import
COPY_STRATEGIES = ("auto", "numpy", "native", "runs", "gather", "zero_copy", "dma")
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
    curve_secret_key_file: str = ""  # ZMQ CURVE: the daemon's key pair (zmq.auth certificate)
    curve_allow_dir: str = ""        # public keys (*.key certificates) of the allowed clients
    max_queued_tasks: int = 4096
    max_connections: int = 1024  # per request socket; bounded by the open-files limit
    max_connections_per_peer: int = 64  # per process (ipc) or address (TCP)
    storage: list[str] = field(default_factory=list)
    storage_write_policy: str = "write_through"
    storage_writer: bool = True
    selective_hits: int = 2
    prefetch_threshold_tokens: int = 256
    prefetch_max_share: float = 0.5
    copy_threads: int = 0  # 0: half the cores (at least 1, at most 4), the rest stay the engine's
    copy_strategy: str = "auto"  # one of COPY_STRATEGIES
    dma_threads: int = 1  # dma: threads that queue a layer's copies, each on a stream of its own
    metrics_port: int = 0  # 0: no /metrics endpoint
    metrics_addr: str = "127.0.0.1"
    log_level: str = "INFO"
    log_format: str = "text"
    stats_interval_s: float = 60.0

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
        from .host.policies import POLICIES

        if self.eviction not in POLICIES:
            raise StartupError(f"eviction {self.eviction!r}: expected one of {sorted(POLICIES)}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise StartupError(f"log_level {self.log_level!r}: expected DEBUG, INFO, WARNING or ERROR")
        if self.log_format not in ("text", "json"):
            raise StartupError(f"log_format {self.log_format!r}: expected text or json")
        if not 0 <= self.metrics_port <= 65535:
            raise StartupError(f"metrics_port {self.metrics_port}: expected 0..65535")
        if self.stats_interval_s <= 0:
            raise StartupError(f"stats_interval_s {self.stats_interval_s}: expected > 0")
        if self.copy_threads < 0 or self.copy_threads > 256:
            raise StartupError(f"--copy-threads {self.copy_threads}: expected 0..256")
        if self.copy_threads == 0:
            self.copy_threads = max(1, min(4, (os.cpu_count() or 2) // 2))
        if self.copy_strategy not in COPY_STRATEGIES:
            raise StartupError(f"--copy-strategy {self.copy_strategy!r}: expected one of {COPY_STRATEGIES}")
        if self.copy_strategy in ("numpy", "native") and self.device != "cpu":
            raise StartupError(f"--copy-strategy {self.copy_strategy} moves CPU KV only; a CUDA "
                               "daemon takes auto, runs, gather, zero_copy or dma")
        if not 1 <= self.dma_threads <= 8:
            raise StartupError(f"--dma-threads {self.dma_threads}: expected 1..8")
        if self.dma_threads > 1 and self.copy_strategy != "dma":
            raise StartupError(f"--dma-threads {self.dma_threads} splits the copies of --copy-strategy "
                               f"dma only (this daemon's is {self.copy_strategy})")
        if self.max_queued_tasks < 1:
            raise StartupError("--max-queued-tasks must be >= 1")
        if self.max_connections < 1 or self.max_connections_per_peer < 1:
            raise StartupError("--max-connections and --max-connections-per-peer must be >= 1")
        if self.storage_write_policy not in WRITE_POLICIES:
            raise StartupError(f"--storage-write-policy {self.storage_write_policy!r}: "
                               f"expected one of {WRITE_POLICIES}")
        if not 0 < self.prefetch_max_share <= 1:
            raise StartupError(f"--prefetch-max-share {self.prefetch_max_share}: expected (0, 1]")
        if self.prefetch_threshold_tokens < 0 or self.selective_hits < 1:
            raise StartupError("--prefetch-threshold-tokens must be >= 0, --selective-hits >= 1")
        for uri in self.storage:
            check_storage_uri(uri)
        self._check_curve()
        for endpoint in self.listen:
            check_listen(endpoint, curve=bool(self.curve_secret_key_file))
        return self

    def _check_curve(self) -> None:
        if bool(self.curve_secret_key_file) != bool(self.curve_allow_dir):
            raise StartupError("--curve-secret-key-file and --curve-allow-dir go together: the "
                               "daemon's keys and the public keys of the clients it lets in")
        if not self.curve_secret_key_file:
            return
        if not self.listen:
            raise StartupError("CURVE keys given but no --listen tcp:// endpoint to use them on")
        if not os.path.isfile(self.curve_secret_key_file):
            raise StartupError(f"--curve-secret-key-file {self.curve_secret_key_file}: no such file")
        if os.stat(self.curve_secret_key_file).st_mode & 0o077:
            raise StartupError(f"--curve-secret-key-file {self.curve_secret_key_file}: readable by "
                               "group or others; chmod 600 it")
        if not os.path.isdir(self.curve_allow_dir):
            raise StartupError(f"--curve-allow-dir {self.curve_allow_dir}: no such directory")

    @property
    def host_cache_bytes(self) -> int:
        return int(self.host_cache_gb * (1 << 30))

    def as_dict(self) -> dict:
        return asdict(self)


def check_storage_uri(uri: str) -> None:
    """The URI's form and options, without touching the store (that happens at start)."""
    from .storage.tiers import parse_uri

    try:
        parse_uri(uri)
    except ValueError as exc:
        raise StartupError(f"--storage {exc}") from None


def check_listen(endpoint: str, curve: bool = False) -> None:
    """TCP only with CURVE keys, loopback included: any local user can reach a loopback port,
    and the private ipc socket in the run dir is there for same-user clients."""
    url = urlparse(endpoint)
    try:
        port = url.port
    except ValueError:
        port = None
    if url.scheme != "tcp" or not url.hostname or port is None:
        raise StartupError(f"--listen {endpoint!r}: expected tcp://ADDRESS:PORT with a port "
                           "number in 1..65535")
    if not curve:
        raise StartupError(
            f"--listen {endpoint!r}: TCP needs CURVE keys (--curve-secret-key-file and "
            "--curve-allow-dir; `kvcached keygen` makes them), loopback included: any local "
            "user can connect to a loopback port. Same-user clients use the ipc:// socket in "
            "the run dir, which needs no --listen")
