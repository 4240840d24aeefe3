"""The fp8 path (`EngineConfig.quantization = "fp8"`): encoder blocks whose four GEMMs run in float8 e4m3
through `torch._scaled_mm`, for steps of at least `fp8_tokens` tokens (smaller ones keep bfloat16).

Weights: each block's q/k/v, attention output, up (or gate/up) and down projections, quantised once at
load with one scale per output channel (`quantize_weight`: amax / 448 x [1, 2), searched) and kept
BESIDE the bf16 weights, which steps under the threshold (the small step, the bf16 blocks) still read:
+1 byte per weight (bge-m3: ~300 MB; the embeddings and heads are not quantised).
Activations: one scale per row, written by the kernel that produced the row (`rose.kernels.quant`): the
residual add + LayerNorm (post-norm, BERT / XLM-R) or + RMSNorm (pre-norm, Qwen3), the FFN's activation
(GELU, SwiGLU) before the down projection; the attention output and BERT's embeddings are quantised by a
small kernel of their own (attention's kernels are not changed here). Then
`_scaled_mm(x_fp8, w_fp8.t(), scale_a [M, 1], scale_b [1, N], bias, out_dtype=bf16)`: the scales and bias
are applied in the GEMM's epilogue. Attention, rotary, q/k norms and every norm's maths stay bf16/float32.

On CUDA (and under Triton's interpreter) the fused kernels are Triton's; elsewhere the same maths in
torch (`quant_rows_torch`, `norm_quant_torch`: also the tests' reference), so the fp8 path runs on a CPU
too (slowly), which is how its fidelity is measured without a GPU (benchmarks/fp8_fidelity.py).
Families: `post_norm_forward` (BERT, XLM-RoBERTa, RoBERTa, CamemBERT, ELECTRA: BertModel's blocks),
`pre_norm_forward` (Qwen3, pplx-embed's Qwen3), each through the `Fp8Blocks` mixin.
The fidelity recipe (issue 52, docs/performance.md): weight channels' scales searched at load
(`quantize_weight`), the first block's FFN and the last block's attention GEMMs in bf16 (`BF16_GEMMS`,
`layer_ops`).
Knobs for measurements: ROSE_FP8_BF16_LAYERS (blocks or GEMMs kept in bf16); ROSE_FP8_FAST_ACCUM=1 makes
`_scaled_mm` accumulate in its fast mode;
ROSE_FP8_OPS (comma-separated of qkv, out, up, down) runs only those GEMMs in fp8, the others in bf16
from the same kernels' bf16 outputs (what each GEMM costs in fidelity and gains in speed).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rose.layers.pooling import keep_rows
from rose.layers.rotary import apply_rotary

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
MIN_AMAX = 1e-12  # an all-zero row gets this amax: a finite scale, zeros out (as the kernels)


def quantize(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise e4m3 of y [M, K] (any float dtype; the maths in float32): (e4m3 [M, K], float32 scales
    [M, 1]), value = q * scale. Weights are quantised this way at load (a row = an output channel)."""
    y = y.float()
    scale = y.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    # torch's float -> e4m3fn conversion does not saturate (past 448 is NaN): clamp first
    return (y / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


SCALE_STEPS = 16  # scales tried per weight channel: amax / 448 * (1 + j / 16), j = 0 .. 15


def quantize_weight(w: torch.Tensor, steps: int = SCALE_STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` for a weight [N, K], with each output channel's scale chosen, among amax / 448 * c for
    c in [1, 2) (`steps` values), as the one whose e4m3 rounding of the channel has the least squared
    error. Why: e4m3's error is relative (3 mantissa bits), so amax / 448 is only one of the grids that
    cover the channel without clipping (c = 2 is c = 1 a binade down); which one rounds a given channel
    best depends on where its values fall. A weight's rounding error is the same for every token (a fixed
    change of the model, not noise that averages out in pooling): on real all-MiniLM-L6-v2 it was the
    larger share of fp8's error (docs/performance.md). 16 steps: 7.5% less rms error on its weights than
    amax / 448 (32: 8.7%, 64: 9.3%, at a pass over the weights each, once at load). c = 1 is `quantize`'s
    scale, so no channel rounds worse."""
    w = w.float()
    base = w.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    best_s = best_err = None
    for j in range(steps):
        s = base * (1 + j / steps)
        # |w / s| <= 448 for c >= 1 (to rounding, which the conversion rounds back to 448): no clamp needed
        err = ((w / s).to(FP8).float() * s - w).square_().sum(dim=1, keepdim=True)
        if best_s is None:
            best_s, best_err = s, err
        else:
            best_s, best_err = torch.where(err < best_err, s, best_s), torch.minimum(err, best_err)
    return (w / best_s).clamp(-FP8_MAX, FP8_MAX).to(FP8), best_s


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def activation(y: torch.Tensor, act: str | None) -> torch.Tensor:
    """act(y) in float32: None, "gelu" (erf), "gelu_tanh", "swiglu" (y holds [gate | up] columns)."""
    y = y.float()
    if act == "swiglu":
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    if act == "gelu":
        return F.gelu(y)
    if act == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    return y


def quant_rows_torch(x: torch.Tensor, act: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`rose.kernels.quant.quant_rows` in torch."""
    return quantize(activation(x, act))


def norm_quant_torch(y, residual, weight, bias, eps, rms=False, pre=False, out=True, quant=True):
    """`rose.kernels.quant.norm_quant` in torch: (sum, normed, q, scale), None where not asked."""
    s = y.float() + (residual.float() if residual is not None else 0)
    if pre:
        s = s.to(y.dtype).float()
    n = F.rms_norm(s, (s.shape[-1],), weight.float(), eps) if rms else \
        F.layer_norm(s, (s.shape[-1],), weight.float(), bias.float() if bias is not None else None, eps)
    q, sc = quantize(n) if quant else (None, None)
    return (s.to(y.dtype) if pre else None), (n.to(y.dtype) if out else None), q, sc


def _ops(x: torch.Tensor):
    """(quant_rows, norm_quant) for x's device: Triton's on CUDA or under its interpreter, else torch's."""
    from rose import kernels

    if (x.is_cuda or kernels.interpreted()) and kernels.available():
        from rose.kernels import quant

        return quant.quant_rows, quant.norm_quant
    return quant_rows_torch, norm_quant_torch


@functools.cache
def _fast_accum() -> bool:
    return os.environ.get("ROSE_FP8_FAST_ACCUM", "0") == "1"


OPS = frozenset({"qkv", "out", "up", "down"})


def fp8_ops() -> frozenset:
    """The GEMMs that run in fp8: all four, or those ROSE_FP8_OPS names (a knob for measurements)."""
    env = os.environ.get("ROSE_FP8_OPS")
    return frozenset(env.split(",")) & OPS if env else OPS


# The recipe's GEMMs kept in bf16 (issue 52, docs/performance.md): block index (negative: from the end) -> GEMMs.
# Why these, measured one GEMM at a time on real all-MiniLM-L6-v2 (docs/performance.md): the first block's down
# projection (its GELU input has one channel with 97% of the input's energy) costs the worst vector's cosine the
# most, its up projection the ranking the most of that block; the last block's qkv costs the neighbour ranking
# more than any other GEMM (its error moves the attention that feeds the output). Against the first block whole at
# the same FLOPs (4 of a block's 12 units: qkv 3, out 1, up 4, down 4), at 3,000 sentences: min cosine equal,
# p01, Spearman and top-10 overlap better. 1/6 of MiniLM's GEMM FLOPs stay bf16, 1/24 of bge-m3's.
BF16_GEMMS = {0: frozenset({"up", "down"}), -1: frozenset({"qkv", "out"})}


def _bf16_gemms(env: str) -> dict[int, frozenset]:
    """ROSE_FP8_BF16_LAYERS' value as `BF16_GEMMS`: comma-separated entries, each a block index (the whole
    block) or BLOCK:GEMM+GEMM (those GEMMs of it), e.g. "0,-1:qkv+out"; empty: none."""
    out: dict[int, frozenset] = {}
    for entry in filter(None, (v.strip() for v in env.split(","))):
        block, colon, gemms = entry.partition(":")
        names = frozenset(gemms.split("+")) if colon else OPS
        if not names <= OPS or not block.strip().lstrip("-").isdigit():
            raise ValueError(f"ROSE_FP8_BF16_LAYERS entry {entry!r}: want BLOCK or BLOCK:GEMM+GEMM, GEMMs of "
                             f"{', '.join(sorted(OPS))}")
        out[int(block)] = out.get(int(block), frozenset()) | names
    return out


def layer_ops(n: int) -> list[frozenset]:
    """Per block of n, the GEMMs that run in fp8: `fp8_ops()` less those `BF16_GEMMS` keeps in bf16 there (or
    ROSE_FP8_BF16_LAYERS: `_bf16_gemms`' syntax, a knob for measurements; "" for none). Indices out of range
    are ignored; on a 1-block model the first and last block are one (its GEMMs kept, joined). An empty set: the
    block runs the bf16 engine's own."""
    env = os.environ.get("ROSE_FP8_BF16_LAYERS")
    keep = BF16_GEMMS if env is None else _bf16_gemms(env)
    kept: dict[int, frozenset] = {}
    for k, names in keep.items():
        if -n <= k < n:
            kept[k % n] = kept.get(k % n, frozenset()) | names
    ops = fp8_ops()
    return [ops - kept.get(i, frozenset()) for i in range(n)]


class _Gemms:
    """A block's four GEMMs: fp8 from (q, scale), or, for one ROSE_FP8_OPS leaves out, bf16 from the bf16 input."""

    def __init__(self, fp8: dict, linears: dict | None, ops: frozenset):
        self.fp8, self.linears, self.ops = fp8, linears, ops

    def __call__(self, name: str, q, scale, x=None):
        if name in self.ops:
            return self.fp8[name](q, scale)
        lin = self.linears[name]
        return F.linear(x, lin.weight, lin.bias)


@dataclass(frozen=True)
class Fp8Linear:
    """A linear layer's fp8 twin: e4m3 weight [N, K], float32 scales [1, N], the layer's own bias (bf16, shared)."""

    weight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def of(cls, linear: nn.Linear, given: tuple[torch.Tensor, torch.Tensor] | None = None) -> Fp8Linear:
        """Quantised from the layer's weight, or `given` as (e4m3 [N, K], scales [N, 1]) (a checkpoint's)."""
        q, s = given if given is not None else quantize_weight(linear.weight)
        if q.shape != linear.weight.shape:
            raise ValueError(f"fp8 weight of shape {tuple(q.shape)} for a layer of {tuple(linear.weight.shape)}")
        return cls(q.contiguous(), s.float().reshape(1, -1).contiguous(), linear.bias)

    def __call__(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """(e4m3 [M, K], float32 [M, 1]) -> bf16 [M, N]: x @ w.T with both scales and the bias applied."""
        return torch._scaled_mm(q, self.weight.t(), scale_a=scale, scale_b=self.scale, bias=self.bias,
                                out_dtype=torch.bfloat16, use_fast_accum=_fast_accum())

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * 4


class Fp8Blocks:
    """For a `Family` with an fp8 forward: `use_fp8(min_tokens)` quantises each block's `fp8_linears` and
    routes steps of at least `min_tokens` tokens (that do not take the small step) through it. The family
    defines `fp8_linears(block) -> {"qkv", "out", "up", "down": nn.Linear}`, its block's projections
    (rose.models.bert, rose.models.qwen3)."""

    fp8_tokens = 0  # steps of at least this many tokens run the fp8 path (0: never; set by use_fp8)

    def use_fp8(self, min_tokens: int, given: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> int:
        """Quantise every block's projections (or take a checkpoint's fp8 weights: `given`, parameter name
        -> (e4m3, scales)); returns the bytes they add. min_tokens >= 1."""
        if min_tokens < 1:
            raise ValueError(f"fp8 min_tokens {min_tokens} must be >= 1")
        given = given or {}
        names = {id(p): n for n, p in self.named_parameters()}
        self.fp8_layers = [{k: Fp8Linear.of(lin, given.get(names[id(lin.weight)]))
                            for k, lin in self.fp8_linears(b).items()} for b in self.blocks]
        self.fp8_tokens = min_tokens
        return sum(w.nbytes for layer in self.fp8_layers for w in layer.values())


def _bert_act(fn) -> str | None:
    """The kernel's name for a BERT block's activation function; None: applied in torch before quantising."""
    if fn is F.gelu:
        return "gelu"
    if isinstance(fn, functools.partial) and fn.func is F.gelu and fn.keywords.get("approximate") == "tanh":
        return "gelu_tanh"
    return None


def post_norm_forward(model, x: torch.Tensor, meta, attn, rows: torch.Tensor | None = None) -> torch.Tensor:
    """BertModel's blocks in fp8 from the embeddings' output x [T, hidden] (bf16) -> [T, hidden] (or the
    `rows` kept after the last block's attention). Each block: qkv GEMM, attention, the attention output
    quantised, out GEMM (+bias), add + LayerNorm (bf16 residual and fp8), up GEMM (+bias), activation +
    quant, down GEMM (+bias), add + LayerNorm (bf16 and, but for the last block, fp8)."""
    quant_rows, norm_quant = _ops(x)
    layers = model.blocks
    n = len(layers)
    every = layer_ops(n)
    xq = xs = None
    for i, (layer, w, ops) in enumerate(zip(layers, model.fp8_layers, every)):
        if not ops:  # a block kept in bf16 (`layer_ops`): the bf16 engine's own block
            x, xq = layer(x, meta, attn, rows if i == n - 1 else None), None
            continue
        if xq is None and "qkv" in ops:  # the embeddings' LayerNorm (or a bf16 block's) is not ours to fuse
            xq, xs = quant_rows(x)
        sa, so, inter, out = layer.attention.self, layer.attention.output, layer.intermediate, layer.output
        gemm = _Gemms(w, model.fp8_linears(layer) if ops != OPS else None, ops)
        T, h = x.shape
        q, k, v = gemm("qkv", xq, xs, x).view(T, 3, sa.num_heads, sa.head_dim).unbind(1)
        a, x = keep_rows(rows if i == n - 1 else None, attn(q, k, v, meta).reshape(T, h), x)
        # each fp8 input is written only where its GEMM runs in fp8 (`layer_ops` keeps some in bf16)
        aq, as_ = quant_rows(a) if "out" in ops else (None, None)
        ln = so.LayerNorm
        _, x, xq, xs = norm_quant(gemm("out", aq, as_, a), x, ln.weight, ln.bias, ln.eps, quant="up" in ops)
        act = _bert_act(inter.act)
        u = gemm("up", xq, xs, x)
        uq = us = f = None
        if "down" in ops:
            uq, us = quant_rows(u, act) if act else quant_rows(inter.act(u).contiguous())
        else:
            f = inter.act(u)
        ln = out.LayerNorm
        _, x, xq, xs = norm_quant(gemm("down", uq, us, f), x, ln.weight, ln.bias, ln.eps,
                                  quant=i < n - 1 and "qkv" in every[i + 1])
    return x


def pre_norm_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, meta, attn,
                     rows: torch.Tensor | None = None) -> torch.Tensor:
    """Qwen3's blocks (Llama's with q/k RMSNorm) in fp8 from token ids -> the final norm's output
    [T, hidden] (or `rows`). The residual stream stays bf16; every RMSNorm is fused with the residual add
    before it and writes only the fp8 rows the next GEMM reads (the final norm: bf16)."""
    x = model.embed_tokens(input_ids)
    cos_sin = model.rotary.lookup(positions, x.dtype)
    quant_rows, norm_quant = _ops(x)
    layers = model.layers
    n, every = len(layers), layer_ops(len(layers))
    # a GEMM in bf16 (ROSE_FP8_OPS, a block `layer_ops` keeps in bf16) reads the norms' bf16 outputs too
    bf16 = any(ops != OPS for ops in every)
    norm = layers[0].input_layernorm
    _, h, hq, hs = norm_quant(x, None, norm.weight, None, norm.eps, rms=True, out=bf16)
    for i, (layer, w, window, ops) in enumerate(zip(layers, model.fp8_layers, model.windows, every)):
        sa = layer.self_attn
        gemm = _Gemms(w, model.fp8_linears(layer) if bf16 else None, ops)
        T = x.shape[0]
        q, k, v = gemm("qkv", hq, hs, h).split([sa.h * sa.d, sa.hk * sa.d, sa.hk * sa.d], dim=-1)
        q, k = q.view(T, sa.h, sa.d), k.view(T, sa.hk, sa.d)
        if sa.qk_norm:
            q, k = sa.q_norm(q), sa.k_norm(k)
        q, k = apply_rotary(q, k, cos_sin)
        a = attn(q, k, v.view(T, sa.hk, sa.d), meta.with_window(window)).reshape(T, -1)
        a, x = keep_rows(rows if i == n - 1 else None, a, x)
        aq, as_ = quant_rows(a)
        post = layer.post_attention_layernorm
        x, h, hq, hs = norm_quant(gemm("out", aq, as_, a), x, post.weight, None, post.eps, rms=True, pre=True,
                                  out=bf16)
        g = gemm("up", hq, hs, h)
        mq, ms = quant_rows(g, "swiglu")
        m = activation(g, "swiglu").to(g.dtype) if "down" not in ops else None
        last = i == n - 1
        norm = model.norm if last else layers[i + 1].input_layernorm
        x, h, hq, hs = norm_quant(gemm("down", mq, ms, m), x, norm.weight, None, norm.eps, rms=True, pre=True,
                                  out=last or bf16, quant=not last)
    return h
