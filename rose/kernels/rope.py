"""Qwen3's per-head RMSNorm of q and k and their rotary embedding, in one Triton kernel (or the
rotary embedding alone, NomicBERT's, without norm weights).

Reads the stacked q/k/v projection [T, (H + 2 Hk) * D], writes q [T, H, D] and k [T, Hk, D]
(normalised with `q_norm` / `k_norm`, then rotated by each token's position with the "rotate
half" form), all in float32 registers and rounded once; v stays a view of the input. One program
per block of tokens and head. `qk_norm_rope_reference` is the unfused torch maths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rose.kernels import launch


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, pos_ptr, table_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, T, stride_t, max_pos, eps,
                         H: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                         NORM: tl.constexpr, USE_GDC: tl.constexpr):
    pid_t = tl.program_id(0)
    head = tl.program_id(1)  # 0..H-1: q heads, H..H+HK-1: k heads
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    half = tl.arange(0, D // 2)
    mask = rows[:, None] < T
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    src = qkv_ptr + rows[:, None] * stride_t + head * D + half[None, :]
    a = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(src + D // 2, mask=mask, other=0.0).to(tl.float32)
    is_q = head < H
    if NORM:
        rstd = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / D + eps)
        if is_q:
            wa = tl.load(qw_ptr + half).to(tl.float32)
            wb = tl.load(qw_ptr + D // 2 + half).to(tl.float32)
        else:
            wa = tl.load(kw_ptr + half).to(tl.float32)
            wb = tl.load(kw_ptr + D // 2 + half).to(tl.float32)
        a = a * rstd[:, None] * wa[None, :]
        b = b * rstd[:, None] * wb[None, :]
    pos = tl.load(pos_ptr + rows, mask=rows < T, other=0)
    cos = table_ptr + pos[:, None] * D + half[None, :]  # table [2, max_pos, D]: cos then sin
    sin = cos + max_pos * D
    ra = a * tl.load(cos, mask=mask, other=0.0) - b * tl.load(sin, mask=mask, other=0.0)
    rb = b * tl.load(cos + D // 2, mask=mask, other=0.0) + a * tl.load(sin + D // 2, mask=mask, other=0.0)
    if is_q:
        dst = q_ptr + rows[:, None] * (H * D) + head * D + half[None, :]
    else:
        dst = k_ptr + rows[:, None] * (HK * D) + (head - H) * D + half[None, :]
    tl.store(dst, ra.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + D // 2, rb.to(q_ptr.dtype.element_ty), mask=mask)


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float, heads: int, kv_heads: int, head_dim: int):
    """qkv [T, (H + 2 Hk) * D] (rows contiguous), positions int64 [T], table float32 [2, P, D]
    (`Rotary.cos_sin`) -> q [T, H, D], k [T, Hk, D], v [T, Hk, D] (a view of qkv). Without
    `q_weight` / `k_weight`: the rotary embedding alone (no norm)."""
    T = qkv.shape[0]
    q = torch.empty((T, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((T, kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    block = 16
    grid = (triton.cdiv(T, block), heads + kv_heads)
    norm = q_weight is not None
    args = (qkv, positions, table, q_weight if norm else table, k_weight if norm else table, q, k, T, qkv.stride(0),
            table.shape[1], eps)
    kw = dict(H=heads, HK=kv_heads, D=head_dim, BLOCK_T=block, NORM=norm, num_warps=4)
    launch(_qk_norm_rope_kernel, grid, *args, **kw)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(T, kv_heads, head_dim)
    return q, k, v


def rope(qkv: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, heads: int, head_dim: int):
    """The rotary embedding alone (NomicBERT's, ModernBERT's: no q/k norm, as many kv heads as q
    heads): `qk_norm_rope` without its norm weights."""
    return qk_norm_rope(qkv, positions, table, None, None, 0.0, heads, heads, head_dim)


def qk_norm_rope_reference(qkv, positions, table, q_weight, k_weight, eps, heads, kv_heads, head_dim):
    T = qkv.shape[0]
    q, k, v = qkv.float().split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(T, heads, head_dim), k.view(T, kv_heads, head_dim)
    if q_weight is not None:
        q = F.rms_norm(q, (head_dim,), q_weight.float(), eps)
        k = F.rms_norm(k, (head_dim,), k_weight.float(), eps)
    cos, sin = table[0][positions].unsqueeze(1), table[1][positions].unsqueeze(1)

    def rot(x):
        a, b = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-b, a], dim=-1) * sin
    return rot(q), rot(k), v.view(T, kv_heads, head_dim)
