"""The small-batch step of a post-norm encoder block (BERT, DistilBERT, MPNet, NomicBERT), one
function for every family whose block is q/k/v (rotated, for NomicBERT), attention, output
projection, residual + LayerNorm, GELU or SwiGLU FFN, residual + LayerNorm, whatever its checkpoint
names (each family passes its own modules).

In ROSE's kernels (`rose.kernels.gemm`): the output and down projections run split over K in
Triton, their float32 partial sums reduced by the kernel that adds bias and residual and applies
LayerNorm; the q/k/v and GELU up projections stay in cuBLAS / cuBLASLt unless `ops` names them (GELU
in the epilogue, tanh form, as `linear_gelu`); a SwiGLU up projection ([gate; up] rows stacked) is
always Triton's, the SiLU and product in its epilogue (as Qwen3's); rotary q/k in one kernel
(`rose.kernels.rope`). Attention is the step's backend (Triton, with MPNet's position bias too). Measured on an H200 (bge-m3, engine step 1 x 128, graphs): out + down in
Triton 0.830 ms, all four 0.922 (cuBLAS's q/k/v and GELU up GEMMs were faster at these rows).
"""

from __future__ import annotations

import torch
from torch import nn

from rose.layers.activation import linear_gelu
from rose.layers.pooling import keep_rows

TRITON_OPS = frozenset({"out", "down"})  # the measured default (`rose.kernels.gemm.triton_ops`)


def post_norm_block(x: torch.Tensor, meta, attn, heads: int, qkv: nn.Linear, out: nn.Linear, norm1: nn.LayerNorm,
                    up: nn.Linear, down: nn.Linear, norm2: nn.LayerNorm, act: str = "gelu",
                    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """One block on x [T, hidden] (bf16 / fp16 on CUDA, or Triton's interpreter) -> [T, hidden]
    (or [N, hidden]: the `rows` kept after attention, `Family.forward`'s).
    act: the FFN's, "gelu" (tanh form) or "swiglu" (`up` holds [gate; up] rows, no bias);
    rope: (positions [T], `Rotary.cos_sin` table) to rotate q and k by, or None."""
    from rose.kernels import gemm

    T, h = x.shape
    d = h // heads
    ops = gemm.triton_ops(TRITON_OPS)
    y = gemm.linear(x, qkv.weight, qkv.bias) if "qkv" in ops else qkv(x)
    if rope is None:
        q, k, v = y.view(T, 3, heads, d).unbind(1)
    else:
        from rose.kernels.rope import rope as rotate

        q, k, v = rotate(y, *rope, heads, d)
    a, x = keep_rows(rows, attn(q, k, v, meta).reshape(T, h), x)
    x = gemm.add_norm(gemm.linear_partials(a, out.weight), out.bias, x, norm1.weight, norm1.bias, norm1.eps)
    if act == "swiglu":
        f = gemm.linear(x, up.weight, None, "swiglu")
    else:
        f = gemm.linear(x, up.weight, up.bias, act="gelu") if "up" in ops else linear_gelu(x, up.weight, up.bias)
    return gemm.add_norm(gemm.linear_partials(f, down.weight), down.bias, x, norm2.weight, norm2.bias, norm2.eps)


class SmallStepKernels:
    """For a `Family` whose blocks have a `small_step` (`post_norm_block`, or a family's own) and
    which says whether its FFN is one the up projection's epilogue has (`ffn_fits`: a GELU, or a
    SwiGLU / GeGLU without biases): `use_kernels` routes steps of up to `max_tokens` tokens, at most
    the family's `MAX_KERNEL_TOKENS`, through the small step; returns that token count (0: none)."""

    ffn_fits: bool
    MAX_KERNEL_TOKENS: int | None = None  # the largest bucket the family's small step won in (None: no cap)

    def use_kernels(self, max_tokens: int) -> int:
        cap = self.MAX_KERNEL_TOKENS
        self.kernel_tokens = (max_tokens if cap is None else min(max_tokens, cap)) if self.ffn_fits else 0
        return self.kernel_tokens
