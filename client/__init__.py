"""kvcached_client: the thin engine-side client of the kvcached daemon."""
from kvcached_proto.errors import (
    Busy,
    DaemonStopping,
    DaemonUnavailable,
    KvcachedError,
    KvcachedTimeout,
    ProtocolError,
    RequestError,
    TaskFailed,
)

from .client import Client
from .group import GroupClient
from .hashing import BlockHasher, make_namespace, rank_keys
from .kv_alloc import allocate_kv_buffer, allocate_kv_cache
from .launch import DaemonHandle, launch
from .mm_keys import MMItem
from .prefix import NoFreeBlocks, PrefixCacheManager
from .reattach import Reattacher
from .tasks import LoadTask, Task

__all__ = [
    "Client", "BlockHasher", "make_namespace", "allocate_kv_cache", "allocate_kv_buffer", "launch", "DaemonHandle",
    "Task", "LoadTask", "GroupClient", "rank_keys", "PrefixCacheManager", "MMItem", "NoFreeBlocks", "Reattacher", "Busy", "DaemonStopping", "DaemonUnavailable", "KvcachedError", "KvcachedTimeout",
    "ProtocolError", "RequestError", "TaskFailed",
]
