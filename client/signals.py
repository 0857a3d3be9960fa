"""The earlier name of status_block.py (the shared-memory status block reader), kept so that
`from kvcached_client.signals import ...` goes on working."""
from .status_block import *  # noqa: F401,F403
from .status_block import DEFAULT_HANG_S, HANG_ENV, HEARTBEAT_STALE_S, SignalReader, hang_threshold  # noqa: F401
