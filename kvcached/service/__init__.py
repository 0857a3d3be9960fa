"""The cache service under the server: op handlers and load planning (cache_service.py), the host
tier, the storage flow, the task table and what the service reports."""
