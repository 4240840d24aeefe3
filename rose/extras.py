"""The token-level outputs a step can compute beside the pooled vector, by name (`Extra`), and their
host-side halves: numpy only, no torch, so that Tulip's config and engine loop read them without the
modules that hold the heads (`rose.layers.heads`: BGE-M3's sparse and ColBERT heads; SPLADE's output
row is its family's, `rose.models.splade`).

- sparse (lexical weights): the max weight per token id, special tokens dropped, only weights > 0
  kept (`lexical_weights`); SPLADE's from its vocabulary-sized row (`vocab_weights`).
- ColBERT: every token's vector after the first (CLS) of each sequence (`colbert_vectors`).
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np


class Extra(StrEnum):
    """A token-level output a step can compute beside the pooled vector (equal to its name)."""

    SPARSE = "sparse"
    COLBERT = "colbert"


def lexical_weights(ids: np.ndarray, weights: np.ndarray, special: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One sequence's sparse output from its token ids and per-token weights: the max weight per
    token id in first-occurrence order, special tokens and weights <= 0 dropped (FlagEmbedding's rule)."""
    keep = (weights > 0) & ~np.isin(ids, special)
    ids, weights = ids[keep], weights[keep]
    uniq, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    best = np.zeros(len(uniq), dtype=np.float32)
    np.maximum.at(best, inverse, weights)
    order = np.argsort(first, kind="stable")
    return uniq[order], best[order]


def vocab_weights(row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One sequence's sparse output from a vocabulary-sized output row (SPLADE): its nonzero
    entries, by ascending token id."""
    ids = np.flatnonzero(row > 0)
    return ids, row[ids]


def colbert_vectors(vectors: np.ndarray, start: int, n: int) -> np.ndarray:
    """One sequence's ColBERT output from a step's per-token vectors: every token after its first."""
    return vectors[start + 1:start + n]
