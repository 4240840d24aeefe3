"""Rotary position embedding (the "rotate half" form used by Qwen3 / Llama), for ragged batches:
cos/sin are gathered per token from a table indexed by each token's position.

Frequency scaling (`rope_scaling` in older config.json files, `rope_parameters` in newer ones):
"default" (none), "linear" (positions divided by `factor`) and "llama3" (Llama 3.1's wavelength-
dependent scaling) are supported; the others (dynamic, yarn, longrope, ...) are refused by name."""

from __future__ import annotations

import math

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3")


def rope_params(cfg: dict, field: str = "rope_scaling") -> dict:
    """The rotary parameters of a config (no per-layer-type nesting): {"rope_type", "rope_theta", ...}.
    Raises ValueError naming the field for a scaling type ROSE does not implement."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported {field} rope_type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    params["rope_type"] = kind
    params["rope_theta"] = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    return params


def rope_theta(cfg: dict) -> float:
    params = rope_params(cfg)
    if params["rope_type"] != "default":
        raise ValueError(f"unsupported rope_type {params['rope_type']!r} (supported: default)")
    return params["rope_theta"]


def _scaled(inv: torch.Tensor, params: dict) -> torch.Tensor:
    kind = params["rope_type"]
    if kind == "linear":
        return inv / float(params["factor"])
    if kind == "llama3":  # as transformers' _compute_llama3_parameters
        factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return torch.where(medium, smoothed, out)
    return inv


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.scaling = scaling if scaling and scaling.get("rope_type", "default") != "default" else None
        self.register_buffer("cos_sin", self._table(torch.device("cpu")), persistent=False)

    @classmethod
    def from_params(cls, head_dim: int, max_positions: int, params: dict) -> Rotary:
        return cls(head_dim, max_positions, params["rope_theta"], params)

    def _table(self, device) -> torch.Tensor:
        inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim))
        if self.scaling is not None:
            inv = _scaled(inv, self.scaling)
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
