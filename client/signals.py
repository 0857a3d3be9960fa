"""The earlier name of status_block.py (the shared-memory status block reader). Importing it
still works and warns: `kvcached_client.status_block` (StatusReader, once SignalReader)."""
import warnings

from .status_block import *  # noqa: F401,F403
from .status_block import DEFAULT_HANG_S, HANG_ENV, HEARTBEAT_STALE_S, StatusReader, hang_threshold  # noqa: F401

SignalReader = StatusReader
warnings.warn("kvcached_client.signals is kvcached_client.status_block now (SignalReader is StatusReader)",
              DeprecationWarning, stacklevel=2)
