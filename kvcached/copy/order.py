"""The daemon's half of the order words (kvcached_proto.order_words): the engine's segment,
mapped guarded by KVRegistration, and the waits and writes the copiers queue on it.

- a copy's stream waits for the fence the request carries (fence_word >= fence) before its
  first copy: on CUDA a stream memory wait; on CPU the engine wrote the word before it sent
  the request, so the request is refused if it did not;
- after layer i of a load, the load's task id goes into the slot's progress word (CUDA: a
  stream write after the layer's copies; CPU: a store) before the slot's counter moves;
- when the engine died, `release_fences` writes RELEASED into every fence word, so a copy
  stream waiting for a fence the engine will never write goes on (its tasks are cancelled:
  nothing they copied is kept).
"""
from __future__ import annotations

import numpy as np

from kvcached_proto import ErrorCode
from kvcached_proto.order_words import FENCE_WORDS, RELEASED, load_word, reached

from ..errors import OpError


def _cuda_ops(device: str, address: int, nbytes: int):
    import torch

    from kvcached_proto.stream_ops import StreamOps

    with torch.cuda.device(torch.device(device)):
        return StreamOps(address, nbytes)


class DaemonOrder:
    def __init__(self, words: np.ndarray, num_layers: int, device: str,
                 revoke_word: int | None = None, ops_factory=None,
                 load_revoke_word: int | None = None):
        """device: this process's name of the KV's GPU (cuda:N found by its UUID, not the
        engine's ordinal). ops_factory(device, address, nbytes): the stream operations (a test
        passes a recording one; default: the CUDA driver's)."""
        self.words = words
        self.num_layers = num_layers
        self.revoke_word = revoke_word
        self.load_revoke_word = load_revoke_word
        self.ops = None
        if device.startswith("cuda"):
            try:
                self.ops = (ops_factory or _cuda_ops)(device, words.ctypes.data, words.nbytes)
            except (OSError, RuntimeError) as exc:  # StreamOpsError; an ordinal CUDA refuses
                raise OpError(ErrorCode.KV_MISMATCH, f"order_segment: could not register it "
                              f"with CUDA on {device} ({exc})") from None

    def check_fence(self, fence_word: int, fence: int) -> tuple[int, int] | None:
        """Validate a request's fence; None when it carries none (fence 0)."""
        if fence == 0:
            return None
        if not 0 <= fence_word < FENCE_WORDS:
            raise OpError(ErrorCode.BAD_FIELD, f"fence_word: {fence_word} outside [0, {FENCE_WORDS})")
        if fence_word in (self.revoke_word, self.load_revoke_word):
            raise OpError(ErrorCode.BAD_FIELD, f"fence_word: {fence_word} is this registration's "
                          "revoke word, not a fence word")
        if self.ops is None and not reached(self.words[fence_word], fence):
            raise OpError(ErrorCode.BAD_FIELD, f"fence: word {fence_word} holds "
                          f"{int(self.words[fence_word])}, not {fence}: the engine did not write it")
        return fence_word, fence

    def wait(self, stream, fence: tuple[int, int] | None) -> None:
        if fence is not None and self.ops is not None:
            self.ops.wait_geq(stream.cuda_stream, fence[0], fence[1])

    def loaded(self, stream, slot: int, layer: int, task_id: int) -> None:
        idx = load_word(slot, layer, self.num_layers)
        if self.ops is None:
            self.words[idx] = task_id
        else:
            self.ops.write(stream.cuda_stream, idx, task_id)

    def revoked(self, fence: tuple[int, int] | None) -> bool:
        """The engine revoked the offload sent with this fence (it reused the blocks before the
        task ended): what was copied may be another request's KV. Read after the copies landed
        (copier.sync). An offload sent without a fence cannot be revoked."""
        return (self.revoke_word is not None and fence is not None
                and reached(self.words[self.revoke_word], fence[1]))

    def load_revoked(self, fence: tuple[int, int] | None) -> bool:
        """The engine revoked the load sent with this fence (it reused the blocks before the
        load was confirmed ended): read before each layer, it copies no layer more."""
        return (self.load_revoke_word is not None and fence is not None
                and reached(self.words[self.load_revoke_word], fence[1]))

    def release_fences(self) -> None:
        self.words[:FENCE_WORDS] = RELEASED

    def close(self) -> None:
        if self.ops is not None:
            self.ops.unregister()
            self.ops = None
