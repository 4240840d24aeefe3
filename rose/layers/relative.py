"""T5's relative position bias, as MPNet and T5's encoder add it to their attention scores: a table of
(buckets x heads) looked up by the bidirectional bucket of j - i (key minus query position within a
sequence): exact for small distances, logarithmic up to `max_distance`."""

from __future__ import annotations

import math

import torch
from torch import nn


def relative_position_bucket(rel: torch.Tensor, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """T5's bidirectional buckets of relative positions (key - query)."""
    n = -rel
    half = num_buckets // 2
    ret = (n < 0).long() * half
    n = n.abs()
    exact = half // 2
    large = exact + (torch.log(n.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                     * (half - exact)).long()
    return ret + torch.where(n < exact, n, large.clamp(max=half - 1))


def bucket_bias(table: nn.Embedding, length: int, dtype: torch.dtype, num_buckets: int = 32,
                max_distance: int = 128) -> torch.Tensor:
    """[heads, length, length], contiguous (the attention kernels read it along keys): the bias of key j
    for query i, `table` at the bucket of j - i. Once per step, shared by every layer."""
    i = torch.arange(length, device=table.weight.device)
    bias = table(relative_position_bucket(i[None, :] - i[:, None], num_buckets, max_distance))
    return bias.permute(2, 0, 1).to(dtype).contiguous()
