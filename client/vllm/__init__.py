"""vLLM's KV connector backed by kvcached (`kv_connector_module_path: kvcached_client.vllm`):
a thin adapter (connector.py) over the vLLM-free worker core (kvcached_client.kv_worker).
Importing the package names the connector in vLLM's connector factory (plugin.py, also vLLM's
`vllm.general_plugins` entry point); the connector itself (vLLM, torch) is imported when
first asked for."""
from .plugin import register

register()

_CONNECTOR = ("KvcachedConnector", "KvcachedConnectorMetadata")
__all__ = list(_CONNECTOR)


def __getattr__(name: str):
    if name in _CONNECTOR:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
