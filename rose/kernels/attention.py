"""Attention for ragged sequences in Triton: one program per (query block, sequence, head), the
whole key range of its sequence streamed through registers (online softmax). Made for short
sequences; an H200 sweep (2026-12-02, `benchmarks/results/2026-12-02_h200_attention-sweep/`) found it ahead of torch's varlen at
every length to 8,192 tokens too, so it is the built-in choice for bidirectional models.

Made for the small-batch step, where FlashAttention's kernels spend ~6 us on a single 128-token
sequence (16 heads, head dim 64; H200) launching few programs and filling a pipeline sized for long
sequences, plus a fill of the output. Graph-safe: the grid comes from the static sequence count and
the length bucket (`max_seqlen`), each program reads its sequence's bounds from `cu_seqlens` on the
device; programs past a sequence's end return at once. Rows past the last sequence (a bucket's
padding) are written as zeros. q, k, v may be strided views (BERT's stacked qkv, unbound without a
copy); GQA reads kv head h // (q heads / kv heads). An additive score bias by position within the
sequence ([heads, L, L], MPNet's relative position bias) is read beside each score block. A sliding
window (query i sees keys j with |i - j| < window, and j <= i if causal: ModernBERT's local layers,
Mistral's, Gemma3's) masks the scores, and key blocks wholly outside it are not visited.

`attention_reference` is the same maths in torch, one sequence at a time (CPU-runnable).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rose.kernels import launch, shape_class


@triton.jit
def _key_block(q, acc, m_i, l_i, k_ptr, v_ptr, bias_ptr, kv_base, start, n0, length, offs_m, offs_d, mask_m, sk_t,
               sv_t, v_head, b_head, sb_i, sb_j, qk_scale, window, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, WINDOW: tl.constexpr,
               MASKED: tl.constexpr):
    """One block of BLOCK_N keys into the online softmax. MASKED: keys past the sequence's end, the
    causal diagonal and the window are masked; else every key of the block counts for every row."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    valid_n = offs_n < length
    k_ptrs = k_ptr + kv_base + offs_n[None, :] * sk_t + offs_d[:, None]
    v_ptrs = v_ptr + start * sv_t + v_head + offs_n[:, None] * sv_t + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=valid_n[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
    elif BLOCK_D == HEAD_DIM:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
    s = tl.dot(q, k) * qk_scale  # log2 domain
    if HAS_BIAS:
        s += tl.load(bias_ptr + b_head + offs_m[:, None] * sb_i + offs_n[None, :] * sb_j,
                     mask=mask_m & valid_n[None, :], other=0.0).to(tl.float32) * 1.4426950408889634
    if MASKED:
        keep = valid_n[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        if WINDOW:
            dist = offs_m[:, None] - offs_n[None, :]
            keep = keep & (dist < window) & (dist > -window)
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if WINDOW:  # a row may see no key of a block yet: keep exp2 off -inf - -inf
        m_new = tl.where(m_new == float("-inf"), -1e30, m_new)
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASKED:
        v = tl.load(v_ptrs, mask=valid_n[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif BLOCK_D == HEAD_DIM:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, bias_ptr, T, num_seqs, sq_t, sq_h, sk_t, sk_h, sv_t,
                      sv_h, so_t, so_h, sb_h, sb_i, sb_j, qk_scale, window, GROUP: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, WINDOW: tl.constexpr, UNMASKED: tl.constexpr,
                      USE_GDC: tl.constexpr):
    pid_m = tl.program_id(0)
    seq = tl.program_id(1)
    h = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d[None, :] < HEAD_DIM
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    start = tl.load(cu_ptr + seq)
    if seq == num_seqs:  # the bucket's padding rows [cu[-1], T): zeros, spread over the query blocks
        step = tl.num_programs(0) * BLOCK_M
        for r0 in range(start + pid_m * BLOCK_M, T, step):
            rows = r0 + tl.arange(0, BLOCK_M)
            tl.store(o_ptr + rows[:, None] * so_t + h * so_h + offs_d[None, :],
                     tl.zeros((BLOCK_M, BLOCK_D), dtype=o_ptr.dtype.element_ty), mask=(rows[:, None] < T) & mask_d)
        return
    length = tl.load(cu_ptr + seq + 1) - start
    m0 = pid_m * BLOCK_M
    if m0 >= length:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m[:, None] < length
    q = tl.load(q_ptr + (start + offs_m)[:, None] * sq_t + h * sq_h + offs_d[None, :], mask=mask_m & mask_d,
                other=0.0)
    kh = h // GROUP
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    hi = tl.minimum(length, m0 + BLOCK_M) if CAUSAL else length
    lo = 0
    if WINDOW:  # only the key blocks some row of this block can see
        lo = tl.maximum(m0 - window + 1, 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(hi, m0 + BLOCK_M + window - 1)
    # UNMASKED (sequences of more than one key block): the key blocks every row of this block sees whole
    # (inside the sequence, below the causal diagonal; none under a window) take a loop without masks,
    # the rest the masked one. A single block keeps the one masked loop: measured on an H200, the
    # two loops cost pplx-embed's 1 x 128 attention 4.3 -> 5.3 us a layer, and gained 5-7 % from 5 x 512.
    full = lo if WINDOW or not UNMASKED else (tl.minimum(length, m0 + 1) if CAUSAL else length) // BLOCK_N * BLOCK_N
    kv_base = start * sk_t + kh * sk_h
    for n0 in range(lo, full, BLOCK_N):
        acc, m_i, l_i = _key_block(q, acc, m_i, l_i, k_ptr, v_ptr, bias_ptr, kv_base, start, n0, length, offs_m,
                                   offs_d, mask_m, sk_t, sv_t, kh * sv_h, h * sb_h, sb_i, sb_j, qk_scale, window,
                                   HEAD_DIM, BLOCK_D, BLOCK_N, False, HAS_BIAS, False, False)
    for n0 in range(full, hi, BLOCK_N):
        acc, m_i, l_i = _key_block(q, acc, m_i, l_i, k_ptr, v_ptr, bias_ptr, kv_base, start, n0, length, offs_m,
                                   offs_d, mask_m, sk_t, sv_t, kh * sv_h, h * sb_h, sb_i, sb_j, qk_scale, window,
                                   HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, HAS_BIAS, WINDOW, True)
    out = acc / l_i[:, None]
    tl.store(o_ptr + (start + offs_m)[:, None] * so_t + h * so_h + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mask_m & mask_d)


Tile = tuple[int, ...]  # BLOCK_M (query rows per program), BLOCK_N (keys per iteration), warps[, pipeline stages]


@functools.cache
def _tile_override() -> Tile | None:
    """ROSE_ATTENTION_TILE=BLOCK_M,BLOCK_N,WARPS[,STAGES]: one tile for every call, a knob for measurements
    (`benchmarks.small_step`)."""
    env = os.environ.get("ROSE_ATTENTION_TILE")
    return tuple(int(x) for x in env.split(",")) if env else None


def tile(max_seqlen: int, head_dim: int, seqs: int, heads: int) -> Tile:
    """The launch tile for `seqs` sequences of up to `max_seqlen` tokens and `heads` query heads (its
    grid: query blocks of 64 x sequences x heads, of the shape's class: `shape_class`), measured by
    `benchmarks.small_step --tiles` on an H200 (benchmarks/results/2026-12-01_h200_small-step-tiles/README.md): 128 keys per iteration
    while the grid is under two waves, 64 beyond; 64 query rows, or 32 for heads over 64 wide on
    sequences up to 256. BGE-M3 (16 x 64): 1 x 128 3.3 us (was 4.3), 1 x 512 9.3 (11.4), 5 x 512 23.2
    (unchanged); pplx-embed-1-0.6b (16 x 128): 4.5 (6.2), 10.9 (17.7), 30.3 (36.4). Fewer keys per
    iteration where the blocks would not fit in shared memory (`smem_bytes`: heads 256 wide, as
    EmbeddingGemma's, which failed to launch with 128 keys)."""
    if override := _tile_override():
        return override
    seqs, length = shape_class(seqs, max_seqlen)  # as the table's choice: the same eagerly as in a graph
    block_n = 128 if length // 64 * seqs * heads <= 2 * 132 else 64
    block_m = 32 if head_dim > 64 and length <= 256 else 64
    while block_n > 16 and smem_bytes(block_m, block_n, head_dim) > SMEM_BUDGET:  # EmbeddingGemma's 256 wide heads
        block_n //= 2
    return block_m, block_n, 4


SMEM_BUDGET = 200 << 10  # of an H200's 227 KB per block, with room for the compiler's own
STAGES = 3  # Triton's default software pipelining of the key loop


def smem_bytes(block_m: int, block_n: int, head_dim: int, stages: int = STAGES) -> int:
    """Shared memory of one program, roughly: its q block and `stages` key and value blocks (16-bit)."""
    d = max(16, triton.next_power_of_2(head_dim))
    return (block_m + 2 * stages * block_n) * d * 2


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
              causal: bool = False, config: Tile | None = None, bias: torch.Tensor | None = None,
              window: int = 0) -> torch.Tensor:
    """q [T, H, D], k / v [T, Hk, D] (last dim contiguous), cu_seqlens int32 [N+1] on the device,
    max_seqlen a host int >= every length (a graph's length bucket) -> out [T, H, D].
    `config`: the launch tile (default `tile`); `bias`: [H, L, L] (L >= max_seqlen, any strides)
    added to query i's score of key j, i and j positions within their sequence; `window`: keys at
    distance < window only (0: no limit)."""
    T, H, D = q.shape
    hk = k.shape[1]
    if H % hk:
        raise ValueError(f"{H} query heads do not group over {hk} kv heads")
    if bias is not None and (bias.shape[0] != H or min(bias.shape[1:]) < max_seqlen):
        raise ValueError(f"score bias {tuple(bias.shape)} is not [{H}, L, L] with L >= {max_seqlen}")
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    n = cu_seqlens.shape[0] - 1
    bm, bn, warps, *stages = config or tile(max_seqlen, D, n, H)
    grid = (triton.cdiv(max(max_seqlen, 1), bm), n + 1, H)
    kw = dict(GROUP=H // hk, HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_M=bm,
              BLOCK_N=bn, CAUSAL=causal, HAS_BIAS=bias is not None, WINDOW=0 < window < max_seqlen,
              UNMASKED=max_seqlen > bn, num_warps=warps, num_stages=stages[0] if stages else STAGES)
    sb = bias.stride() if bias is not None else (0, 0, 0)
    args = (q, k, v, out, cu_seqlens, bias if bias is not None else q, T, n, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), *sb, math.log2(math.e) / math.sqrt(D),
            window)
    launch(_attention_kernel, grid, *args, **kw)
    return out


def attention_reference(q, k, v, cu_seqlens, causal=False, bias=None, window=0) -> torch.Tensor:
    """The same in torch, float32, one SDPA per sequence (with `bias`'s top-left [n, n] added);
    padding rows are zeros."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu = cu_seqlens.tolist()
    rep = q.shape[1] // k.shape[1]
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            kk = k[a:b].float().repeat_interleave(rep, 1)
            vv = v[a:b].float().repeat_interleave(rep, 1)
            mask, n = None, b - a
            if bias is not None or window:
                mask = bias[:, :n, :n].float().to(q.device) if bias is not None else torch.zeros(n, n, device=q.device)
                d = torch.arange(n, device=q.device)
                d, w = d[:, None] - d[None, :], window or n
                mask = mask.masked_fill(~((d < w) & (d >= 0 if causal else d > -w)), float("-inf"))
            o = F.scaled_dot_product_attention(q[a:b].float().transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                                               attn_mask=mask, is_causal=causal and mask is None)
            out[a:b] = o.transpose(0, 1)
    return out
