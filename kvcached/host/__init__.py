"""The host tier's parts: the pinned pool and its pin plan, the CUDA runtime calls it needs, NUMA
placement, the block index and its eviction policies, and what this machine can give."""
