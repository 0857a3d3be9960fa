"""Content keys for KV blocks: chained 16-byte blake2b digests, equal across processes.

key[i] = blake2b16(namespace_digest, key[i-1], tokens of block i, extra_keys[i]) with key[-1] =
16 zero bytes, so equal keys mean equal prefixes under the same namespace. `extra_keys[i]`
carries content hashes of images or videos whose tokens fall in block i.
"""
from __future__ import annotations

import hashlib
import logging
import os
from typing import Sequence

import numpy as np

from kvcached_proto.codec import KEY_BYTES  # one definition: the wire's
_ROOT = bytes(KEY_BYTES)
log = logging.getLogger(__name__)


def make_namespace(model: str, dtype: str, layout: str = "", tp_rank: int = 0, tp_size: int = 1,
                   tenant: str = "", weights_version: str = "") -> str:
    """The namespace string: model id, dtype, layout, tp rank/size, tenant salt, weights version.
    A weight update must change `weights_version` (or the tiers must be cleared)."""
    return "|".join([model, dtype, layout, f"tp{tp_rank}/{tp_size}", tenant, weights_version])


WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", "config.json")


def weights_identity(model: str, revision: str | None = None) -> str:
    """What names a checkpoint beyond its path: for a local directory a digest of its weight
    files' names, sizes and modification times (a new checkpoint written to the same directory
    gets other keys, so it is never served KV of the old weights); for a hub id the commit of
    the revision cached locally, else the revision asked for."""
    if os.path.isdir(model):
        entries = []
        for root, _, files in os.walk(model):
            for f in files:
                if f.endswith(WEIGHT_FILES):
                    st = os.stat(os.path.join(root, f))
                    entries.append(f"{os.path.relpath(os.path.join(root, f), model)}:{st.st_size}:"
                                   f"{st.st_mtime_ns}")
        return "files:" + short_digest("\n".join(sorted(entries)))
    try:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(model, "config.json", revision=revision)
        if isinstance(path, str):
            return "commit:" + os.path.basename(os.path.dirname(path))
    except Exception as exc:  # no hub library, or an id it cannot parse: the revision is all
        log.debug("[keys] no cached commit for %s: %s", model, str(exc))  # there is to go by
    return f"revision:{revision or 'main'}"


def short_digest(text: str) -> str:
    """8 bytes of blake2b in hex: a setting's part of a namespace (a config, a path's identity)."""
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


# Not bounded, on purpose: an entry dropped would be read again, and an adapter's files changed
# since would key the KV of the adapter vLLM still holds in memory under the new files. One
# entry per local model, drafter or adapter path the engine was given: a few hundred bytes each.
_identities: dict[str, str] = {}


def path_identity(path: str, fresh: bool = False) -> str:
    """A local directory's or file's identity, read once per process (as an engine reads it once,
    at start) unless `fresh` (the engine loads it again now: read again, and kept): a
    directory's weight files (`weights_identity`), a file's size and modification time; "" for
    a path that is neither (a hub id, an adapter held in memory)."""
    if fresh or path not in _identities:
        if os.path.isdir(path):
            ident = weights_identity(path)
        else:
            try:
                st = os.stat(path)
                ident = f"file:{st.st_size}:{st.st_mtime_ns}"
            except OSError:
                ident = ""
        _identities[path] = ident
    return _identities[path]


path_identity.cache_clear = _identities.clear  # what a process started later would read


def _encode_extra(extra) -> bytes:
    if extra is None:
        return b"\x00"
    items = [extra] if isinstance(extra, (bytes, str)) else list(extra)
    out = [b"\x01", len(items).to_bytes(4, "little")]
    for item in items:
        raw = item.encode() if isinstance(item, str) else bytes(item)
        out += [len(raw).to_bytes(4, "little"), raw]
    return b"".join(out)


def kernel_block_keys(keys: Sequence[bytes], factor: int) -> list[bytes]:
    """The keys of blocks an engine splits into `factor` kernel blocks each (vLLM's virtual block
    splitting): such a block's bytes are its kernel blocks one after another, which in a
    heads-outer layout (HNC) are not the bytes of the same block unsplit, so they live under
    keys of their own. A factor of 1 leaves the keys as they are."""
    if factor == 1:
        return list(keys)
    salt = f"kb{factor}".encode()[:16]
    return [hashlib.blake2b(bytes(k), digest_size=KEY_BYTES, person=b"kvcached-kb", salt=salt).digest()
            for k in keys]


def rank_keys(keys: Sequence[bytes], rank: int, tp_size: int) -> list[bytes]:
    """The keys rank `rank` of `tp_size` stores a block under (its shard of the heads)."""
    salt = f"tp{rank}/{tp_size}".encode()
    return [hashlib.blake2b(bytes(k), digest_size=KEY_BYTES, person=b"kvcached-tp", salt=salt[:16]).digest()
            for k in keys]


class BlockHasher:
    def __init__(self, namespace: str | bytes):
        raw = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
        self.namespace = namespace
        self._ns = hashlib.blake2b(raw, digest_size=32, person=b"kvcached-ns").digest()

    def hash_block(self, parent: bytes | None, tokens: Sequence[int] | np.ndarray, extra=None) -> bytes:
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvcached-blk")
        h.update(self._ns)
        h.update(parent if parent is not None else _ROOT)
        h.update(np.asarray(tokens, dtype="<i8").tobytes())
        h.update(_encode_extra(extra))
        return h.digest()

    def hash_blocks(self, token_ids: Sequence[int] | np.ndarray, block_size: int,
                    extra_keys: Sequence | None = None, parent: bytes | None = None) -> list[bytes]:
        """Keys of the full blocks of token_ids (a trailing partial block has no key)."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        tokens = np.asarray(token_ids, dtype=np.int64)
        n = len(tokens) // block_size
        if extra_keys is not None and len(extra_keys) < n:
            raise ValueError(f"extra_keys has {len(extra_keys)} entries for {n} blocks")
        keys, prev = [], parent
        for i in range(n):
            prev = self.hash_block(prev, tokens[i * block_size : (i + 1) * block_size],
                                   extra_keys[i] if extra_keys is not None else None)
            keys.append(prev)
        return keys
