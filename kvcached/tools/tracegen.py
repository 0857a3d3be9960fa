"""Synthetic Mooncake-format traces with reuse patterns other than the shared trace's, so that
eviction policies are not judged on one file alone.

- documents: a Zipf-popular set of long shared prefixes, each request adding a short unique
  suffix (RAG / shared system prompts);
- multiturn: sessions whose every turn extends the previous prompt (chat);
- scan: mostly one-off prompts with a small hot set (cache pollution).
"""
from __future__ import annotations

import json
import random
from typing import Iterator

PATTERNS = ("documents", "multiturn", "scan")


def generate(pattern: str, requests: int = 3000, seed: int = 0,
             block_tokens: int = 512) -> list[dict]:
    if pattern not in PATTERNS:
        raise ValueError(f"pattern {pattern!r}: expected one of {PATTERNS}")
    rng = random.Random(seed)
    ids = iter(range(10**12))
    make = {"documents": _documents, "multiturn": _multiturn, "scan": _scan}[pattern]
    out = []
    for t, blocks in enumerate(make(rng, ids, requests)):
        out.append({"timestamp": t * 100, "input_length": len(blocks) * block_tokens,
                    "output_length": 1, "hash_ids": blocks})
    return out


def _documents(rng, ids, n) -> Iterator[list[int]]:
    docs = [[next(ids) for _ in range(rng.randint(10, 40))] for _ in range(400)]
    weights = [1 / (i + 1) ** 1.1 for i in range(len(docs))]
    for _ in range(n):
        doc = rng.choices(docs, weights)[0]
        yield doc + [next(ids) for _ in range(rng.randint(1, 4))]


def _multiturn(rng, ids, n) -> Iterator[list[int]]:
    sessions: list[list[int]] = []
    for _ in range(n):
        if not sessions or rng.random() < 0.25:
            sessions.append([next(ids) for _ in range(rng.randint(4, 16))])
            if len(sessions) > 300:
                sessions.pop(rng.randrange(len(sessions)))
        s = sessions[min(int(rng.expovariate(1 / 20)), len(sessions) - 1) - len(sessions)]
        s.extend(next(ids) for _ in range(rng.randint(1, 4)))
        yield list(s)


def _scan(rng, ids, n) -> Iterator[list[int]]:
    hot = [[next(ids) for _ in range(rng.randint(8, 24))] for _ in range(30)]
    for _ in range(n):
        if rng.random() < 0.3:
            yield rng.choice(hot) + [next(ids)]
        else:
            yield [next(ids) for _ in range(rng.randint(10, 60))]


def write(path: str, records: list[dict]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
