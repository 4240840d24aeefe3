"""GEMM probe: the model's linear layers at the token counts a step sees, per GEMM strategy.

    python -m benchmarks.gemm --model preset:bge-m3 --out benchmarks/results [--tokens 128,512,4096,16384]

At 1 x 128 most of a step's device time is its GEMMs, far below the memory bandwidth a
weight-streaming GEMM should reach. This times every linear shape of the model (bias included)
at each token count, as a CUDA graph of 20 calls (no launch gaps), with: cuBLAS (torch's
default), cuBLASLt (`preferred_blas_library`), and Inductor's autotuned choice
(`torch.compile(mode="max-autotune-no-cudagraphs")`: Triton templates against cuBLAS, minutes
to tune). Each row: microseconds per call, weight bandwidth (GB/s) and TFLOP/s. On a CPU only
the default runs, as a harness check.

Also `linear+gelu` against `gelu-epilogue` (the FFN's up projection only: bias + GELU in cuBLASLt's
epilogue, `torch._addmm_activation`, tanh GELU) and `S@compile` (strategy S under `torch.compile`).
Split-K (as a batched GEMM, and as a Triton kernel with float32 atomics, eleven tile shapes) was
tried here on the H200 (revision 11d1795, `results/2026-11-30_h200_early-runs/gemm_bge-m3_candidates.jsonl.gz`): it lost to
cuBLAS in every cell, 1.4-4x slower, and was removed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import Recorder, graph_replay_ms, model_tag, progress
from trellis.modeldir import ModelSpec
from trellis.modelref import resolve_model_path


def linear_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each distinct linear layer in one block, named as the model names them."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads") or heads
    gated = "qwen3" in cfg.get("model_type", "")  # qwen3, bidirectional_pplx_qwen3
    return {"qkv": (h, (heads + 2 * kv) * d), "o_proj": (heads * d, h),
            "up" if not gated else "gate_up": (h, inter * (2 if gated else 1)), "down": (inter, h)}


def time_call(fn, x, cuda: bool, calls: int = 20, iters: int = 20) -> float:
    """Median seconds per call."""
    for _ in range(3):
        fn(x)
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn(x)
        return (time.perf_counter() - t0) / iters
    def issue():
        for _ in range(calls):
            fn(x)
    return graph_replay_ms(issue, iters) / 1e3 / calls


def strategy_fn(strategy: str, layer: str, w: torch.Tensor, bias: torch.Tensor):
    """The callable x -> y timed for `strategy`, or None where it does not apply to this layer.
    `S@compile` is strategy S under `torch.compile`, its epilogue fused as in a compiled step."""
    if strategy.endswith("@compile"):
        fn = strategy_fn(strategy.removesuffix("@compile"), layer, w, bias)
        return None if fn is None else torch.compile(fn, dynamic=False)
    if strategy == "inductor-autotune":
        return torch.compile(lambda x: F.linear(x, w, bias), mode="max-autotune-no-cudagraphs", dynamic=False)
    if strategy in ("linear+gelu", "gelu-epilogue"):
        if layer != "up":
            return None
        if strategy == "gelu-epilogue":
            return lambda x: torch._addmm_activation(bias, x, w.t(), use_gelu=True)
        return lambda x: F.gelu(F.linear(x, w, bias), approximate="tanh")
    if strategy not in ("cublas", "cublaslt"):
        raise ValueError(f"unknown GEMM strategy {strategy!r}")
    return lambda x: F.linear(x, w, bias)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="preset:bge-m3")
    ap.add_argument("--tokens", default="128,512,4096,16384")
    ap.add_argument("--strategies", default="cublas,cublaslt,linear+gelu,gelu-epilogue",
                    help="also: inductor-autotune (minutes to tune); any of them with @compile")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    spec = ModelSpec.read(resolve_model_path(args.model))
    rec = Recorder(args.out, f"gemm_{model_tag(args.model)}")
    strategies = args.strategies.split(",") if cuda else ["cublas"]
    cells = [(name, k, n, m) for name, (k, n) in linear_shapes(spec.config).items()
             for m in map(int, args.tokens.split(","))]
    for name, k, n, m in progress(cells, "gemm"):
        w = torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
        bias = torch.zeros(n, device=device, dtype=dtype)
        x = torch.randn(m, k, device=device, dtype=dtype)
        for strategy in strategies:
            fn = strategy_fn(strategy, name, w, bias)
            if fn is None:
                continue
            if cuda:
                torch.backends.cuda.preferred_blas_library("cublaslt" if strategy == "cublaslt" else "cublas")
            try:
                s = time_call(fn, x, cuda)
            except Exception as e:  # a strategy that cannot run here loses the cell
                print(f"gemm: {strategy} failed at {name} {m}x{k}x{n}: {e}")
                continue
            rec.emit(bench="gemm", model=args.model, layer=name, m=m, k=k, n=n, strategy=strategy, us=round(s * 1e6, 2), weight_gb_s=round(w.numel() * w.element_size() / s / 1e9, 1),
                     tflop_s=round(2 * m * k * n / s / 1e12, 1))
    if cuda:
        torch.backends.cuda.preferred_blas_library("cublas")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
