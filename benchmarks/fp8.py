"""fp8 against bf16 in one process (issue 52): `Engine.step()` throughput and latency of the same model with and
without `--quantization fp8`, alternating rounds so both see the same clock and power, and the per-GPU row
sweep that sets `--fp8-min-tokens`.

    python -m benchmarks.fp8 --model preset:bge-m3 --out DIR      # on a GPU: the issue's cells and the sweep
    python -m benchmarks.fp8 --smoke                              # CPU: the harness end to end at tiny sizes

Rows (one JSON object each, with the machine, versions, revision and date):
- `fp8_engine`: 100 x L emb/s per engine (median of `--rounds` alternating rounds, the GPU's clock and power
  meanwhile), steps 1 x 128 (the small step in both: unchanged) and 5 x 512 (scoring) p50 / p99, and the
  cosine of fp8's embeddings to bf16's on that batch (random weights for presets: a sanity check, the
  fidelity is benchmarks/fp8_fidelity.py's);
- `fp8_rows`: per step size (rows = tokens, 128 .. 16384), the blocks' time without attention (an
  attention stand-in that copies q: the same in both) in bf16 (the path the bf16 engine takes at that size:
  ROSE's small step up to its `kernel_tokens`, torch's above) and in fp8 (GEMMs, the fused norm / activation
  quantisation, the attention output's quantisation), per layer, each timed as a CUDA graph replay; then
  `fp8_crossover`: the smallest swept size from which fp8 is faster at every larger one (--fp8-min-tokens).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import Recorder, model_tag
from benchmarks.engine import rand_seqs, time_online, time_throughput
from rose.batch import Batch
from rose.engine import Engine, EngineConfig
from rose.layers.attention import AttentionMetadata

SWEEP = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class CopyAttention:
    """Attention's stand-in for the sweep: q copied (a fresh contiguous [T, heads, dim], as a kernel writes)."""

    def __call__(self, q, k, v, meta):
        return q.contiguous()


def timed(fn, iters: int, cuda: bool) -> float:
    """Milliseconds a call: on CUDA a graph of `fn` replayed (after warm-up on a side stream), else wall clock."""
    if not cuda:
        fn()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    end.synchronize()
    del g
    return start.elapsed_time(end) / iters


def row_sweep(engine: Engine, rows: tuple[int, ...], iters: int, rec: Recorder, model: str) -> None:
    """The fp8 engine's model run both ways at each size (fp8_tokens 1 / 0 on the same weights)."""
    m, cuda = engine.model, engine.device.type == "cuda"
    layers = len(m.blocks)
    small, fp8_at = m.kernel_tokens, m.fp8_tokens
    attn = CopyAttention()
    times = {}
    for T in rows:
        L = min(T, 512)
        n = T // L
        ids = torch.randint(5, engine.spec.vocab_size - 1, (T,), device=engine.device)
        pos = torch.arange(L, device=engine.device).repeat(n)
        cu = torch.arange(0, T + 1, L, dtype=torch.int32, device=engine.device)
        meta = AttentionMetadata(cu, L, (L,) * n, engine.causal)
        row = {}
        with torch.inference_mode():
            for name, fp8 in (("bf16", 0), ("fp8", 1)):
                m.fp8_tokens = fp8
                row[name] = timed(lambda: m(ids, pos, meta, attn), iters, cuda)
        m.fp8_tokens = fp8_at
        times[T] = row
        rec.emit(bench="fp8_rows", model=model, rows=T, layers=layers,
                 bf16_path="small step (Triton)" if T <= small else "torch",
                 bf16_ms=round(row["bf16"], 4), fp8_ms=round(row["fp8"], 4),
                 bf16_layer_ms=round(row["bf16"] / layers, 4), fp8_layer_ms=round(row["fp8"] / layers, 4),
                 speedup=round(row["bf16"] / row["fp8"], 3), timing="cuda graph replay" if cuda else "cpu wall")
        if cuda:
            torch.cuda.empty_cache()
    wins = [T for T in rows if times[T]["fp8"] < times[T]["bf16"]]
    crossover = next((T for T in rows if all(times[u]["fp8"] < times[u]["bf16"] for u in rows if u >= T)), None)
    rec.emit(bench="fp8_crossover", model=model, fp8_faster_at=wins, fp8_min_tokens=crossover,
             note="the smallest swept size from which fp8 is faster at every larger one; None: nowhere")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="preset:bge-m3")
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu")
    ap.add_argument("--length", type=int, default=512, help="L of the 100 x L throughput cell")
    ap.add_argument("--seqs", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3, help="alternating bf16 / fp8 rounds of the throughput cell")
    ap.add_argument("--repeats", type=int, default=5, help="passes over the 100 sequences per round")
    ap.add_argument("--iters", type=int, default=100, help="steps per latency cell, replays per sweep size")
    ap.add_argument("--fp8-min-tokens", type=int, default=EngineConfig.fp8_min_tokens)
    ap.add_argument("--rows", default=",".join(map(str, SWEEP)), help="step sizes of the sweep ('' for none)")
    ap.add_argument("--no-engine", action="store_true", help="the sweep alone")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of the harness: MiniLM, 8 x 64, one round, sweep 128,256, 2 iterations")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.device, args.length, args.seqs, args.rounds, args.repeats, args.iters = \
            "default", "cpu", 64, 8, 1, 1, 2
        args.rows, args.fp8_min_tokens = "128,256", 128
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = "cuda" if cuda else "cpu"
    rec = Recorder(args.out, f"fp8_{model_tag(args.model)}")
    common = dict(model=args.model, device=device, dtype="bfloat16")
    fp8 = Engine(EngineConfig(quantization="fp8", fp8_min_tokens=args.fp8_min_tokens, **common))
    L = min(args.length, fp8.spec.max_seq_len)
    if not args.no_engine:
        bf16 = Engine(EngineConfig(**common))
        engines = {"bf16": bf16, "fp8": fp8}
        tput = {k: [] for k in engines}
        for _ in range(args.rounds):  # alternating: both see the same clocks and power cap
            for k, e in engines.items():
                tput[k].append(time_throughput(e, [L] * args.seqs, args.repeats))
        batch = Batch.from_sequences(rand_seqs([L] * args.seqs, fp8.spec.vocab_size, seed=3))
        ref, got = (e.step(batch).synchronize().clone().float() for e in (bf16, fp8))
        cos = torch.nn.functional.cosine_similarity(got, ref)
        for k, e in engines.items():
            best = sorted(tput[k], key=lambda r: r["emb_per_s"])[len(tput[k]) // 2]
            rec.emit(bench="fp8_engine", cell=f"{args.seqs}x{L} throughput", model=args.model, engine=k,
                     fp8_min_tokens=e.fp8_tokens or None, seqs=args.seqs, tokens=L,
                     emb_per_s_rounds=[r["emb_per_s"] for r in tput[k]], **best)
        ratio = np.median([r["emb_per_s"] for r in tput["fp8"]]) / np.median([r["emb_per_s"] for r in tput["bf16"]])
        rec.emit(bench="fp8_engine", cell=f"{args.seqs}x{L} fp8 / bf16", model=args.model,
                 speedup=round(float(ratio), 3), cos_min=round(cos.min().item(), 6),
                 cos_mean=round(cos.mean().item(), 6))
        for n, length in ((1, 128), (5, min(512, fp8.spec.max_seq_len))):
            for k, e in engines.items():
                rec.emit(bench="fp8_engine", cell=f"step {n}x{length}", model=args.model, engine=k,
                         fp8_path=bool(e.fp8_tokens) and n * length >= e.fp8_tokens and n * length > e.kernels,
                         seqs=n, tokens=n * length, **time_online(e, length, args.iters, n))
        del bf16, engines
        if cuda:
            torch.cuda.empty_cache()
    rows = tuple(int(r) for r in args.rows.split(",") if r)
    if rows:
        row_sweep(fp8, rows, args.iters, rec, args.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
