"""Kernel sweep: every installed attention backend on a grid of batch size x sequence length,
per head shape; tokens/s, the winner and its margin per cell; writes the table ROSE loads
(`--attention-table`) and a heat map. Backends run as in a step: planned on the host, then
replayed in a CUDA graph of one model's depth of layers (`--layers`).

    python -m benchmarks.kernels --out benchmarks/results [--heads 16,16,64] [--heads 16,8,128]

Shapes default to MHA head dim 64 (BGE-M3) and GQA head dim 128 (Qwen3-0.6B). `--causal` times them
with a causal mask (decoders) and writes `attention_table_QxKxD_causal.json`. On a CPU only SDPA and
the padded batch run (a harness check).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import Recorder, progress, pyplot
from rose.graphs import GraphKey
from rose.layers.attention import BACKENDS, AttentionMetadata, select_backend
from rose.layers.attention_table import table_file


def time_backend(backend, n: int, L: int, heads, device, dtype, iters: int, layers: int,
                 budget_s: float = 1.0, causal: bool = False) -> float:
    """Median seconds per layer of attention over n sequences of L tokens, timed the way a step runs it
    (`iters` times, or at least 3 and as many as fit in `budget_s`).

    On CUDA a capturable backend is planned once (`prepare`, on the host) and then replays a
    CUDA graph of `layers` calls, as a model's forward does; the time includes the plan and its
    copies, amortised over the layers. Other backends are timed call by call.
    """
    h, hk, d = heads
    T = n * L
    q = torch.randn(T, h, d, device=device, dtype=dtype)
    k = torch.randn(T, hk, d, device=device, dtype=dtype)
    v = torch.randn(T, hk, d, device=device, dtype=dtype)
    cu_host = np.arange(0, T + 1, L, dtype=np.int32)
    cuda = device.type == "cuda"
    graphed = cuda and backend.capturable
    key = GraphKey(n, T, L, frozenset({"sweep"})) if graphed else None
    meta = AttentionMetadata(torch.from_numpy(cu_host).to(device), L, None if graphed else (L,) * n, causal)
    backend.prepare(key, cu_host, T)
    for _ in range(3):
        backend(q, k, v, meta)
    if graphed:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(layers):
                backend(q, k, v, meta)

        def run():
            backend.prepare(key, cu_host, T)
            g.replay()
        per_call = layers
    else:
        def run():
            backend(q, k, v, meta)
        per_call = 1
    run()
    ts, t_end = [], time.perf_counter() + budget_s
    for _ in range(iters):
        if len(ts) >= 3 and time.perf_counter() > t_end:  # slow cells (SDPA at 24 x 8192) stop early
            break
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3 / per_call)
        else:
            t0 = time.perf_counter()
            run()
            ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def heat_map(table: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    cells = table["cells"]
    seqs, lens = sorted({c["seqs"] for c in cells}), sorted({c["max_len"] for c in cells})
    names = sorted({c["winner"] for c in cells})
    grid = np.full((len(seqs), len(lens)), np.nan)
    fig, ax = plt.subplots(figsize=(1.6 * len(lens) + 2, 0.8 * len(seqs) + 1.5))
    for c in cells:
        i, j = seqs.index(c["seqs"]), lens.index(c["max_len"])
        grid[i, j] = names.index(c["winner"])
        ax.text(j, i, f"{c['winner']}\n{c['margin']:.2f}x", ha="center", va="center", fontsize=7)
    ax.imshow(grid, cmap="Pastel1", vmin=0, vmax=max(8, len(names)))
    ax.set_xticks(range(len(lens)), lens)
    ax.set_yticks(range(len(seqs)), seqs)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("sequences")
    mask = ", causal" if table.get("causal") else ""
    ax.set_title(f"attention winner and margin over the runner-up, heads {table['heads']}{mask}, {table['gpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", action="append", help="q_heads,kv_heads,head_dim (repeat for several)")
    ap.add_argument("--seqs", default="1,4,8,16,24")
    ap.add_argument("--lengths", default="64,128,512,4096,8192")
    ap.add_argument("--max-tokens", type=int, default=200_000, help="skip cells with more tokens")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--layers", type=int, default=24,
                    help="attention calls per graph replay (a model's depth): one plan is amortised over them")
    ap.add_argument("--causal", action="store_true", help="causal attention (decoders); the table is "
                    "written as attention_table_QxKxD_causal.json")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    rec = Recorder(args.out, "kernels")
    for spec in args.heads or ["16,16,64", "16,8,128"]:
        heads = tuple(int(x) for x in spec.split(","))
        backends = {}
        for name in BACKENDS:
            try:
                backends[name] = select_backend(name, device, dtype, heads, args.causal)
            except (ImportError, ValueError) as e:
                print(f"kernels: {name} skipped: {e}", file=sys.stderr)
        cells = []
        grid = [(n, L) for n in map(int, args.seqs.split(",")) for L in map(int, args.lengths.split(","))
                if n * L <= args.max_tokens]
        for n, L in progress(grid, f"attention {spec}"):
            tps = {}
            for name, b in backends.items():
                try:
                    tps[name] = n * L / time_backend(b, n, L, heads, device, dtype, args.iters, args.layers,
                                                      causal=args.causal)
                except Exception as e:  # a backend that cannot run this shape loses the cell
                    print(f"kernels: {name} failed at {n}x{L}: {e}", file=sys.stderr)
            if not tps:
                continue
            ranked = sorted(tps, key=tps.get, reverse=True)
            margin = tps[ranked[0]] / tps[ranked[1]] if len(ranked) > 1 else 1.0
            cell = {"seqs": n, "max_len": L, "winner": ranked[0], "margin": round(margin, 3),
                    "tokens_per_s": {k: round(v) for k, v in tps.items()}}
            cells.append(cell)
            rec.emit(bench="kernels", heads=list(heads), causal=args.causal, **cell)
        table = {"heads": list(heads), "causal": args.causal, "dtype": str(dtype).removeprefix("torch."),
                 "gpu": rec.env["gpu"], "torch": rec.env["torch"], "when": rec.env["when"], "cells": cells}
        if args.out is not None:
            name = table_file(heads, args.causal)  # attention_table_QxKxD[_causal].json
            (args.out / name).write_text(json.dumps(table, indent=1))
            heat_map(table, args.out / name.replace("attention_table_", "kernels_").replace(".json", ".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
