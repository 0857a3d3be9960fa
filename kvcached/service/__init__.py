"""The cache service under the server: op handlers, registration and drains (cache_service.py),
a load from plan to end (load_flow.py), an offload (offload_flow.py), the storage detour of both
(storage_flow.py), the host tier, the task table and what the service reports."""
