"""Ragged attention backends behind one interface.

Every backend takes q, k, v of shape [T, heads, head_dim] for a whole ragged
batch plus `AttentionMetadata`, and attends only within each sequence (no
padding, no cross-sequence attention). Backends:

- `sdpa`:   torch's scaled_dot_product_attention, one call per sequence. Runs
            everywhere (the CPU path and the reference for the others).
- `varlen`: FlashAttention varlen through `torch.nn.attention.varlen`
            (CUDA, fp16/bf16).
"""

from __future__ import annotations

import abc
import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionMetadata:
    """What attention needs to know about a ragged batch.

    cu_seqlens: int32 [N+1] on the compute device.
    max_seqlen: longest sequence (host int; a launch parameter, never read from the device;
                inside a CUDA graph, the token bucket).
    seq_lens:   the N lengths on the host (None inside a graph: capturable backends ignore it).
    causal:     causal (decoder-style) rather than bidirectional attention.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_lens: tuple[int, ...] | None
    causal: bool = False


class AttentionBackend(abc.ABC):
    """q, k, v [T, heads, head_dim] (kv heads may be fewer: GQA) -> [T, heads, head_dim]."""

    name: str
    capturable = False  # safe inside a CUDA graph (no host-side reads, static launch config)

    @abc.abstractmethod
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...


class SdpaBackend(AttentionBackend):
    """One SDPA call per sequence; handles GQA by letting SDPA broadcast kv heads."""

    name = "sdpa"

    def __call__(self, q, k, v, meta):
        gqa = q.shape[1] != k.shape[1]
        out = torch.empty_like(q)
        start = 0
        for n in meta.seq_lens:
            s = slice(start, start + n)
            o = F.scaled_dot_product_attention(
                q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1),
                is_causal=meta.causal, enable_gqa=gqa,
            )
            out[s] = o.transpose(0, 1)
            start += n
        return out


class VarlenBackend(AttentionBackend):
    """FlashAttention varlen from torch.nn.attention.varlen (CUDA only)."""

    name = "varlen"
    capturable = True

    def __init__(self):
        from torch.nn.attention.varlen import varlen_attn

        self._fn = varlen_attn
        params = inspect.signature(varlen_attn).parameters
        # torch 2.10/2.11 take is_causal; later releases take window_size.
        self._causal_kw = "is_causal" if "is_causal" in params else "window_size"
        self._gqa = "enable_gqa" in params

    def __call__(self, q, k, v, meta):
        kw = {}
        if meta.causal:
            kw[self._causal_kw] = True if self._causal_kw == "is_causal" else (-1, 0)
        if q.shape[1] != k.shape[1]:
            if self._gqa:
                kw["enable_gqa"] = True
            else:
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        cu = meta.cu_seqlens
        return self._fn(q, k, v, cu, cu, meta.max_seqlen, meta.max_seqlen, **kw)


def select_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """`auto` picks varlen on CUDA with half precision where available, else SDPA."""
    if name == "sdpa":
        return SdpaBackend()
    if name == "varlen":
        return VarlenBackend()
    if name != "auto":
        raise ValueError(f"unknown attention backend {name!r} (choose auto, sdpa, varlen)")
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        try:
            return VarlenBackend()
        except ImportError as e:
            log.info("torch.nn.attention.varlen unavailable (%s); using sdpa", e)
    return SdpaBackend()
