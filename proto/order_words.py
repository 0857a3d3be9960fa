"""The order words: how the engine's and the daemon's CUDA streams order each other.

The engine creates one shared-memory segment per KV registration (named like its KV segments,
`kv_segment_name`, mode 0600) and sends its name as the layout's `order_segment`; both
processes map it and register it with CUDA, so a stream of either can write or wait on its
64-bit words with the driver's stream memory operations (stream_ops.py):

    words [0, FENCE_WORDS - 1)                    fences: the engine writes `seq` on its stream
                                                  after its KV work, sends (fence_word, fence)
                                                  with an offload or a load; the daemon's copy
                                                  stream waits for word >= seq before copying
    word LOAD_REVOKE_WORD (FENCE_WORDS - 2)       revoked loads (protocol 1.14, when the layout
                                                  names it): the engine's CPU writes the highest
                                                  load fence it revoked; a load sent with a fence
                                                  <= the word copies no layer more (cancelled:
                                                  the engine reused its blocks)
    word REVOKE_WORD (FENCE_WORDS - 1)            revoked offloads (protocol 1.5, when the layout
                                                  names it): the engine's CPU writes the highest
                                                  offload fence it revoked; an offload of its
                                                  sent with a fence <= the word that has not
                                                  completed is discarded, not stored (its blocks
                                                  were reused)
    word FENCE_WORDS + slot * num_layers + layer  load progress: the daemon writes the load's
                                                  task id on its load stream after the layer's
                                                  copies; the engine's stream waits for >= id

Why words and not CUDA IPC events: a stream waiting on an IPC event whose process died waits
forever (seen on an H100: the engine's stream never drained after the daemon was killed), and
nothing can end that wait. A word can be written by the CPU of the side still alive: a
client whose daemon died writes RELEASED into the load words (its loads are reported failed),
a daemon whose engine died writes RELEASED into the fence words (its tasks are cancelled).

Every comparison is the driver's GEQ: (int64)(word - value) >= 0. Values only grow on a word:
fence seqs count up per registration, and a progress word belongs to one load slot, whose
task ids grow (a slot is taken at request time, after its previous task ended).
"""
from __future__ import annotations

FENCE_WORDS = 256
REVOKE_WORD = FENCE_WORDS - 1  # not a fence word for an engine that names it in its layout
LOAD_REVOKE_WORD = FENCE_WORDS - 2  # (1.14) the same, for loads: apart, so that an offload
# revoked stops none of the loads the engine still waits for
WORD_BYTES = 8
RELEASED = 1 << 62  # >= every value either side waits for, under the GEQ rule
PAGE = 4096


def segment_bytes(num_slots: int, num_layers: int) -> int:
    words = FENCE_WORDS + num_slots * num_layers
    return -(-words * WORD_BYTES // PAGE) * PAGE


def load_word(slot: int, layer: int, num_layers: int) -> int:
    return FENCE_WORDS + slot * num_layers + layer


def reached(word: int, value: int) -> bool:
    """The driver's GEQ test: word - value as a signed 64-bit number is >= 0."""
    return ((int(word) - int(value)) & (2**64 - 1)) < 2**63
