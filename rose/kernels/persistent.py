"""A prototype (issue #52): one post-norm BERT encoder layer in ONE persistent Triton kernel, for small
steps (one sequence of up to 128 tokens), to measure against today's ~7 kernels a layer
(`rose.layers.small_step.post_norm_block`) before any model uses it. Not wired into any model.

The launch is `programs` programs (default: one per SM) that loop, each taking the next tile index
from a global atomic counter (the queue) until the layer's tiles run out. Tiles are numbered in
topological order, stage by stage:

    q/k/v GEMM tiles -> attention (head, query block) -> output projection (split-K partials)
    -> add + LayerNorm rows -> up projection + GELU -> down projection (split-K partials)
    -> add + LayerNorm rows

Before computing, a tile waits (spins) only on the counters of the tiles it reads: attention of head h
on head h's q/k/v tiles, an output-projection tile on the heads of its K chunk, a LayerNorm row tile on
every output tile, an up tile on every LayerNorm row, a down tile on the up tiles of its K chunk, the
last LayerNorm on every down tile; and it publishes its own completion by an atomic add on its
consumers' counter. So the weight stream need not stop between operations: a program that took a tile
whose inputs are not ready yet first asks the L2 to fetch its weights (`prefetch`), and with `lookahead`
takes its next tile (and prefetches its weights) before computing the current one.

Memory ordering (CUDA): a tile's stores, a CTA barrier, then one thread's acquire-release atomic add
(the pattern of CUTLASS's split-K semaphore); a waiter spins on volatile loads, then one acquire load,
then a CTA barrier, before reading. No deadlock whatever the grid: a program only takes a tile while it
runs, and the smallest unfinished tile only waits on smaller ones, all finished, so its program goes on.
Waits give up after `max_spins` polls and count the failure in `err` (a hang would take the GPU's
context down with it). The last program out sets the counters back to zero for the next launch.

Under Triton's interpreter (the CPU tests) programs run one after another, so the first takes every tile
in queue order; with `max_spins=0` any wait not already satisfied is counted in `err`, which checks that
the queue order is topological for the waits and the maths of every stage, but not the memory ordering
nor that each wait covers everything its tile reads (the GPU check does, by running repeatedly).

`layer_reference`-style checking is done against the block's own eager forward (`rose.models.bert`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rose.kernels import interpreted, launch

MAX_ROWS = 128  # the tile holds every row of the step: [128, BLOCK_N] accumulators


@dataclass(frozen=True)
class PersistentConfig:
    """The launch of `persistent_layer`.

    block_n: output columns per tile of the q/k/v, output and down projections (divides hidden);
    block_n_up: of the up projection (its tiles hold whole sums: GELU comes next; divides the FFN width);
    block_k: the K step of every GEMM tile's loop;
    split_qkv / split_out / split_down: K splits of those projections (float32 partials, summed by the
    stage that reads them: attention, the LayerNorm rows);
    attn_block_m: query rows per attention tile; ln_rows: rows per add + LayerNorm tile;
    num_warps / num_stages: of the kernel (stages: the GEMM loops' software pipelining);
    programs: the grid (None: one per SM; 4 under the interpreter);
    prefetch: L2 prefetch of a tile's weights as it is taken (CUDA only: inline PTX);
    lookahead: take the next tile (and prefetch it) before computing the current one;
    max_spins: polls of one wait before it gives up and counts in `err` (None: 2^17 on CUDA, ~0.05-0.1 s
    against waits of microseconds; 0 interpreted).
    """

    block_n: int = 64
    block_n_up: int = 64
    block_k: int = 64
    split_qkv: int = 1
    split_out: int = 4
    split_down: int = 4
    attn_block_m: int = 64
    ln_rows: int = 8
    num_warps: int = 4
    num_stages: int = 3
    programs: int | None = None
    prefetch: bool = True
    lookahead: bool = True
    max_spins: int | None = None


@dataclass(frozen=True)
class LayerWeights:
    """One post-norm block's parameters, Hugging Face BERT's (q/k/v stacked as ROSE stacks them)."""

    wqkv: torch.Tensor  # [3H, H]
    bqkv: torch.Tensor
    wo: torch.Tensor  # [H, H]
    bo: torch.Tensor
    g1: torch.Tensor  # attention output's LayerNorm
    b1: torch.Tensor
    eps1: float
    wu: torch.Tensor  # [F, H]
    bu: torch.Tensor
    wd: torch.Tensor  # [H, F]
    bd: torch.Tensor
    g2: torch.Tensor
    b2: torch.Tensor
    eps2: float
    heads: int

    @classmethod
    def from_bert(cls, layer) -> LayerWeights:
        """From `rose.models.bert.BertLayer` (BERT, XLM-RoBERTa)."""
        sa, so, up, out = layer.attention.self, layer.attention.output, layer.intermediate.dense, layer.output
        return cls(sa.qkv.weight, sa.qkv.bias, so.dense.weight, so.dense.bias, so.LayerNorm.weight, so.LayerNorm.bias,
                   so.LayerNorm.eps, up.weight, up.bias, out.dense.weight, out.dense.bias, out.LayerNorm.weight,
                   out.LayerNorm.bias, out.LayerNorm.eps, sa.num_heads)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.wqkv, self.bqkv, self.wo, self.bo, self.g1, self.b1,
                                                          self.wu, self.bu, self.wd, self.bd, self.g2, self.b2))


@triton.jit
def _now():
    """The GPU's global nanosecond timer (comparable across SMs)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _smid():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait(sync_ptr, idx, target, err_ptr, max_spins, prof_ptr, PROFILE: tl.constexpr):
    """Spin until counter `idx` reaches `target` (volatile polls by every thread, then one acquire load
    that synchronizes with the publishers' releases, then a CTA barrier so every thread reads after it)."""
    spins = 0
    while (tl.load(sync_ptr + idx, volatile=True) < target) & (spins < max_spins):
        spins += 1
    seen = tl.atomic_add(sync_ptr + idx, 0, sem="acquire")
    if seen < target:
        tl.atomic_add(err_ptr, 1)  # gave up: counted, the result is garbage
    tl.debug_barrier()
    if PROFILE:
        tl.store(prof_ptr, _now())  # when the tile's inputs were ready


@triton.jit
def _publish(sync_ptr, idx):
    """Every thread's stores of this tile, then one thread's release add on counter `idx`."""
    tl.debug_barrier()
    tl.atomic_add(sync_ptr + idx, 1, sem="release")


@triton.jit
def _prefetch(w_ptr, stride_w, n0, k0, BN: tl.constexpr, KC: tl.constexpr, LINE: tl.constexpr,
              LANES: tl.constexpr):
    """Ask the L2 for the weight tile [n0:n0+BN, k0:k0+KC], one prefetch per 128-byte line (LINE elements):
    the HBM stream of a tile that may have to wait starts before the wait. LANES (`prefetch_lanes`): the
    lines of a row's chunk rounded up to a power of two (tl.arange's sizes), at least one."""
    rows = n0 + tl.arange(0, BN)
    lines = tl.arange(0, LANES)
    if LANES * LINE > KC:  # a chunk under one line, or not in whole lines: the spare lanes take its last line again
        ptrs = w_ptr + rows[:, None] * stride_w + k0 + tl.minimum(lines * LINE, KC - 1)[None, :]
    else:
        ptrs = w_ptr + rows[:, None] * stride_w + k0 + lines[None, :] * LINE
    tl.inline_asm_elementwise("mov.u32 $0, 0; prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _gemm(a_ptr, stride_a, w_ptr, stride_w, M, n0, k0, KC: tl.constexpr, BLOCK_M: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, STAGES: tl.constexpr):
    """a[:M, k0:k0+KC] @ w[n0:n0+BN, k0:k0+KC].T in float32: [BLOCK_M, BN]."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + offs_m[:, None] * stride_a + k0 + offs_k[None, :]
    w_ptrs = w_ptr + (n0 + tl.arange(0, BN))[None, :] * stride_w + k0 + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
    for _ in tl.range(0, KC, BK, num_stages=STAGES):
        acc = tl.dot(tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0), tl.load(w_ptrs), acc)
        a_ptrs += BK
        w_ptrs += BK
    return acc


@triton.jit
def _load_qkv(ws_ptr, b_ptr, rows, M, col, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, N3: tl.constexpr,
              D: tl.constexpr, S: tl.constexpr, DT: tl.constexpr):
    """Rows `rows` of q/k/v columns [col, col + D): the S partial sums + bias, rounded to the model's dtype
    (as the q/k/v GEMM's output is)."""
    d = tl.arange(0, D)
    mask = rows[:, None] < M
    acc = tl.zeros((ROWS, D), dtype=tl.float32)
    for s in tl.static_range(S):
        acc += tl.load(ws_ptr + s * BLOCK_M * N3 + rows[:, None] * N3 + col + d[None, :], mask=mask, other=0.0,
                       cache_modifier=".cg")
    return (acc + tl.load(b_ptr + col + d).to(tl.float32)[None, :]).to(DT)


@triton.jit
def _add_norm(p_ptr, b_ptr, r_ptr, g_ptr, beta_ptr, out_ptr, r0, M, eps, BLOCK_M: tl.constexpr, H: tl.constexpr,
              BLOCK_H: tl.constexpr, S: tl.constexpr, ROWS: tl.constexpr):
    """Rows [r0, r0 + ROWS): LayerNorm(sum of S float32 partials + bias + residual) -> out (model dtype)."""
    rows = r0 + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < M) & (cols[None, :] < H)
    at = rows[:, None] * H + cols[None, :]
    acc = tl.load(r_ptr + at, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    for s in tl.static_range(S):
        acc += tl.load(p_ptr + s * BLOCK_M * H + at, mask=mask, other=0.0, cache_modifier=".cg")
    acc += tl.load(b_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
    mean = tl.sum(acc, axis=1) / H
    xc = tl.where(mask, acc - mean[:, None], 0.0)
    inv = tl.rsqrt(tl.sum(xc * xc, axis=1) / H + eps)
    y = xc * inv[:, None] * tl.load(g_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
    y += tl.load(beta_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prefetch_tile(t, wo_ptr, wu_ptr, wd_ptr, E1: tl.constexpr, E2: tl.constexpr, E3: tl.constexpr,
                   E4: tl.constexpr, E5: tl.constexpr, H: tl.constexpr, F: tl.constexpr,
                   BN: tl.constexpr, BN_UP: tl.constexpr, KC_O: tl.constexpr, KC_D: tl.constexpr, LINE: tl.constexpr,
                   PF_O: tl.constexpr, PF_U: tl.constexpr, PF_D: tl.constexpr):
    """The weights of tile t, for the stages that wait before reading them (out, up, down); PF_*: their
    prefetch lanes per row (`prefetch_lanes` of KC_O, H, KC_D)."""
    if (t >= E1) & (t < E2):
        j = t - E1
        _prefetch(wo_ptr, H, (j % (H // BN)) * BN, (j // (H // BN)) * KC_O, BN, KC_O, LINE, PF_O)
    elif (t >= E3) & (t < E4):
        _prefetch(wu_ptr, H, (t - E3) * BN_UP, 0, BN_UP, H, LINE, PF_U)
    elif (t >= E4) & (t < E5):
        j = t - E4
        _prefetch(wd_ptr, F, (j % (H // BN)) * BN, (j // (H // BN)) * KC_D, BN, KC_D, LINE, PF_D)


@triton.jit
def _layer_kernel(x_ptr, wqkv_ptr, bqkv_ptr, wo_ptr, bo_ptr, g1_ptr, be1_ptr, wu_ptr, bu_ptr, wd_ptr, bd_ptr,
                  g2_ptr, be2_ptr, qkv_ws, a_ws, o_ws, h1_ptr, f_ws, d_ws, y_ptr, sync_ptr, err_ptr, prof_ptr,
                  M, eps1, eps2, qk_scale, max_spins,
                  H: tl.constexpr, F: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_H: tl.constexpr, BN: tl.constexpr, BN_UP: tl.constexpr, BK: tl.constexpr,
                  S_QKV: tl.constexpr, S_O: tl.constexpr, S_D: tl.constexpr, ATT_BM: tl.constexpr,
                  LN_ROWS: tl.constexpr, HEADS_PER_TILE: tl.constexpr, HEAD_TARGET: tl.constexpr,
                  GELU_TANH: tl.constexpr, PREFETCH: tl.constexpr, LOOKAHEAD: tl.constexpr, LINE: tl.constexpr,
                  PF_O: tl.constexpr, PF_U: tl.constexpr, PF_D: tl.constexpr, SYNC_BLOCK: tl.constexpr,
                  STAGES: tl.constexpr, PROFILE: tl.constexpr, USE_GDC: tl.constexpr):
    DT = x_ptr.dtype.element_ty
    N3: tl.constexpr = 3 * H
    KC_Q: tl.constexpr = H // S_QKV
    KC_O: tl.constexpr = H // S_O
    KC_D: tl.constexpr = F // S_D
    NQB: tl.constexpr = BLOCK_M // ATT_BM
    NL: tl.constexpr = (BLOCK_M + LN_ROWS - 1) // LN_ROWS
    # the counters (sync_ptr, int32): queue, exit, per head, per output-projection K chunk, output done,
    # LayerNorm 1 done, per down-projection K chunk, down done
    HEAD0: tl.constexpr = 2
    ACH0: tl.constexpr = HEAD0 + HEADS
    OUT: tl.constexpr = ACH0 + S_O
    LN1: tl.constexpr = OUT + 1
    UCH0: tl.constexpr = LN1 + 1
    DOWN: tl.constexpr = UCH0 + S_D
    NSYNC: tl.constexpr = DOWN + 1
    # the stages' ends in queue order
    E0: tl.constexpr = 3 * (H // BN) * S_QKV
    E1: tl.constexpr = E0 + HEADS * NQB
    E2: tl.constexpr = E1 + (H // BN) * S_O
    E3: tl.constexpr = E2 + NL
    E4: tl.constexpr = E3 + F // BN_UP
    E5: tl.constexpr = E4 + (H // BN) * S_D
    TOTAL: tl.constexpr = E5 + NL
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m[:, None] < M

    if USE_GDC:  # the previous layer's output and the counters it reset are ours only after its grid is done
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.atomic_add(sync_ptr, 1)
    if PREFETCH:
        _prefetch_tile(t, wo_ptr, wu_ptr, wd_ptr, E1, E2, E3, E4, E5, H, F, BN, BN_UP, KC_O, KC_D, LINE,
                       PF_O, PF_U, PF_D)
    while t < TOTAL:
        if PROFILE:  # per tile: taken, inputs ready, done (global ns), SM
            tl.store(prof_ptr + t * 4, _now())
        nxt = TOTAL
        if LOOKAHEAD:
            nxt = tl.atomic_add(sync_ptr, 1)
            if PREFETCH:
                _prefetch_tile(nxt, wo_ptr, wu_ptr, wd_ptr, E1, E2, E3, E4, E5, H, F, BN, BN_UP, KC_O, KC_D, LINE,
                               PF_O, PF_U, PF_D)
        if t < E0:  # q/k/v: column group g of part p (q, k, v), K split s; its inputs are the layer's
            s = t % S_QKV
            p = (t // S_QKV) % 3
            g = t // (S_QKV * 3)
            n0 = p * H + g * BN
            if PROFILE:
                tl.store(prof_ptr + t * 4 + 1, _now())
            acc = _gemm(x_ptr, H, wqkv_ptr, H, M, n0, s * KC_Q, KC_Q, BLOCK_M, BN, BK, STAGES)
            cols = n0 + tl.arange(0, BN)
            tl.store(qkv_ws + s * BLOCK_M * N3 + offs_m[:, None] * N3 + cols[None, :], acc, mask=mask_m)
            for j in tl.static_range(HEADS_PER_TILE):
                _publish(sync_ptr, HEAD0 + (g * BN) // D + j)
        elif t < E1:  # attention: head h, query block qb, every key of the one sequence at once
            h = (t - E0) // NQB
            qb = (t - E0) % NQB
            _wait(sync_ptr, HEAD0 + h, HEAD_TARGET, err_ptr, max_spins, prof_ptr + t * 4 + 1, PROFILE)
            rows = qb * ATT_BM + tl.arange(0, ATT_BM)
            q = _load_qkv(qkv_ws, bqkv_ptr, rows, M, h * D, ATT_BM, BLOCK_M, N3, D, S_QKV, DT)
            k = _load_qkv(qkv_ws, bqkv_ptr, offs_m, M, H + h * D, BLOCK_M, BLOCK_M, N3, D, S_QKV, DT)
            v = _load_qkv(qkv_ws, bqkv_ptr, offs_m, M, 2 * H + h * D, BLOCK_M, BLOCK_M, N3, D, S_QKV, DT)
            sc = tl.dot(q, tl.trans(k)) * qk_scale  # log2 domain
            sc = tl.where(offs_m[None, :] < M, sc, float("-inf"))
            pr = tl.math.exp2(sc - tl.max(sc, axis=1)[:, None])
            o = tl.dot(pr.to(DT), v) / tl.sum(pr, axis=1)[:, None]
            d = tl.arange(0, D)
            tl.store(a_ws + rows[:, None] * H + h * D + d[None, :], o.to(DT), mask=rows[:, None] < M)
            _publish(sync_ptr, ACH0 + (h * D) // KC_O)
        elif t < E2:  # output projection: columns n, K chunk s (the heads of that chunk) -> float32 partials
            s = (t - E1) // (H // BN)
            n0 = ((t - E1) % (H // BN)) * BN
            _wait(sync_ptr, ACH0 + s, (KC_O // D) * NQB, err_ptr, max_spins, prof_ptr + t * 4 + 1, PROFILE)
            acc = _gemm(a_ws, H, wo_ptr, H, M, n0, s * KC_O, KC_O, BLOCK_M, BN, BK, STAGES)
            cols = n0 + tl.arange(0, BN)
            tl.store(o_ws + s * BLOCK_M * H + offs_m[:, None] * H + cols[None, :], acc, mask=mask_m)
            _publish(sync_ptr, OUT)
        elif t < E3:  # bias + residual (the layer's input) + LayerNorm, on every output tile
            _wait(sync_ptr, OUT, (H // BN) * S_O, err_ptr, max_spins, prof_ptr + t * 4 + 1, PROFILE)
            _add_norm(o_ws, bo_ptr, x_ptr, g1_ptr, be1_ptr, h1_ptr, (t - E2) * LN_ROWS, M, eps1, BLOCK_M, H,
                      BLOCK_H, S_O, LN_ROWS)
            _publish(sync_ptr, LN1)
        elif t < E4:  # up projection + bias + GELU, on every LayerNorm row
            n0 = (t - E3) * BN_UP
            _wait(sync_ptr, LN1, NL, err_ptr, max_spins, prof_ptr + t * 4 + 1, PROFILE)
            acc = _gemm(h1_ptr, H, wu_ptr, H, M, n0, 0, H, BLOCK_M, BN_UP, BK, STAGES)
            cols = n0 + tl.arange(0, BN_UP)
            acc += tl.load(bu_ptr + cols).to(tl.float32)[None, :]
            if GELU_TANH:  # 0.5 (1 + tanh u) = sigmoid(2u)
                acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))
            else:
                acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
            tl.store(f_ws + offs_m[:, None] * F + cols[None, :], acc.to(DT), mask=mask_m)
            _publish(sync_ptr, UCH0 + n0 // KC_D)
        elif t < E5:  # down projection: columns n, K chunk s (the up tiles of that chunk) -> float32 partials
            s = (t - E4) // (H // BN)
            n0 = ((t - E4) % (H // BN)) * BN
            _wait(sync_ptr, UCH0 + s, KC_D // BN_UP, err_ptr, max_spins, prof_ptr + t * 4 + 1, PROFILE)
            acc = _gemm(f_ws, F, wd_ptr, F, M, n0, s * KC_D, KC_D, BLOCK_M, BN, BK, STAGES)
            cols = n0 + tl.arange(0, BN)
            tl.store(d_ws + s * BLOCK_M * H + offs_m[:, None] * H + cols[None, :], acc, mask=mask_m)
            _publish(sync_ptr, DOWN)
        else:  # bias + residual (LayerNorm 1's output) + LayerNorm: the layer's output
            _wait(sync_ptr, DOWN, (H // BN) * S_D, err_ptr, max_spins, prof_ptr + t * 4 + 1, PROFILE)
            _add_norm(d_ws, bd_ptr, h1_ptr, g2_ptr, be2_ptr, y_ptr, (t - E5) * LN_ROWS, M, eps2, BLOCK_M, H,
                      BLOCK_H, S_D, LN_ROWS)
        if PROFILE:
            tl.debug_barrier()
            tl.store(prof_ptr + t * 4 + 2, _now())
            tl.store(prof_ptr + t * 4 + 3, _smid().to(tl.int64))
        if LOOKAHEAD:
            t = nxt
        else:
            t = tl.atomic_add(sync_ptr, 1)
            if PREFETCH:
                _prefetch_tile(t, wo_ptr, wu_ptr, wd_ptr, E1, E2, E3, E4, E5, H, F, BN, BN_UP, KC_O, KC_D, LINE,
                               PF_O, PF_U, PF_D)
    # out of tiles: the last program out resets the counters (no other program touches them any more)
    tl.debug_barrier()
    if tl.atomic_add(sync_ptr + 1, 1) == tl.num_programs(0) - 1:
        offs = tl.arange(0, SYNC_BLOCK)
        tl.store(sync_ptr + offs, tl.zeros_like(offs), mask=offs < NSYNC)


def sync_size(heads: int, config: PersistentConfig) -> int:
    """Counters of one launch (the kernel's layout: queue, exit, heads, out chunks, out, LN1, down chunks, down)."""
    return 2 + heads + config.split_out + 2 + config.split_down + 1


class Workspace:
    """The kernel's scratch for up to `rows` rows (float32 partials, the attention output, LayerNorm 1's
    output, the FFN activation) and its counters (zero between launches: the last program resets them),
    shared by every layer launched one after another on one stream."""

    def __init__(self, hidden: int, ffn: int, heads: int, config: PersistentConfig, device, dtype, rows: int = MAX_ROWS):
        bm = max(16, triton.next_power_of_2(rows))
        f32 = dict(device=device, dtype=torch.float32)
        self.block_m = bm
        self.qkv = torch.empty(config.split_qkv, bm, 3 * hidden, **f32)
        self.a = torch.empty(bm, hidden, device=device, dtype=dtype)
        self.o = torch.empty(config.split_out, bm, hidden, **f32)
        self.h1 = torch.empty(bm, hidden, device=device, dtype=dtype)
        self.f = torch.empty(bm, ffn, device=device, dtype=dtype)
        self.d = torch.empty(config.split_down, bm, hidden, **f32)
        self.sync = torch.zeros(sync_size(heads, config), device=device, dtype=torch.int32)
        self.err = torch.zeros(1, device=device, dtype=torch.int32)  # failed waits, summed over launches


def check(hidden: int, ffn: int, heads: int, rows: int, config: PersistentConfig) -> None:
    """ValueError (quoting the bad value) for a shape or config the kernel's tiling does not cover."""
    c, d = config, hidden // heads
    problems = [
        (rows > MAX_ROWS or rows < 1, f"rows {rows} not in 1..{MAX_ROWS}"),
        (hidden % heads or d < 16 or d & (d - 1), f"head dim {hidden}/{heads} not a power of two >= 16"),
        (hidden % c.block_n or ffn % c.block_n_up, f"hidden {hidden} / ffn {ffn} not in tiles of block_n "
         f"{c.block_n} / block_n_up {c.block_n_up}"),
        (hidden % c.split_out or ffn % c.split_down or hidden % c.split_qkv, f"split_qkv {c.split_qkv} / split_out "
         f"{c.split_out} / split_down {c.split_down} do not divide K ({hidden}, {hidden}, {ffn})"),
        (c.block_n % d and d % c.block_n, f"block_n {c.block_n} neither divides nor is a multiple of head dim {d}"),
        ((hidden // c.split_qkv) % c.block_k, f"hidden {hidden} / split_qkv {c.split_qkv} not in blocks of {c.block_k}"),
        ((hidden // c.split_out) % d, f"hidden {hidden} / split_out {c.split_out} not whole heads of {d}"),
        ((hidden // c.split_out) % c.block_k or hidden % c.block_k, f"block_k {c.block_k} does not divide the chunks"),
        ((ffn // c.split_down) % c.block_n_up or (ffn // c.split_down) % c.block_k,
         f"ffn {ffn} / split_down {c.split_down} not in blocks of block_n_up {c.block_n_up} and block_k {c.block_k}"),
        (c.attn_block_m & (c.attn_block_m - 1) or c.attn_block_m < 16, f"attn_block_m {c.attn_block_m}"),
        (c.ln_rows & (c.ln_rows - 1), f"ln_rows {c.ln_rows} not a power of two"),
    ]
    for bad, msg in problems:
        if bad:
            raise ValueError(f"persistent layer: {msg}")


def default_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def persistent_layer(x: torch.Tensor, w: LayerWeights, ws: Workspace, config: PersistentConfig = PersistentConfig(),
                     gelu: str = "tanh", profile: torch.Tensor | None = None) -> torch.Tensor:
    """One post-norm BERT layer on x [M, hidden] (one sequence, M <= 128; weights in x's dtype) -> [M, hidden],
    in one launch. gelu: "tanh" (what ROSE's GPU paths apply for BERT's "gelu") or "erf". profile (CUDA only):
    int64 [tiles, 4] that gets each tile's (taken, inputs ready, done) global-timer nanoseconds and SM, in
    queue order (`tile_counts`)."""
    M, H = x.shape
    F = w.wu.shape[0]
    c = config
    check(H, F, w.heads, M, c)
    bm = max(16, triton.next_power_of_2(M))  # the tiles' rows: every row of the step
    if bm > ws.block_m:
        raise ValueError(f"persistent layer: {M} rows over the workspace's {ws.block_m}")
    D = H // w.heads
    y = torch.empty_like(x)
    programs = c.programs or default_programs(x.device)
    interp = interpreted() or x.device.type != "cuda"
    if profile is not None and (interp or profile.shape != (sum(tile_counts(H, F, w.heads, M, c).values()), 4)):
        raise ValueError(f"persistent layer: profile {tuple(profile.shape)} is not [tiles, 4] int64 on CUDA")
    max_spins = c.max_spins if c.max_spins is not None else (0 if interp else 1 << 17)
    launch(_layer_kernel, (programs,), x, w.wqkv, w.bqkv, w.wo, w.bo, w.g1, w.b1, w.wu, w.bu, w.wd, w.bd, w.g2, w.b2,
           ws.qkv, ws.a, ws.o, ws.h1, ws.f, ws.d, y, ws.sync, ws.err, profile if profile is not None else ws.sync, M,
           w.eps1, w.eps2, math.log2(math.e) / math.sqrt(D), max_spins,
           **kernel_constexprs(H, F, w.heads, M, c, x.element_size(), gelu=gelu, prefetch=c.prefetch and not interp,
                               profile=profile is not None),
           num_warps=c.num_warps, num_stages=c.num_stages)
    return y


def prefetch_lanes(kc: int, line: int) -> int:
    """Prefetches per weight row of a K chunk of `kc` elements: one per `line`-element (128-byte) line, rounded
    up to a power of two (tl.arange's sizes; the spare lanes repeat the chunk's last line), at least one: a chunk
    under one line (hidden 64 in two K splits of bf16: 32 elements against 64) had asked for tl.arange(0, 0),
    and hidden 768 or 384 for 12 or 6 lanes, neither of which compiles. Counted here, not in the kernel: there
    triton.next_power_of_2 is callable only from Triton 3.5 (a constexpr_function), and we take Triton >= 3.2."""
    return triton.next_power_of_2(-(-kc // line))


def kernel_constexprs(hidden: int, ffn: int, heads: int, rows: int, config: PersistentConfig, element_size: int,
                      gelu: str = "tanh", prefetch: bool | None = None, profile: bool = False) -> dict:
    """`_layer_kernel`'s compile-time arguments (all but USE_GDC, which `launch` adds) for a step of `rows`
    rows in a dtype of `element_size` bytes: what `persistent_layer` launches with and
    `benchmarks.persistent --compile-only` compiles. prefetch: None takes the config's."""
    c, H, F = config, hidden, ffn
    bm, D, line = max(16, triton.next_power_of_2(rows)), H // heads, 128 // element_size
    return dict(H=H, F=F, HEADS=heads, D=D, BLOCK_M=bm, BLOCK_H=triton.next_power_of_2(H), BN=c.block_n,
                BN_UP=c.block_n_up, BK=c.block_k, S_QKV=c.split_qkv, S_O=c.split_out, S_D=c.split_down,
                ATT_BM=min(c.attn_block_m, bm), LN_ROWS=c.ln_rows, HEADS_PER_TILE=max(1, c.block_n // D),
                HEAD_TARGET=3 * max(1, D // c.block_n) * c.split_qkv, GELU_TANH=gelu == "tanh",
                PREFETCH=c.prefetch if prefetch is None else prefetch, LOOKAHEAD=c.lookahead, LINE=line,
                PF_O=prefetch_lanes(H // c.split_out, line), PF_U=prefetch_lanes(H, line),
                PF_D=prefetch_lanes(F // c.split_down, line),
                SYNC_BLOCK=triton.next_power_of_2(sync_size(heads, c)), STAGES=c.num_stages, PROFILE=profile)


def tile_counts(hidden: int, ffn: int, heads: int, rows: int, config: PersistentConfig) -> dict[str, int]:
    """Tiles per stage, in queue order (what the kernel's E0..TOTAL count)."""
    c = config
    bm = max(16, triton.next_power_of_2(rows))
    nl = -(-bm // c.ln_rows)
    return {"qkv": 3 * hidden // c.block_n * c.split_qkv, "attention": heads * (bm // min(c.attn_block_m, bm)),
            "out": hidden // c.block_n * c.split_out, "norm1": nl, "up": ffn // c.block_n_up,
            "down": hidden // c.block_n * c.split_down, "norm2": nl}
