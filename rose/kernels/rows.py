"""The work before the first block and after the last, one kernel each, in Triton.

A BERT-family step starts with five to six small torch kernels (the position offset, two gathers,
two adds, LayerNorm) and a CLS / last-token embedding ends with five (the row index, its clamp, the
gather, the float conversion, the L2 norm); in a CUDA graph each of them pays its own launch gap, as
torch's kernels do not launch early (`rose.kernels.pdl`). Here:
- `embed_norm(ids, positions, word, pos, type_row, weight, bias, eps, offset)`: each token's word and
  position rows (position + `offset`) plus one token-type row, LayerNorm'd: BERT / XLM-RoBERTa's
  embeddings with one segment;
- `pool_rows(hidden, cu_seqlens, last, normalize)`: each sequence's first (CLS) or last token, float32,
  L2-normalised where asked: sentence-transformers' CLS / last-token pooling and Normalize;
- `pool_mean(hidden, cu_seqlens)` and `normalize_rows(x)`: mean pooling over each sequence's tokens
  (float32; torch takes seven kernels for it), and the L2 normalisation after it, in place.
`embed_norm_reference` is its maths in torch (float32), the CPU-runnable reference of the tests; the
pooling kernels' reference is the torch path they replace (`rose.layers.pooling.pool`, `normalize`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rose.kernels import launch


@triton.jit
def _embed_norm_kernel(ids_ptr, pos_ptr, word_ptr, posw_ptr, type_ptr, g_ptr, b_ptr, out_ptr, T, N, eps, OFFSET,
                       BLOCK: tl.constexpr, ROWS: tl.constexpr, USE_GDC: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    in_c = cols < N
    mask = (rows[:, None] < T) & in_c[None, :]
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ids = tl.load(ids_ptr + rows, mask=rows < T, other=0)
    pos = tl.load(pos_ptr + rows, mask=rows < T, other=0) + OFFSET
    x = tl.load(word_ptr + ids[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x += tl.load(posw_ptr + pos[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x += tl.load(type_ptr + cols, mask=in_c, other=0.0).to(tl.float32)[None, :]
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(in_c[None, :], x - mean[:, None], 0.0)
    y = xc * tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)[:, None]
    y = y * tl.load(g_ptr + cols, mask=in_c, other=0.0).to(tl.float32)[None, :]
    y += tl.load(b_ptr + cols, mask=in_c, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def embed_norm(ids: torch.Tensor, positions: torch.Tensor, word: torch.Tensor, pos: torch.Tensor,
               type_row: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               offset: int = 0) -> torch.Tensor:
    """LayerNorm(word[ids] + pos[positions + offset] + type_row) -> [T, hidden] in word's dtype.
    ids, positions: int64 [T]; word [V, hidden], pos [P, hidden] (contiguous, as loaded), type_row [hidden]."""
    T, N = ids.shape[0], word.shape[1]
    out = torch.empty(T, N, dtype=word.dtype, device=word.device)
    # one row per program, 8 warps: add_norm's measured tile for the same rows (`rose.kernels.gemm`)
    launch(_embed_norm_kernel, (T,), ids, positions, word, pos, type_row, weight, bias, out,
           T, N, eps, offset, BLOCK=triton.next_power_of_2(N), ROWS=1, num_warps=8)
    return out


@triton.jit
def _pool_rows_kernel(h_ptr, cu_ptr, out_ptr, T, D, LAST: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr,
                      KEPT: tl.constexpr, USE_GDC: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    in_c = cols < D
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if KEPT:  # one row per sequence already
        row = i.to(tl.int64)
    elif LAST:
        row = tl.maximum(tl.load(cu_ptr + i + 1).to(tl.int64) - 1, 0)
    else:  # an empty dummy sequence may start at T: clamp to a valid row (its output is dropped)
        row = tl.minimum(tl.load(cu_ptr + i).to(tl.int64), T - 1)
    x = tl.load(h_ptr + row * D + cols, mask=in_c, other=0.0).to(tl.float32)
    if NORM:  # F.normalize: x / max(||x||, 1e-12)
        x = x / tl.maximum(tl.sqrt(tl.sum(x * x, axis=0)), 1e-12)
    tl.store(out_ptr + i * D + cols, x, mask=in_c)


def pool_rows(hidden: torch.Tensor, cu_seqlens: torch.Tensor | None, last: bool, normalize: bool) -> torch.Tensor:
    """Each sequence's first (`last` False: CLS) or last token of hidden [T, D], float32 [N, D],
    L2-normalised if `normalize`. cu_seqlens int32 [N + 1]; None: hidden [N, D] holds each sequence's
    row already (`rose.layers.pooling.kept_rows`), converted and normalised here."""
    T, D = hidden.shape
    n = T if cu_seqlens is None else cu_seqlens.shape[0] - 1
    out = torch.empty(n, D, dtype=torch.float32, device=hidden.device)
    launch(_pool_rows_kernel, (n,), hidden, hidden if cu_seqlens is None else cu_seqlens, out, T, D, LAST=last,
           NORM=normalize, BLOCK=triton.next_power_of_2(D), KEPT=cu_seqlens is None, num_warps=4)
    return out


@triton.jit
def _pool_mean_kernel(h_ptr, cu_ptr, out_ptr, D, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, USE_GDC: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_c = cols < D
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    start = tl.load(cu_ptr + i)
    end = tl.load(cu_ptr + i + 1)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for r0 in range(start, end, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        m = (rows[:, None] < end) & in_c[None, :]
        x = tl.load(h_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], mask=m, other=0.0)
        acc += tl.sum(x.to(tl.float32), axis=0)
    tl.store(out_ptr + i * D + cols, acc / tl.maximum(end - start, 1).to(tl.float32), mask=in_c)


def pool_mean(hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The mean of each sequence's rows of hidden [T, D] (the tokens cu_seqlens [N + 1] gives it;
    an empty sequence: zeros), float32 [N, D]."""
    D = hidden.shape[1]
    n = cu_seqlens.shape[0] - 1
    out = torch.empty(n, D, dtype=torch.float32, device=hidden.device)
    block = min(128, triton.next_power_of_2(D))
    launch(_pool_mean_kernel, (n, triton.cdiv(D, block)), hidden, cu_seqlens, out, D, BLOCK_D=block, ROWS=32,
           num_warps=4)
    return out


@triton.jit
def _normalize_kernel(x_ptr, D, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + i * D + cols, mask=cols < D, other=0.0)
    tl.store(x_ptr + i * D + cols, x / tl.maximum(tl.sqrt(tl.sum(x * x, axis=0)), 1e-12), mask=cols < D)


def normalize_rows(x: torch.Tensor) -> torch.Tensor:
    """F.normalize(x, dim=-1) of a contiguous float32 [N, D], in place."""
    launch(_normalize_kernel, (x.shape[0],), x, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=4)
    return x


# Reference: the unfused maths, float32 (CPU-runnable).

def embed_norm_reference(ids, positions, word, pos, type_row, weight, bias, eps, offset=0):
    x = word.float()[ids] + pos.float()[positions + offset] + type_row.float()
    return F.layer_norm(x, (x.shape[-1],), weight.float(), bias.float(), eps)

