"""Attention for short ragged sequences in Triton: one program per (query block, sequence, head),
the whole key range of its sequence streamed through registers (online softmax).

Made for the small-batch step, where FlashAttention's kernels spend ~6 us on a single 128-token
sequence (16 heads, head dim 64; H200) launching few programs and filling a pipeline sized for long
sequences, plus a fill of the output. Graph-safe: the grid comes from the static sequence count and
the length bucket (`max_seqlen`), each program reads its sequence's bounds from `cu_seqlens` on the
device; programs past a sequence's end return at once. Rows past the last sequence (a bucket's
padding) are written as zeros. q, k, v may be strided views (BERT's stacked qkv, unbound without a
copy); GQA reads kv head h // (q heads / kv heads).

`attention_project` is attention and the output projection in one kernel, for steps whose
sequences are short (`PROJECT_MAX_SEQLEN`): each program owns a block of query rows, a block of the
projection's outputs and a group of heads, computes those heads' attention for its rows (the key
range of the sequences its rows belong to, masked to each row's own sequence) and multiplies it into
its block of outputs at once, writing float32 partial sums over the head groups as
`rose.kernels.gemm.linear_partials` does (`add_norm` reduces them). Every output block recomputes its
rows' attention, cheap next to a kernel boundary at a few hundred keys; the attention output never
goes to memory.

`attention_reference` / `attention_project_reference` are the same maths in torch, one sequence
at a time (CPU-runnable).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rose.kernels import launch


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, T, num_seqs, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
                      so_t, so_h, qk_scale, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, USE_GDC: tl.constexpr):
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
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid_n = offs_n < length
        k = tl.load(k_ptr + (start + offs_n)[None, :] * sk_t + kh * sk_h + offs_d[:, None],
                    mask=valid_n[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
        s = tl.dot(q, k) * qk_scale  # log2 domain
        keep = valid_n[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + (start + offs_n)[:, None] * sv_t + kh * sv_h + offs_d[None, :],
                    mask=valid_n[:, None] & mask_d, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + (start + offs_m)[:, None] * so_t + h * so_h + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mask_m & mask_d)


Tile = tuple[int, int, int]  # BLOCK_M (query rows per program), BLOCK_N (keys per iteration), warps


@functools.cache
def _tile_override() -> Tile | None:
    """ROSE_ATTENTION_TILE=BLOCK_M,BLOCK_N,WARPS: one tile for every call, a knob for measurements
    (`benchmarks.small_step`)."""
    env = os.environ.get("ROSE_ATTENTION_TILE")
    return tuple(int(x) for x in env.split(",")) if env else None


def tile(max_seqlen: int, head_dim: int, seqs: int, heads: int) -> Tile:
    """The launch tile for `seqs` sequences of up to `max_seqlen` tokens and `heads` query heads (its
    grid: query blocks of 64 x sequences x heads), measured by
    `benchmarks.small_step --tiles` on an H200 (results/small_step/README.md): 128 keys per iteration
    while the grid is under two waves, 64 beyond; 64 query rows, or 32 for heads over 64 wide on
    sequences up to 256. BGE-M3 (16 x 64): 1 x 128 3.3 us (was 4.3), 1 x 512 9.3 (11.4), 5 x 512 23.2
    (unchanged); pplx-embed-1-0.6b (16 x 128): 4.5 (6.2), 10.9 (17.7), 30.3 (36.4)."""
    if override := _tile_override():
        return override
    block_n = 128 if triton.cdiv(max(max_seqlen, 1), 64) * seqs * heads <= 2 * 132 else 64
    return 32 if head_dim > 64 and max_seqlen <= 256 else 64, block_n, 4


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
              causal: bool = False, config: Tile | None = None) -> torch.Tensor:
    """q [T, H, D], k / v [T, Hk, D] (last dim contiguous), cu_seqlens int32 [N+1] on the device,
    max_seqlen a host int >= every length (a graph's length bucket) -> out [T, H, D].
    `config`: the launch tile (default `tile`)."""
    T, H, D = q.shape
    hk = k.shape[1]
    if H % hk:
        raise ValueError(f"{H} query heads do not group over {hk} kv heads")
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    n = cu_seqlens.shape[0] - 1
    bm, bn, warps = config or tile(max_seqlen, D, n, H)
    grid = (triton.cdiv(max(max_seqlen, 1), bm), n + 1, H)
    kw = dict(GROUP=H // hk, HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_M=bm,
              BLOCK_N=bn, CAUSAL=causal, num_warps=warps)
    args = (q, k, v, out, cu_seqlens, T, n, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), out.stride(0), out.stride(1), math.log2(math.e) / math.sqrt(D))
    launch(_attention_kernel, grid, *args, **kw)
    return out


@triton.jit
def _attention_project_kernel(q_ptr, k_ptr, v_ptr, w_ptr, p_ptr, cu_ptr, T, N, num_seqs, sq_t, sq_h, sk_t, sk_h,
                              sv_t, sv_h, stride_wn, qk_scale, HEADS: tl.constexpr, GROUP: tl.constexpr,
                              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_KEYS: tl.constexpr, BLOCK_S: tl.constexpr,
                              CAUSAL: tl.constexpr, USE_GDC: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)  # the head group: heads [pid_k * HEADS, (pid_k + 1) * HEADS)
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    out_ptrs = p_ptr + pid_k * T * N + rows[:, None] * N + cols[None, :]
    out_mask = (rows[:, None] < T) & (cols[None, :] < N)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # each row's sequence: how many sequence ends (cu[1:]) are at or before it; rows past the last
    # sequence (a bucket's padding) get num_seqs and match no key
    s_idx = tl.arange(0, BLOCK_S)
    ends = tl.load(cu_ptr + 1 + s_idx, mask=s_idx < num_seqs, other=2147483647)
    total = tl.load(cu_ptr + num_seqs)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if m0 < total:
        seq_q = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        last = tl.minimum(m0 + BLOCK_M, total) - 1
        starts = tl.load(cu_ptr + s_idx, mask=s_idx <= num_seqs, other=0)
        lo = tl.max(tl.where(starts <= m0, starts, 0), axis=0)  # the first row's sequence start
        hi = tl.min(tl.where(ends > last, ends, 2147483647), axis=0)  # the last row's sequence end
        if CAUSAL:
            hi = last + 1
        for hh in range(HEADS):
            h = pid_k * HEADS + hh
            kh = h // GROUP
            q = tl.load(q_ptr + rows[:, None] * sq_t + h * sq_h + offs_d[None, :],
                        mask=(rows[:, None] < total) & mask_d[None, :], other=0.0)
            m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
            o = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            for n0 in range(lo, hi, BLOCK_KEYS):
                keys = n0 + tl.arange(0, BLOCK_KEYS)
                valid = keys < hi
                seq_k = tl.sum((ends[None, :] <= keys[:, None]).to(tl.int32), axis=1)
                kt = tl.load(k_ptr + keys[None, :] * sk_t + kh * sk_h + offs_d[:, None],
                             mask=valid[None, :] & mask_d[:, None], other=0.0)
                s = tl.dot(q, kt) * qk_scale  # log2 domain
                keep = (seq_q[:, None] == seq_k[None, :]) & valid[None, :]
                if CAUSAL:
                    keep = keep & (keys[None, :] <= rows[:, None])
                s = tl.where(keep, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
                p = tl.math.exp2(s - m_safe[:, None])
                alpha = tl.math.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                vt = tl.load(v_ptr + keys[:, None] * sv_t + kh * sv_h + offs_d[None, :],
                             mask=valid[:, None] & mask_d[None, :], other=0.0)
                o = o * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
                m_i = m_new
            o = o / tl.where(l_i > 0, l_i, 1.0)[:, None]
            # this head's slice of the projection: w[cols, h * HEAD_DIM + d], as [d, cols]
            wt = tl.load(w_ptr + cols[None, :] * stride_wn + h * HEAD_DIM + offs_d[:, None],
                         mask=mask_d[:, None] & (cols[None, :] < N), other=0.0)
            acc = tl.dot(o.to(wt.dtype), wt, acc)  # rounded as the unfused attention output is
    tl.store(out_ptrs, acc, mask=out_mask)


ProjectTile = tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N (outputs), heads per program, keys, warps

PROJECT_MAX_SEQLEN = 128  # the longest length bucket `attention_project` is meant for (measured: README)


@functools.cache
def project_max_seqlen() -> int:
    """The longest length bucket the triton backend runs through `attention_project`:
    PROJECT_MAX_SEQLEN, or ROSE_ATTENTION_PROJECT_MAX (0: never), a knob for measurements."""
    return int(os.environ.get("ROSE_ATTENTION_PROJECT_MAX", PROJECT_MAX_SEQLEN))


@functools.cache
def _project_override() -> ProjectTile | None:
    """ROSE_ATTENTION_PROJECT_TILE=BLOCK_M,BLOCK_N,HEADS,KEYS,WARPS: one tile for every
    `attention_project` call, a knob for measurements (`benchmarks.small_step`)."""
    env = os.environ.get("ROSE_ATTENTION_PROJECT_TILE")
    return tuple(int(x) for x in env.split(",")) if env else None


def project_tile(tokens: int, heads: int, head_dim: int, n: int) -> ProjectTile:
    """The launch tile of `attention_project` on `tokens` rows, `heads` query heads of `head_dim`
    and `n` outputs: 64 rows and 64 outputs per program, four heads per program (fewer when the
    heads do not divide), keys 128 at a time."""
    if override := _project_override():
        return override
    per = next(g for g in (4, 2, 1) if heads % g == 0)
    return 64, 64, per, 128 if head_dim <= 64 else 64, 4


def attention_project(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      weight: torch.Tensor, causal: bool = False, config: ProjectTile | None = None) -> torch.Tensor:
    """attention(q, k, v) reshaped to [T, H * D], times weight.T ([N, H * D]), as float32 partial sums
    over head groups: [groups, T, N] (`rose.kernels.gemm.add_norm` reduces them). q [T, H, D], k / v
    [T, Hk, D] (last dim contiguous; strided views welcome), cu_seqlens int32 [S+1] on the device.
    Padding rows (past cu_seqlens[-1]) come out as zeros. `config`: the launch tile (`project_tile`)."""
    T, H, D = q.shape
    hk = k.shape[1]
    N = weight.shape[0]
    if H % hk:
        raise ValueError(f"{H} query heads do not group over {hk} kv heads")
    if weight.shape[1] != H * D or weight.stride(1) != 1:
        raise ValueError(f"projection weight {tuple(weight.shape)} is not [N, {H * D}] with rows contiguous")
    bm, bn, per, keys, warps = config or project_tile(T, H, D, N)
    if H % per:
        raise ValueError(f"{H} heads do not split into groups of {per}")
    n = cu_seqlens.shape[0] - 1
    out = torch.empty((H // per, T, N), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(N, bn), triton.cdiv(T, bm), H // per)
    kw = dict(HEADS=per, GROUP=H // hk, HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), BLOCK_M=bm,
              BLOCK_N=bn, BLOCK_KEYS=keys, BLOCK_S=max(16, triton.next_power_of_2(n)), CAUSAL=causal,
              num_warps=warps)
    launch(_attention_project_kernel, grid, q, k, v, weight, out, cu_seqlens, T, N, n, q.stride(0), q.stride(1),
           k.stride(0), k.stride(1), v.stride(0), v.stride(1), weight.stride(0), math.log2(math.e) / math.sqrt(D),
           **kw)
    return out


def attention_project_reference(q, k, v, cu_seqlens, weight, causal=False) -> torch.Tensor:
    """attention_reference, rounded to q's dtype as the unfused step's attention output is, times
    weight.T in float32: [T, N] (the sum of `attention_project`'s partials)."""
    a = attention_reference(q, k, v, cu_seqlens, causal).to(q.dtype)
    return a.reshape(q.shape[0], -1).float() @ weight.float().T


def attention_reference(q, k, v, cu_seqlens, causal=False) -> torch.Tensor:
    """The same in torch, float32, one SDPA per sequence; padding rows are zeros."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu = cu_seqlens.tolist()
    rep = q.shape[1] // k.shape[1]
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            kk = k[a:b].float().repeat_interleave(rep, 1)
            vv = v[a:b].float().repeat_interleave(rep, 1)
            o = F.scaled_dot_product_attention(q[a:b].float().transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                                               is_causal=causal)
            out[a:b] = o.transpose(0, 1)
    return out
