"""A trace's block hash ids as kvcached keys (shared by the replay and the offline policies)."""


def block_key(hash_id: int) -> bytes:
    return hash_id.to_bytes(16, "little", signed=False)
