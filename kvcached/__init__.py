"""kvcached: a per-GPU KV-cache sidecar daemon for LLM inference engines."""
__version__ = "0.1.0"
