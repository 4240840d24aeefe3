"""The small-batch step's kernels, one by one: each linear layer of a model's block at a step's token
counts, cuBLAS (and torch's add + LayerNorm, compiled into one kernel as `--compile` does) against
ROSE's Triton kernels (`rose.kernels`) over tile configs and K splits, with and without PDL; and the
attention backends on short sequences.

    python -m benchmarks.small_step --model preset:bge-m3 --tokens 128,512,2560 --out benchmarks/results

Every cell is timed the way a step runs it: a CUDA graph of `--layers` calls, each over its own
weights (a step reads every layer's weights once, so the L2 cache holds none of them), replayed
`--iters` times; the figure is the median replay over the layer count, in microseconds per call.
One JSON line per cell: op, tokens, impl (cublas / triton / varlen ...), config, split, pdl, us.

`--quack` adds quack-kernels' CuTe-DSL Hopper GEMMs (installed beside FlashAttention 4) over tile,
cluster, swap-AB and K-split choices (`QUACK_TILES`, split-K reduced inside the kernel: its PARALLEL
mode), with the same epilogues the step needs: bias for q/k/v, bias + tanh GELU for the up projection,
float32 output for the output / down projections, then ROSE's add + norm. Each quack cell's result is
checked against torch's once (`err`, max abs difference) before it is timed. `--plan-only` times
ROSE's Triton kernels at the step's own plan only (`rose.kernels.gemm.plan`), not the config sweep.
"""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import Recorder, graph_replay_ms, model_tag, progress
from rose.graphs import GraphKey
from rose.layers.activation import linear_gelu
from rose.layers.attention import AttentionMetadata, select_backend
from trellis.modeldir import ModelSpec
from trellis.modelref import resolve_model_path

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), the likeliest first (`--configs N` tries the first N)
CONFIGS = [(64, 64, 64, 4, 3), (64, 32, 128, 4, 3), (64, 64, 128, 4, 3), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3),
           (64, 32, 64, 4, 5), (128, 32, 128, 4, 3), (64, 64, 64, 4, 5), (128, 64, 128, 4, 3), (64, 128, 128, 4, 3),
           (128, 128, 64, 8, 3), (64, 32, 256, 4, 3)]


MODES = ("plain", "pdl")  # how the Triton kernels launch (rose.kernels.pdl)


def set_mode(mode: str) -> None:
    from rose import kernels

    os.environ["ROSE_PDL"] = "0" if mode == "plain" else "1"
    kernels.pdl.cache_clear()


def time_graph(fn, layers: int, iters: int) -> float:
    """Median microseconds per call of fn(i) for i in range(layers), captured in one graph."""
    def issue():
        for i in range(layers):
            fn(i)
    return graph_replay_ms(issue, iters) * 1e3 / layers


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer of a block."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    if "qwen3" in cfg["model_type"]:
        heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        d = cfg.get("head_dim") or h // heads
        return {"qkv": ((heads + 2 * kv) * d, h), "o": (h, heads * d), "gate_up": (2 * inter, h), "down": (h, inter)}
    return {"qkv": (3 * h, h), "o": (h, h), "up": (inter, h), "down": (h, inter)}


# (BLOCK_M, BLOCK_N, warps, stages) of ROSE's attention kernel; shared memory over the budget is skipped
ATTENTION_TILES = [(bm, bn, w, st) for bm in (16, 32, 64, 128) for bn in (32, 64, 128, 256) for w in (2, 4, 8)
                   for st in (2, 3) if 16 * w <= bm * 4 and not (bm == 128 and w == 2)]
# quack GEMM configs: (tile_m, tile_n, pingpong, cluster_m, cluster_n, swap_ab); under swap_ab the tile's
# M runs over the weight's rows (the output features) and its N over the tokens
QUACK_TILES = [(64, 64, False, 1, 1, False), (64, 128, False, 1, 1, False), (128, 64, False, 1, 1, False),
               (128, 128, False, 1, 1, False), (128, 128, True, 1, 1, False), (128, 128, False, 2, 1, False),
               (64, 128, False, 1, 1, True), (128, 128, False, 1, 1, True), (64, 64, False, 1, 1, True),
               (128, 192, True, 2, 1, False), (256, 128, False, 2, 1, False), (256, 192, False, 2, 1, False)]
QUACK_SPLITS = (1, 2, 4, 8)


def add_norm_torch(y, res, g, beta, eps, rms):
    """The residual add + norm after the output / down projections, in torch (what `--compile` fuses)."""
    return F.rms_norm(y + res, (y.shape[-1],), g, eps) if rms else F.layer_norm(y + res, (y.shape[-1],), g, beta, eps)


def quack_cells(args, op, tokens, x, w, b, res, g, beta, eps, rms, emit) -> None:
    """quack's GEMM for one op at one token count over `QUACK_TILES` x `QUACK_SPLITS` (rows `quack` /
    `quack+norm`, config as [tile_m, tile_n, pingpong, cluster_m, cluster_n, swap_ab])."""
    from quack.gemm_config import GemmConfig, SplitKMode
    from quack.gemm_interface import gemm_act, gemm_tuned

    from rose.kernels import gemm

    n, k = w[0].shape
    norm_out, act = op in ("o", "down"), {"up": "gelu", "gate_up": "swiglu"}.get(op)
    if act == "swiglu":
        return  # gated: a concat layout of its own, not measured here
    tiles = QUACK_TILES if tokens <= 2048 else [t for t in QUACK_TILES if t[0] >= 128 and t[1] >= 128]
    for t in tiles:
        c = GemmConfig(tile_m=t[0], tile_n=t[1], pingpong=t[2], cluster_m=t[3], cluster_n=t[4], swap_ab=t[5],
                       device_capacity=9, is_dynamic_persistent=False)
        for split in ([1] if act else [s for s in QUACK_SPLITS if k % (s * 64) == 0 and k // s >= 128]):
            if tokens > 2048 and split > 1:
                continue
            if act == "gelu":
                def fn(i, c=c):
                    return gemm_act(x, w[i].T, bias=b[i], activation="gelu_tanh_approx", store_preact=False,
                                    tuned=False, config=c)[1]
                ref = lambda: F.gelu(F.linear(x, w[0], b[0]), approximate="tanh")  # noqa: E731
            elif norm_out:
                def fn(i, c=c, split=split):
                    p = torch.empty((1, tokens, n), dtype=torch.float32, device=x.device)
                    gemm_tuned.fn(x, w[i].T, p[0], config=c, split_k=split, split_k_mode=SplitKMode.PARALLEL)
                    return gemm.add_norm(p, b[i], res, g, None if rms else beta, eps, rms=rms)
                ref = lambda: add_norm_torch(F.linear(x, w[0], b[0]), res, g, beta, eps, rms)  # noqa: E731
            else:
                def fn(i, c=c, split=split):
                    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
                    gemm_tuned.fn(x, w[i].T, out, bias=b[i], config=c, split_k=split,
                                  split_k_mode=SplitKMode.PARALLEL)
                    return out
                ref = lambda: F.linear(x, w[0], b[0])  # noqa: E731
            conf = [t[0], t[1], int(t[2]), t[3], t[4], int(t[5])]
            try:
                err = (fn(0).float() - ref().float()).abs().max().item()
                us = time_graph(fn, args.layers, args.iters)
            except Exception as e:  # a config this shape (or this quack) cannot run
                msg = " ".join(str(e).split())[:200]
                print(f"quack {op} {tokens} {conf} split {split}: {type(e).__name__}: {msg}")
                emit(op, tokens, "quack-error", 0.0, config=conf, split=split, error=f"{type(e).__name__}: {msg}")
                continue
            emit(op, tokens, "quack+norm" if norm_out else "quack", us, config=conf, split=split, err=round(err, 4))


NORM_TILES = [(r, w) for r in (1, 2, 4, 8) for w in (1, 2, 4, 8)]


def sweep_tiles(args, cfg, heads, causal, rms, eps, emit) -> None:
    """ROSE's attention kernel over launch tiles (`rose.kernels.attention.tile`) on the `--attention`
    cells, and `add_norm` over rows per program and warps on each `--tokens` count with the hidden
    size's partials (the output projection's measured split): rows `attention-tile` / `add_norm-tile`."""
    from rose.kernels import attention as kattn
    from rose.kernels import gemm

    dev, dt, L = torch.device("cuda"), torch.bfloat16, args.layers
    set_mode("pdl")
    for cell in args.attention.split(","):
        n, length = map(int, cell.split("x"))
        T = n * length
        cu = torch.arange(0, T + 1, length, dtype=torch.int32, device=dev)
        qkv = [torch.randn(T, heads[0] + 2 * heads[1], heads[2], device=dev, dtype=dt) for _ in range(L)]
        default = (*kattn.tile(length, heads[2], n, heads[0]), kattn.STAGES)[:4]
        for t in ATTENTION_TILES:
            if kattn.smem_bytes(t[0], t[1], heads[2], t[3]) > kattn.SMEM_BUDGET:
                continue
            def fn(i, t=t):
                q, k, v = qkv[i].split([heads[0], heads[1], heads[1]], dim=1)
                return kattn.attention(q, k, v, cu, length, causal, config=t)
            try:
                us = time_graph(fn, L, args.iters)
            except Exception as e:  # a tile that does not fit
                print(f"attention tile {t} at {cell}: {str(e)[:120]}")
                continue
            emit("attention-tile", T, "triton", us, seqs=n, length=length, config=list(t), mode="pdl",
                 default=t == default)
        del qkv
    h = cfg["hidden_size"]
    for tokens in [int(t) for t in args.tokens.split(",")]:
        _, split, _ = gemm.plan(tokens, h, h)
        parts = [torch.randn(split, tokens, h, device=dev) for _ in range(L)]
        res = torch.randn(tokens, h, device=dev, dtype=dt)
        g, beta = torch.ones(h, device=dev, dtype=dt), torch.zeros(h, device=dev, dtype=dt)
        bias = None if rms else torch.randn(h, device=dev, dtype=dt)
        for t in NORM_TILES:
            def fn(i, t=t):
                return gemm.add_norm(parts[i], bias, res, g, None if rms else beta, eps, rms=rms, config=t)
            emit("add_norm-tile", tokens, "triton", time_graph(fn, L, args.iters), split=split, config=list(t),
                 mode="pdl", default=t == (1, 8))
        del parts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="preset:bge-m3")
    ap.add_argument("--tokens", default="128,512,2560")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--configs", type=int, default=len(CONFIGS), help="try the first N tile configs")
    ap.add_argument("--attention", default="1x128,1x512,5x512,16x128,32x64")
    ap.add_argument("--tiles", action=argparse.BooleanOptionalAction, default=True,
                    help="also sweep the launch tiles of ROSE's attention and add + norm kernels (PDL on)")
    ap.add_argument("--gemms", action=argparse.BooleanOptionalAction, default=True,
                    help="the linear layers' cells (--no-gemms: only the attention backends and the tile sweep)")
    ap.add_argument("--quack", action="store_true", help="also quack-kernels' GEMMs over QUACK_TILES x QUACK_SPLITS")
    ap.add_argument("--plan-only", action="store_true",
                    help="ROSE's Triton GEMMs at the step's plan only (rose.kernels.gemm.plan), not the config sweep")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from rose.kernels import gemm

    dev, dt = torch.device("cuda"), torch.bfloat16
    spec = ModelSpec.read(resolve_model_path(args.model))
    cfg = spec.config
    rec = Recorder(args.out, f"small_step_{model_tag(args.model)}")
    L = args.layers
    eps = cfg.get("layer_norm_eps", cfg.get("rms_norm_eps", 1e-6))
    rms = "qwen3" in cfg["model_type"]
    best: dict = {}

    def emit(op, tokens, impl, us, **kw):
        rec.emit(bench="small_step", model=args.model, op=op, tokens=tokens, impl=impl, us=round(us, 2), **kw)
        if impl.startswith(("triton", "quack")) and "error" not in kw and (
                best.get((op, tokens)) is None or us < best[(op, tokens)][0]):
            best[(op, tokens)] = (us, {**kw, "impl": impl})

    for tokens in progress([int(t) for t in args.tokens.split(",")] if args.gemms else [], "token counts"):
        for op, (n, k) in shapes(cfg).items():
            w = [torch.randn(n, k, device=dev, dtype=dt) * k ** -0.5 for _ in range(L)]
            b = [torch.randn(n, device=dev, dtype=dt) for _ in range(L)] if not rms else [None] * L
            x = torch.randn(tokens, k, device=dev, dtype=dt)
            norm_out = op in ("o", "down")
            out_n = n // 2 if op == "gate_up" else n
            res = torch.randn(tokens, out_n, device=dev, dtype=dt)
            g, beta = torch.ones(out_n, device=dev, dtype=dt), torch.zeros(out_n, device=dev, dtype=dt)
            act = {"up": "gelu", "gate_up": "swiglu"}.get(op)
            # cuBLAS (+ one fused add + norm kernel, as --compile makes it)
            if norm_out:
                fused = torch.compile(lambda y, r: add_norm_torch(y, r, g, beta, eps, rms), dynamic=False)
                emit(op, tokens, "cublas+compiled-norm",
                     time_graph(lambda i: fused(F.linear(x, w[i], b[i]), res), L, args.iters))
                emit(op, tokens, "cublas", time_graph(lambda i: F.linear(x, w[i], b[i]), L, args.iters))
            elif act == "gelu":
                emit(op, tokens, "cublaslt-gelu", time_graph(lambda i: linear_gelu(x, w[i], b[i]), L, args.iters))
            elif act == "swiglu":
                silu_mul = torch.compile(lambda y: F.silu(y[:, :out_n]) * y[:, out_n:], dynamic=False)
                emit(op, tokens, "cublas+compiled-swiglu",
                     time_graph(lambda i: silu_mul(F.linear(x, w[i])), L, args.iters))
            else:
                emit(op, tokens, "cublas", time_graph(lambda i: F.linear(x, w[i], b[i]), L, args.iters))
            # ROSE's Triton kernels over configs (and splits where a norm follows)
            splits = [s for s in (1, 2, 4, 8) if k % (s * 128) == 0] if norm_out else [1]
            runs = [(mode, tma, conf, split) for mode, tma in itertools.product(MODES, (False, True))
                    for conf in CONFIGS[:args.configs] for split in splits]
            if args.plan_only:
                conf, split, tma = gemm.plan(tokens, out_n, k)
                runs = [("pdl", tma, conf, split if norm_out else 1)]
            for mode, tma, conf, split in runs:
                set_mode(mode)
                if k % (split * conf[2]):
                    continue
                try:
                    if norm_out:
                        def fn(i, conf=conf, split=split, tma=tma):
                            p = gemm.linear_partials(x, w[i], split, conf, tma)
                            return gemm.add_norm(p, b[i], res, g, None if rms else beta, eps, rms=rms)
                    else:
                        def fn(i, conf=conf, tma=tma):
                            return gemm.linear(x, w[i], b[i], act, conf, tma)
                    us = time_graph(fn, L, args.iters)
                except Exception as e:  # a config that does not fit (shared memory): skip it
                    rec.emit(bench="small_step", model=args.model, op=op, tokens=tokens, config=list(conf),
                             split=split, error=str(e)[:200])
                    continue
                emit(op, tokens, ("triton-tma" if tma else "triton") + ("+norm" if norm_out else ""), us,
                     config=list(conf), split=split, mode=mode)
            set_mode(MODES[-1])
            if args.quack:
                quack_cells(args, op, tokens, x, w, b, res, g, beta, eps, rms, emit)
            del w, b
    # attention on short sequences
    heads = (cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
             cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    causal = rms and cfg.get("is_causal", True) is not False
    for cell in args.attention.split(","):
        n, length = map(int, cell.split("x"))
        T = n * length
        cu_host = np.arange(0, T + 1, length, dtype=np.int32)
        cu = torch.from_numpy(cu_host).to(dev)
        meta = AttentionMetadata(cu, length, None, causal)
        qkv = [torch.randn(T, heads[0] + 2 * heads[1], heads[2], device=dev, dtype=dt) for _ in range(L)]
        for name in ("varlen", "fa4", "triton"):
            try:
                be = select_backend(name, dev, dt, heads, causal)
            except (ImportError, ValueError):
                continue
            for mode in (MODES[:2] if name == "triton" else MODES[:1]):
                set_mode(mode)
                be.prepare(GraphKey(n, T, length, frozenset({"bench"})), cu_host, T)

                def fn(i, be=be):
                    q, k, v = qkv[i].split([heads[0], heads[1], heads[1]], dim=1)
                    return be(q, k, v, meta)
                emit("attention", T, name, time_graph(fn, L, args.iters), seqs=n, length=length, mode=mode)
        set_mode(MODES[-1])
    if args.tiles:
        sweep_tiles(args, cfg, heads, causal, rms, eps, emit)
    print("\nbest Triton (or quack) config per op (us per call, against the cuBLAS rows above):")
    for (op, tokens), (us, kw) in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"  {op:9s} {tokens:5d}: {us:7.2f} us  {kw}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
