"""BGE-M3's extra heads over token states, loaded from `sparse_linear.pt` and `colbert_linear.pt`.

- sparse (lexical weights): relu(sparse_linear(h)) per token; the max weight per token id is
  taken on the host (Tulip), special tokens dropped, only weights > 0 kept.
- ColBERT: colbert_linear(h) per token, L2-normalised; the host keeps every token after the
  first (CLS) of each sequence.

SPLADE's sparse output is its whole (vocabulary-sized) output row, reduced on the device by its
family (`rose.models.splade`).

`rose.extras` names these outputs (`Extra`) wherever a step asks for them (the graph keys, Tulip's
requests) and holds their host-side halves (`lexical_weights`, `colbert_vectors`, `vocab_weights`):
numpy only, so that Tulip reads them without this module's torch.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SPARSE_FILE, COLBERT_FILE = "sparse_linear.pt", "colbert_linear.pt"


def _linear(path: Path, hidden: int, out: int | None, device, dtype) -> nn.Linear:
    sd = torch.load(path, map_location="cpu", weights_only=True)
    if set(sd) != {"weight", "bias"}:
        raise ValueError(f"{path.name} must hold exactly 'weight' and 'bias', found {sorted(sd)}")
    w, b = sd["weight"], sd["bias"]
    if w.ndim != 2 or w.shape[1] != hidden or (out is not None and w.shape[0] != out) or b.shape != (w.shape[0],):
        raise ValueError(f"{path.name}: weight {tuple(w.shape)} / bias {tuple(b.shape)} do not fit hidden size {hidden}")
    lin = nn.Linear(hidden, w.shape[0], device=device, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    return lin.requires_grad_(False)


class BgeM3Heads(nn.Module):
    def __init__(self, sparse: nn.Linear | None, colbert: nn.Linear | None):
        super().__init__()
        self.sparse, self.colbert = sparse, colbert

    @classmethod
    def load(cls, path: Path, hidden: int, device, dtype) -> "BgeM3Heads | None":
        sp, cb = Path(path) / SPARSE_FILE, Path(path) / COLBERT_FILE
        if not sp.is_file() and not cb.is_file():
            return None
        return cls(_linear(sp, hidden, 1, device, dtype) if sp.is_file() else None,
                   _linear(cb, hidden, None, device, dtype) if cb.is_file() else None)

    @property
    def colbert_dim(self) -> int:
        return self.colbert.out_features if self.colbert is not None else 0

    def token_weights(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] -> float32 [T] lexical weights."""
        return F.relu(self.sparse(hidden)).squeeze(-1).float()

    def token_vectors(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] -> float32 [T, colbert_dim], L2-normalised."""
        return F.normalize(self.colbert(hidden).float(), dim=-1)
