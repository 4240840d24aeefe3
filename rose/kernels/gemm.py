"""Small-M linear layers for the small-batch step: out = x @ w.T (+ bias, activation), in Triton.

At 64-512 rows cuBLAS picks tiles that leave most of an H200's SMs idle and pays a pipeline fill
per GEMM (BGE-M3's output projection at 128 rows: 3.9 us to read 2 MB of weights, 0.55 us at
full bandwidth). Here the tile grid is chosen for the rows, the K dimension can be split over
more programs (`split`) whose float32 partial sums the next kernel, the residual add + norm
(`add_norm`), reduces as it reads them, so the split costs no extra kernel; and every kernel
launches with programmatic dependent launch where the GPU has it (`rose.kernels.pdl`).

Two kernels:
- `linear(x, w, b, act)`: one bf16/fp16 output, bias and activation in the epilogue
  ("gelu": the tanh form, as `linear_gelu`; "swiglu": `w` holds [gate; up] rows and the output is
  silu(gate) * up, half as wide; "geglu": the same with the exact (erf) GELU, ModernBERT's;
  "geglu_tanh": with the tanh GELU, Gemma3's);
- `linear_partials(x, w, split)` + `add_norm(...)`: float32 partials [split, M, N], then bias +
  residual + LayerNorm (post-norm, BERT) or residual sum + its norm (pre-norm: RMSNorm for Qwen3,
  LayerNorm for ModernBERT; both the sum and its norm come out).
`*_reference` is the same maths in torch (float32), the CPU-runnable reference of the tests.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rose.kernels import launch

ACTS = {None: 0, "gelu": 1, "swiglu": 2, "geglu": 3, "geglu_tanh": 4}
GATED = ("swiglu", "geglu", "geglu_tanh")  # w holds [gate; up] rows: the output is half as wide


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_om, UP_OFFSET,
                   K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, USE_GDC: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    mask_m = offs_m[:, None] < M
    mask_n = offs_n[None, :] < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] view of w's rows
    if USE_GDC:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch now
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = acc
    for _ in range(0, K_SPLIT, BLOCK_K):
        a = tl.load(x_ptrs, mask=mask_m, other=0.0)
        acc = tl.dot(a, tl.load(w_ptrs, mask=mask_n, other=0.0), acc)
        if ACT >= 2:
            acc_up = tl.dot(a, tl.load(w_ptrs + UP_OFFSET, mask=mask_n, other=0.0), acc_up)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _epilogue(acc, acc_up if ACT >= 2 else acc, b_ptr, out_ptr, offs_m, offs_n, pid_k, M, N, stride_om, PARTIAL,
              HAS_BIAS, ACT)


@triton.jit
def _epilogue(acc, acc_up, b_ptr, out_ptr, offs_m, offs_n, pid_k, M, N, stride_om, PARTIAL: tl.constexpr,
              HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if PARTIAL:
        tl.store(out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if ACT == 1:  # GELU, tanh form: 0.5 (1 + tanh u) = sigmoid(2u)
            acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))
        if ACT == 2:
            acc = acc * tl.sigmoid(acc) * acc_up
        if ACT == 3:
            acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476)) * acc_up
        if ACT == 4:  # GeGLU with the tanh GELU (Gemma3's gelu_pytorch_tanh)
            acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc)) * acc_up
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _linear_tma_kernel(x_desc, w_desc, b_ptr, out_ptr, M, N, stride_om, K_SPLIT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                       PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, USE_GDC: tl.constexpr):
    """As `_linear_kernel`, with x and w read by the tensor-memory accelerator (TMA descriptors made
    on the host), so the K loop is pipelined `STAGES` deep whatever the compiler proves of pointers."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    k0 = pid_k * K_SPLIT
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = acc
    for k in tl.range(0, K_SPLIT, BLOCK_K, num_stages=STAGES):
        a = x_desc.load([off_m, k0 + k])
        acc = tl.dot(a, w_desc.load([off_n, k0 + k]).T, acc)
        if ACT >= 2:
            acc_up = tl.dot(a, w_desc.load([off_n + N, k0 + k]).T, acc_up)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    _epilogue(acc, acc_up, b_ptr, out_ptr, offs_m, offs_n, pid_k, M, N, stride_om, PARTIAL, HAS_BIAS, ACT)


@triton.jit
def _add_pair(a, b, c, d):
    return a + c, b + d


@triton.jit
def _add_norm_kernel(p_ptr, b_ptr, r_ptr, g_ptr, beta_ptr, gp_ptr, out_ptr, sum_ptr, M, N, eps,
                     SPLIT: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     POST: tl.constexpr, RMS: tl.constexpr, PRE: tl.constexpr, HAS_BETA: tl.constexpr, USE_GDC: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask_c = cols[None, :] < N
    mask = (rows[:, None] < M) & mask_c
    at = rows[:, None] * N + cols[None, :]
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(p_ptr + s * M * N + at, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if POST:  # the projection's own RMSNorm before the residual add (Gemma3), in the model's dtype
        gp = tl.load(gp_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        acc = acc * tl.rsqrt(tl.sum(acc * acc, axis=1) / N + eps)[:, None] * gp
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    acc += tl.load(r_ptr + at, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if PRE:  # pre-norm: the residual stream goes on (rounded as stored), its norm feeds the next block
        acc = acc.to(sum_ptr.dtype.element_ty).to(tl.float32)
        tl.store(sum_ptr + at, acc.to(sum_ptr.dtype.element_ty), mask=mask)
    if RMS:
        y = acc * tl.rsqrt(tl.sum(acc * acc, axis=1) / N + eps)[:, None] * g
    else:
        # mean and variance from one reduction of (sum, sum of squares): var = E[x^2] - mean^2 (a second,
        # centred pass measured 2.43 against 2.14 us a call at 128 rows on an H200)
        total, squares = tl.reduce((acc, acc * acc), 1, _add_pair)
        mean = total / N
        var = tl.maximum(squares / N - mean * mean, 0.0)
        y = (acc - mean[:, None]) * tl.rsqrt(var + eps)[:, None] * g
        if HAS_BETA:
            y += tl.load(beta_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=mask)


NormTile = tuple[int, int]  # rows per program, warps


@functools.cache
def _norm_override() -> NormTile | None:
    """ROSE_ADD_NORM_TILE=ROWS,WARPS: one `add_norm` launch tile for every call, a knob for
    measurements (`benchmarks.small_step`)."""
    env = os.environ.get("ROSE_ADD_NORM_TILE")
    return tuple(int(x) for x in env.split(",")) if env else None


Config = tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages


def tiles(m: int, n: int, k: int, split: int = 1) -> Config:
    """The tile config for an [m, k] x [k, n] product split `split` ways: aim for at least ~one
    program per SM (132 on an H200) without tiles under 64 x 32."""
    block_m = 128 if m >= 1024 else 64
    block_n = 64
    programs = -(-m // block_m) * -(-n // block_n) * split
    if programs < 128 and n % 32 == 0:
        block_n = 32
    kk = k // split
    block_k = 128 if kk % 128 == 0 and block_n == 32 else next((b for b in (64, 32, 16) if kk % b == 0), 0)
    if not block_k or k % split:
        raise ValueError(f"K {k} split {split} ways is not a multiple of 16")
    return block_m, block_n, block_k, 4, 4


SMS = 132  # an H200's SMs: the programs a split aims to fill

# Measured choices for the small-batch step (`python -m benchmarks.small_step`, H200, bf16, a CUDA
# graph of 24 layers' weights, PDL on; benchmarks/results/2026-12-01_h200_small-step/small_step_bge-m3.jsonl.gz): for a layer's
# (N, K) at up to M rows, (tile config, K split, TMA) of the fastest Triton variant. Shapes not
# listed take `tiles` / `split_for`.
TUNED: dict[tuple[int, int, int], tuple[Config, int, bool]] = {
    # bge-m3 (XLM-RoBERTa large): qkv 3072x1024, out 1024x1024, up 4096x1024, down 1024x4096
    (3072, 1024, 128): ((64, 32, 128, 4, 3), 1, True), (3072, 1024, 512): ((128, 64, 64, 4, 3), 1, True),
    (1024, 1024, 128): ((64, 64, 128, 4, 3), 4, True), (1024, 1024, 512): ((64, 128, 128, 4, 3), 2, True),
    (4096, 1024, 128): ((64, 64, 64, 4, 5), 1, False), (4096, 1024, 512): ((64, 64, 64, 4, 3), 1, True),
    (1024, 4096, 128): ((64, 32, 128, 4, 3), 4, True), (1024, 4096, 512): ((64, 128, 128, 4, 3), 2, True),
    # pplx-embed-1-0.6b (Qwen3-0.6B): out 1024x2048, gate/up 2x3072x1024 (3072 outputs: bge-m3's qkv
    # entries above were its best too), down 1024x3072
    (1024, 2048, 128): ((64, 32, 128, 4, 3), 4, True), (1024, 2048, 512): ((64, 64, 128, 4, 3), 2, True),
    (1024, 3072, 128): ((64, 32, 128, 4, 3), 4, True), (1024, 3072, 512): ((64, 64, 128, 4, 3), 2, True),
}


def triton_ops(default: frozenset) -> frozenset:
    """Which of a block's projections ("qkv", "out", "up", "down") a family's small step runs in
    Triton: the family's measured `default` (the others stay with cuBLAS / cuBLASLt), or the
    ROSE_TRITON_OPS environment variable (comma-separated), a knob for measurements."""
    env = os.environ.get("ROSE_TRITON_OPS")
    return frozenset(env.split(",")) if env else default


def plan(m: int, n: int, k: int) -> tuple[Config, int, bool]:
    """(config, split, tma) for an [m, k] x [k, n] product in the small-batch step."""
    for bucket in (128, 512):
        if m <= bucket and (n, k, bucket) in TUNED:
            return TUNED[(n, k, bucket)]
    return tiles(m, n, k, split := split_for(m, n, k)), split, False


def split_for(m: int, n: int, k: int) -> int:
    """How many ways to split K so that a [m, k] x [k, n] product launches about one program per SM,
    keeping at least 256 of K per program."""
    bm, bn = tiles(m, n, k)[:2]
    programs = -(-m // bm) * -(-n // bn)
    split = 1
    while programs * split * 2 <= SMS and k % (split * 2 * 64) == 0 and k // (split * 2) >= 256:
        split *= 2
    return split


def _run(x, w, b, out, n: int, split: int, act, partial: bool, config: Config | None, tma: bool):
    M, K = x.shape
    bm, bn, bk, warps, stages = config or tiles(M, n, K, split)
    if K % (split * bk):
        raise ValueError(f"K {K} does not split {split} ways in blocks of {bk}")
    grid = (triton.cdiv(n, bn), triton.cdiv(M, bm), split)
    kw = dict(K_SPLIT=K // split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PARTIAL=partial, HAS_BIAS=b is not None,
              ACT=ACTS[act], num_warps=warps)
    bias = b if b is not None else w
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xd = TensorDescriptor.from_tensor(x, [bm, bk])
        wd = TensorDescriptor.from_tensor(w, [bn, bk])
        launch(_linear_tma_kernel, grid, xd, wd, bias, out, M, n, out.stride(-2), STAGES=stages, **kw)
    else:
        launch(_linear_kernel, grid, x, w, bias, out, M, n, x.stride(0), w.stride(0), out.stride(-2),
                n * w.stride(0), num_stages=stages, **kw)
    return out


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, act: str | None = None,
           config: Config | None = None, tma: bool = False) -> torch.Tensor:
    """act(x @ w.T + b) for x [M, K] (rows contiguous), w [N, K] (or [2N, K] for swiglu / geglu, no
    bias) -> [M, N].
    Without `config`, the measured plan for this shape (`plan`)."""
    n = w.shape[0] // 2 if act in GATED else w.shape[0]
    if config is None:
        config, _, tma = plan(x.shape[0], n, x.shape[1])
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    return _run(x, w, b, out, n, 1, act, False, config, tma)


def linear_partials(x: torch.Tensor, w: torch.Tensor, split: int | None = None, config: Config | None = None,
                    tma: bool = False) -> torch.Tensor:
    """x @ w.T as `split` float32 partial sums over K: [split, M, N] (`add_norm` reduces them).
    Without `config` (and `split`), the measured plan for this shape (`plan`)."""
    if config is None and split is None:
        config, split, tma = plan(x.shape[0], w.shape[0], x.shape[1])
    split = split or 1
    out = torch.empty((split, x.shape[0], w.shape[0]), dtype=torch.float32, device=x.device)
    return _run(x, w, None, out, w.shape[0], split, None, True, config, tma)


def add_norm(partials: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
             norm_bias: torch.Tensor | None, eps: float, rms: bool = False, config: NormTile | None = None,
             pre: bool | None = None, post: torch.Tensor | None = None):
    """Sum the partials, add bias and residual, normalise each row (`config`: rows per program and
    warps; default one row and 8 warps, measured by `benchmarks.small_step --tiles`).

    rms: RMSNorm, else LayerNorm (with `norm_bias` where given; its mean and variance from one
    reduction of the sum and the sum of squares). pre (default: rms): pre-norm, as Qwen3 (RMSNorm)
    and ModernBERT (LayerNorm): returns (sum, norm(sum)), the sum rounded to
    residual's dtype first, as the unfused model rounds it; else post-norm, as BERT: norm(sum), in
    residual's dtype. post: the weight of an RMSNorm (same eps) applied to the projection before the
    residual add, its output rounded to residual's dtype (Gemma3's post-attention / post-feedforward
    norms, whose (1 + w) the caller passes)."""
    split, M, N = partials.shape
    pre = rms if pre is None else pre
    out = torch.empty_like(residual)
    total = torch.empty_like(residual) if pre else out
    rows, warps = config or _norm_override() or (1, 8)  # measured: 2.4 us against 3.3 with 4 warps (1024 wide)
    launch(_add_norm_kernel, (triton.cdiv(M, rows),), partials, bias if bias is not None else weight, residual,
           weight, norm_bias if norm_bias is not None else weight, post if post is not None else weight, out,
           total, M, N, eps, SPLIT=split, BLOCK=triton.next_power_of_2(N), ROWS=rows, HAS_BIAS=bias is not None,
           POST=post is not None, RMS=rms, PRE=pre, HAS_BETA=norm_bias is not None, num_warps=warps)
    return (total, out) if pre else out


# References: the unfused maths, float32 (CPU-runnable).

def linear_reference(x, w, b=None, act=None):
    y = x.float() @ w.float().T
    if act in GATED:
        gate, up = y.chunk(2, dim=-1)
        if act == "swiglu":
            return F.silu(gate) * up
        return F.gelu(gate, approximate="tanh" if act == "geglu_tanh" else "none") * up
    if b is not None:
        y = y + b.float()
    return F.gelu(y, approximate="tanh") if act == "gelu" else y


def add_norm_reference(y, bias, residual, weight, norm_bias, eps, rms=False, pre=None, post=None):
    y = y.float() + (bias.float() if bias is not None else 0)
    if post is not None:
        y = F.rms_norm(y, (y.shape[-1],), post.float(), eps).to(residual.dtype).float()
    s = y + residual.float()
    pre = rms if pre is None else pre
    if pre:
        s = s.to(residual.dtype).float()
    n = F.rms_norm(s, (s.shape[-1],), weight.float(), eps) if rms else \
        F.layer_norm(s, (s.shape[-1],), weight.float(), norm_bias.float() if norm_bias is not None else None, eps)
    return (s, n) if pre else n
