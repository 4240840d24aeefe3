"""Rotary position embedding (the "rotate half" form used by Qwen3 / Llama), for ragged batches:
cos/sin are gathered per token from a table indexed by each token's position."""

from __future__ import annotations

import torch
from torch import nn


def rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if params.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"unsupported rope_type {params['rope_type']!r} (supported: default)")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.register_buffer("cos_sin", self._table(torch.device("cpu")), persistent=False)

    def _table(self, device) -> torch.Tensor:
        inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim))
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device=device), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        return torch.stack([emb.cos(), emb.sin()])  # [2, max_positions, head_dim], float32

    def materialize(self, device: torch.device) -> None:
        """Recompute the table on `device` (models are built on meta and the buffer is not in checkpoints)."""
        self.cos_sin = self._table(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[2, T, 1, D] cos/sin for these positions, once per step (shared by every layer)."""
        return self.cos_sin[:, positions].unsqueeze(2).to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor):
    """q [T, H, D], k [T, Hk, D], cos_sin from `Rotary.lookup` -> rotated q, k."""
    cos, sin = cos_sin.unbind(0)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)
