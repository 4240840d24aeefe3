"""Probe: ROSE's attention kernel with the pipelined unmasked key loop (ROSE_ATTENTION_PIPELINE) against
without, and add_norm's LayerNorm one-pass statistics (ROSE_NORM_ONE_PASS 0/1/2), each in a CUDA graph of
24 calls over distinct inputs (benchmarks.small_step.time_graph), median of --iters replays. JSON lines."""
import json, os, sys, time
import torch
from benchmarks.small_step import time_graph, set_mode
from rose.kernels import attention as ka, gemm

dev, dt, L, ITERS = torch.device("cuda"), torch.bfloat16, 24, 40
rev = os.environ.get("TRELLIS_GIT_REV", "?")
meta = dict(when=time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), gpu=torch.cuda.get_device_name(),
            torch=torch.__version__, git=rev, layers=L, iters=ITERS)
set_mode("pdl")
def emit(**kw):
    print(json.dumps({**kw, **meta}), flush=True)

def set_pipe(on):
    os.environ["ROSE_ATTENTION_PIPELINE"] = "1" if on else "0"; ka.pipeline.cache_clear()

torch.manual_seed(0)
for heads in ((16, 16, 64), (16, 8, 128)):
    H, Hk, D = heads
    for n, length in ((1, 128), (1, 256), (1, 512), (5, 512), (25, 512), (1, 1024), (4, 1024)):
        T = n * length
        cu = torch.arange(0, T + 1, length, dtype=torch.int32, device=dev)
        qkv = [torch.randn(T, H + 2 * Hk, D, device=dev, dtype=dt) for _ in range(L)]
        default = ka.tile(length, D, n, H)
        tiles = {default, (64, 64, 4), (64, 128, 4), (32, 64, 4), (128, 64, 8), (128, 128, 8)}
        for t in sorted(tiles):
            if ka.smem_bytes(t[0], t[1], D) > ka.SMEM_BUDGET:
                continue
            outs = {}
            for pipe in (0, 1, 0, 1):
                set_pipe(pipe)
                def fn(i, t=t):
                    q, k, v = qkv[i].split([H, Hk, Hk], dim=1)
                    return ka.attention(q, k, v, cu, length, config=t)
                try:
                    us = time_graph(fn, L, ITERS)
                    q, k, v = qkv[0].split([H, Hk, Hk], dim=1)
                    outs[pipe] = ka.attention(q, k, v, cu, length, config=t).float()
                except Exception as e:
                    print(f"# attention {heads} {n}x{length} {t} pipe {pipe}: {str(e)[:200]}", flush=True)
                    continue
                emit(op="attention", heads=list(heads), seqs=n, length=length, tile=list(t), default=t == default,
                     pipe=pipe, us=round(us, 3))
            if len(outs) == 2:
                print(f"# {heads} {n}x{length} {t} pipe-vs-not max abs diff {(outs[0]-outs[1]).abs().max().item():.3g}", flush=True)
        del qkv
        torch.cuda.empty_cache()

h = 1024
for tokens in (128, 512, 2560):
    _, split, _ = gemm.plan(tokens, h, h)
    parts = [torch.randn(split, tokens, h, device=dev) for _ in range(L)]
    res = torch.randn(tokens, h, device=dev, dtype=dt) + 0.5
    g, beta = (torch.rand(h, device=dev) + 0.5).to(dt), (torch.randn(h, device=dev) * 0.1).to(dt)
    bias = torch.randn(h, device=dev, dtype=dt)
    ref = gemm.add_norm_reference(parts[0].sum(0), bias, res, g, beta, 1e-5)
    for op in (0, 1, 2, 0, 1, 2):
        os.environ["ROSE_NORM_ONE_PASS"] = str(op); gemm._one_pass.cache_clear()
        us = time_graph(lambda i: gemm.add_norm(parts[i], bias, res, g, beta, 1e-5), L, ITERS)
        err = (gemm.add_norm(parts[0], bias, res, g, beta, 1e-5).float() - ref).abs().max().item()
        emit(op="add_norm", tokens=tokens, split=split, one_pass=op, us=round(us, 3), max_err=round(err, 5))
    del parts
