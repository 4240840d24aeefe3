"""A candidate GEMM for the small-M linear layers of a step (not used by the engine yet).

At 1 x 128 tokens the engine's GEMMs read their weights at 0.5-1.7 TB/s on an H200 (cuBLAS picks
few thread blocks when N is 1024: `benchmarks.gemm`), far from the ~4.8 TB/s the memory gives.
This Triton kernel splits the reduction over K across `split_k` programs as well as tiling M and N,
so even M = 128, N = 1024 fills the GPU; each program adds its float32 partial tile into the output
with atomics. `benchmarks.gemm --strategies triton-splitk` times it over a few tile shapes; if it
wins there, it goes into ROSE (in a step the bias add and cast fuse into the next kernel).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU machines have no Triton: the probe skips this strategy there
    triton = None

# (BLOCK_M, BLOCK_N, BLOCK_K, split_k, num_warps) tried per shape; the probe keeps the fastest.
CONFIGS = [(64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 2, 4), (64, 64, 64, 8, 4),
           (128, 128, 64, 2, 8), (32, 64, 128, 8, 4), (128, 64, 64, 8, 4), (128, 64, 128, 4, 8),
           (128, 128, 64, 4, 8), (64, 32, 128, 8, 4), (128, 32, 64, 8, 4)]

if triton is not None:
    @triton.jit
    def _splitk_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr):
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K  # each split's share of K, whole blocks
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(pid_k * per, tl.minimum((pid_k + 1) * per, K), BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            w = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None],
                        mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
            acc += tl.dot(x, w)
        tl.atomic_add(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc,
                      mask=(rm[:, None] < M) & (rn[None, :] < N))


def splitk_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  config=CONFIGS[0]) -> torch.Tensor:
    """x [M, K] @ w[N, K].T (+ bias), accumulated in float32 across `split_k` programs; x.dtype out."""
    if triton is None:
        raise ImportError("triton is not installed")
    bm, bn, bk, split, warps = config
    m, k = x.shape
    n = w.shape[0]
    x, w = x.contiguous(), w.contiguous()
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    _splitk_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps)
    if bias is not None:
        y += bias
    return y.to(x.dtype)
