"""The blocks both transfer benches move (CPU: transfer.py, CUDA: transfer_cuda.py): a 7B-like
layout and the marks that make every copied block checkable."""
from __future__ import annotations

import numpy as np
import torch

LAYERS, BLOCK_SHAPE, DTYPE = 32, (16, 8, 128), torch.bfloat16


def _fill(kv, blocks: np.ndarray, salt: int = 0) -> None:
    """Give each block, layer and part a recognisable value (checked by _check); any device."""
    for layer, (k, v) in enumerate(kv):
        for part, t in enumerate((k, v)):
            marks = torch.from_numpy((blocks * 7 + layer * 3 + part + salt) % 251).to(t.device, DTYPE)
            t[torch.from_numpy(blocks).to(t.device)] = marks.view(-1, 1, 1, 1).expand(-1, *BLOCK_SHAPE)


def _check(kv, blocks: np.ndarray, source_blocks: np.ndarray) -> bool:
    pick = np.linspace(0, len(blocks) - 1, num=min(16, len(blocks))).astype(int)
    for layer, (k, v) in enumerate(kv):
        for part, t in enumerate((k, v)):
            want = torch.from_numpy((source_blocks[pick] * 7 + layer * 3 + part) % 251).to(t.device, DTYPE)
            got = t[torch.from_numpy(blocks[pick]).to(t.device)][:, 0, 0, 0]
            if not torch.equal(got, want):
                return False
    return True
