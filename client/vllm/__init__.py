"""vLLM's KV connector backed by kvcached (`kv_connector_module_path: kvcached_client.vllm`):
a thin adapter (connector.py) over the vLLM-free worker core (kvcached_client.kv_worker).
Importing it imports vLLM."""
from .connector import KvcachedConnector, KvcachedConnectorMetadata

__all__ = ["KvcachedConnector", "KvcachedConnectorMetadata"]
