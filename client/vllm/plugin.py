"""vLLM's general plugin (entry point `vllm.general_plugins: kvcached`): names
KvcachedConnector in vLLM's connector factory in every vLLM process.

vLLM finds a connector given with `kv_connector_module_path` by importing that module, and never
registers its name. Its MultiConnector, in the API server, rebuilds each sub-connector's stats
by name (`KVConnectorFactory.get_connector_class_by_name`): with kvcached inside a
MultiConnector and the name unknown there, the first stats to arrive raised, and the server
failed that request and every one after (seen with the OpenAI server). Registered, the name also
works without a module path (`"kv_connector": "KvcachedConnector"`)."""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)
NAME = "KvcachedConnector"


def register() -> None:
    """Register the connector by name, lazily: vLLM imports connector.py only when it asks
    for the class. vLLM calls this once per process; a second call (the package imported
    too) changes nothing. Never raises: a vLLM without this factory still finds the connector
    by its module path."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        KVConnectorFactory.register_connector(NAME, "kvcached_client.vllm.connector", NAME)
    except ValueError:  # registered already in this process
        pass
    except Exception as exc:  # noqa: BLE001 - a plugin must not stop vLLM from starting
        log.warning("[vllm] KvcachedConnector could not be named in vLLM's connector factory "
                    "(%s: %s); give kv_connector_module_path", type(exc).__name__, exc)
