"""Row-wise float8 (e4m3) quantisation of activations, fused into the kernel that produces them, in Triton.

The fp8 path (`rose.layers.fp8`) feeds `torch._scaled_mm` an e4m3 activation with one float32 scale per
row (scale = the row's largest |value| / 448, e4m3's largest finite value; value / scale clamped to
+-448, rounded to nearest even). Quantising in a pass of its own would read and write every activation
once more; here the kernel that already holds a row in registers writes its fp8 form and scale too:
- `norm_quant(y, residual, weight, bias, eps, rms, pre, out, quant)`: residual add + LayerNorm (post-norm,
  BERT: the bf16 output is the next residual AND the next GEMM's input) or RMSNorm (pre-norm, Qwen3:
  the rounded sum goes on as the residual stream, its norm only into the next GEMM, so only fp8 is
  written for it), with the fp8 rows and scales of the normed output; no residual: a norm alone
  (Qwen3's first block);
- `act_quant(y, act)`: the FFN's activation (GELU, erf or tanh form; SwiGLU over [gate | up] columns)
  applied to the up projection's bf16 output, quantised for the down projection;
- `quant_rows(x)`: quantisation alone (the attention output, and BERT's embeddings before the first
  block: a separate small kernel, as the attention kernels are not ours to change here).
Each kernel works on ROWS rows of one program, the whole row in registers (BLOCK, its width rounded
up to a power of two). The same maths in torch (float32) is `rose.layers.fp8`'s (`quantize`, `quant_rows_torch`,
`norm_quant_torch`): the engine's path on a CPU (no Triton needed) and the tests' reference.

Triton's interpreter (the CPU tests) converts float32 to e4m3 wrongly (its mantissa carry ORs into
the exponent instead of adding: 31.7 becomes 16, not 32; ties round up) and to bfloat16 by truncation,
so there (`ROUND`) the kernels first round to the format's grid in float32 themselves (nearest, ties to
even), which the conversion then keeps exactly; on a GPU the hardware conversion rounds so and the
step is compiled out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rose.kernels import interpreted, launch

FP8 = torch.float8_e4m3fn  # 448.0 below: e4m3fn's largest finite value; 1e-12: an all-zero row's amax
ACTS = {None: 0, "gelu": 1, "gelu_tanh": 2, "swiglu": 3}


@triton.jit
def _e4m3_grid(v):
    """v (float32, |v| <= 448) rounded to nearest even on e4m3's grid, in float32: 3 mantissa bits, the
    spacing of v's binade 2^(e - 3), subnormals below 2^-6 spaced 2^-9 (the interpreter's fix)."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    # adding then subtracting 1.5 * 2^23 rounds |v / step| <= 16 to an integer, ties to even (float32's own rounding)
    r = (v / step + 12582912.0) - 12582912.0
    return r * step


@triton.jit
def _rounded(v, ptr, ROUND: tl.constexpr):
    """v (float32) as stored at ptr: under the interpreter (`ROUND`) a bfloat16 store truncates, so v is
    first rounded to bfloat16's grid (nearest, ties to even) in float32, as a GPU's conversion rounds."""
    if ROUND:
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = v.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            v = bits.to(tl.float32, bitcast=True)
    return v.to(ptr.dtype.element_ty)


@triton.jit
def _quant_store(y, rows, cols, mask, q_ptr, s_ptr, M, N, ROUND: tl.constexpr):
    """y [ROWS, BLOCK] float32 (masked columns 0) -> e4m3 rows at q_ptr [M, N] and scales at s_ptr [M]."""
    amax = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-12)
    scale = amax / 448.0
    v = tl.minimum(tl.maximum(y / scale[:, None], -448.0), 448.0)
    if ROUND:
        v = _e4m3_grid(v)
    tl.store(q_ptr + rows[:, None] * N + cols[None, :], v.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows, scale, mask=rows < M)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, M, N, stride_x, BLOCK: tl.constexpr, ROWS: tl.constexpr, ACT: tl.constexpr,
                  ROUND: tl.constexpr, USE_GDC: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    at = x_ptr + rows[:, None] * stride_x + cols[None, :]
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    if ACT == 1:  # GELU, erf form (hidden_act "gelu")
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    if ACT == 2:  # GELU, tanh form: 0.5 (1 + tanh u) = sigmoid(2u)
        y = y * tl.sigmoid(1.5957691216057308 * (y + 0.044715 * y * y * y))
    if ACT == 3:  # SwiGLU: x holds [gate | up] columns, N of each
        up = tl.load(at + N, mask=mask, other=0.0).to(tl.float32)
        y = y * tl.sigmoid(y) * up
    _quant_store(y, rows, cols, mask, q_ptr, s_ptr, M, N, ROUND)


@triton.jit
def _norm_quant_kernel(y_ptr, r_ptr, g_ptr, b_ptr, out_ptr, sum_ptr, q_ptr, s_ptr, M, N, eps,
                       BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr, RMS: tl.constexpr,
                       PRE: tl.constexpr, HAS_BETA: tl.constexpr, OUT: tl.constexpr, QUANT: tl.constexpr,
                       ROUND: tl.constexpr, USE_GDC: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    in_c = cols < N
    mask = (rows[:, None] < M) & in_c[None, :]
    at = rows[:, None] * N + cols[None, :]
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.load(y_ptr + at, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        acc += tl.load(r_ptr + at, mask=mask, other=0.0).to(tl.float32)
    if PRE:  # pre-norm: the residual stream goes on, rounded as stored; its norm feeds the next GEMM
        acc = _rounded(acc, sum_ptr, ROUND).to(tl.float32)
        tl.store(sum_ptr + at, acc.to(sum_ptr.dtype.element_ty), mask=mask)
    g = tl.load(g_ptr + cols, mask=in_c, other=0.0).to(tl.float32)[None, :]
    if RMS:
        y = acc * tl.rsqrt(tl.sum(acc * acc, axis=1) / N + eps)[:, None] * g
    else:  # the row is in registers: a centred second pass costs no memory traffic
        mean = tl.sum(acc, axis=1) / N
        xc = tl.where(in_c[None, :], acc - mean[:, None], 0.0)
        y = xc * tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)[:, None] * g
        if HAS_BETA:
            y += tl.load(b_ptr + cols, mask=in_c, other=0.0).to(tl.float32)[None, :]
    if OUT:
        tl.store(out_ptr + at, _rounded(y, out_ptr, ROUND), mask=mask)
    if QUANT:
        _quant_store(tl.where(in_c[None, :], y, 0.0), rows, cols, mask, q_ptr, s_ptr, M, N, ROUND)


def _tile(n: int, m: int) -> tuple[int, int]:
    """(rows per program, warps): one row per program on a GPU (rows are many where fp8 runs: >= ~1,024),
    warps by the row's width; the interpreter runs programs one after another, so there 64 rows each."""
    if interpreted():
        return 64, 1
    return 1, 4 if n <= 1024 else 8 if n <= 4096 else 16


def _empty_quant(m: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty((m, n), dtype=FP8, device=device), torch.empty((m, 1), dtype=torch.float32, device=device)


def quant_rows(x: torch.Tensor, act: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous; [M, 2K] for "swiglu": [gate | up]) -> (e4m3 [M, K], float32 scales [M, 1])
    of act(x): None, "gelu" (erf), "gelu_tanh" or "swiglu"."""
    m, width = x.shape
    n = width // 2 if act == "swiglu" else width
    if x.stride(1) != 1:
        raise ValueError(f"quant_rows needs rows with unit stride, got strides {x.stride()}")
    q, s = _empty_quant(m, n, x.device)
    rows, warps = _tile(n, m)
    launch(_quant_kernel, (triton.cdiv(m, rows),), x, q, s, m, n, x.stride(0), BLOCK=triton.next_power_of_2(n),
           ROWS=rows, ACT=ACTS[act], ROUND=interpreted(), num_warps=warps)
    return q, s


def act_quant(y: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The FFN's activation of the up projection's output, quantised for the down projection."""
    return quant_rows(y, act)


def norm_quant(y: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
               eps: float, rms: bool = False, pre: bool = False, out: bool = True, quant: bool = True):
    """norm(y + residual) (residual None: norm(y)), LayerNorm (with `bias` where given) or RMSNorm (`rms`).

    Returns (sum, normed, q, scale), each None where not asked: `sum` (pre-norm: y + residual rounded to
    y's dtype, the residual stream that goes on), `normed` (`out`: in y's dtype), the e4m3 rows and
    float32 [M, 1] scales of the normed rows (`quant`)."""
    m, n = y.shape
    sums = torch.empty_like(y) if pre else None
    normed = torch.empty_like(y) if out else None
    q, s = _empty_quant(m, n, y.device) if quant else (None, None)
    rows, warps = _tile(n, m)
    dummy = y
    launch(_norm_quant_kernel, (triton.cdiv(m, rows),), y, residual if residual is not None else dummy, weight,
           bias if bias is not None else weight, normed if out else dummy, sums if pre else dummy,
           q if quant else dummy, s if quant else dummy, m, n, eps, BLOCK=triton.next_power_of_2(n), ROWS=rows,
           HAS_RES=residual is not None, RMS=rms, PRE=pre, HAS_BETA=bias is not None, OUT=out, QUANT=quant,
           ROUND=interpreted(), num_warps=warps)
    return sums, normed, q, s
