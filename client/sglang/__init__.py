"""kvcached as SGLang HiCache's storage backend: `kvcached_client.sglang.KvcachedHiCacheStorage`
(storage.py), loaded by SGLang's dynamic backend factory. Needs SGLang importable."""
from .storage import KvcachedHiCacheStorage

__all__ = ["KvcachedHiCacheStorage"]
