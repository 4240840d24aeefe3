"""Engine benchmark: `Engine.step()` in-process (no gRPC), the issue's table as JSON lines + a PNG.

    python -m benchmarks.engine --model preset:bge-m3 --out benchmarks/results [--iters 200] [--hf-baseline]

Cells: step p50/p99 at 1 x 128 / 512 / 4096 tokens (step + copy + sync, wall clock) with the device
time of the same step (CUDA events) and the host share, the host time until `step()` returns and of the bare graph replay call; throughput for 100 x 512 and for 100 mixed
lengths 32..512 (batched on a 16384-token budget like Tulip, steps pipelined; with the SM clock, power
and throttle reasons `nvidia-smi` saw meanwhile: `benchmarks.common.GpuSampler`); graph capture time per
key and graph memory. `--hf-baseline` adds Hugging Face transformers eager (bf16, SDPA, padded) on
the same shapes and random weights of the same architecture, `--hf-compile` the same model under
torch.compile(mode="reduce-overhead").
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import ENGINE_TARGETS, PUBLISHED, GpuSampler, Recorder, model_tag, percentiles, pyplot
from rose.batch import Batch
from rose.engine import Engine, EngineConfig

BUDGET = 16384


def budget_batches(seqs, budget=BUDGET):
    out, cur, tokens = [], [], 0
    for s in seqs:
        if cur and tokens + len(s) > budget:
            out.append(Batch.from_sequences(cur))
            cur, tokens = [], 0
        cur.append(s)
        tokens += len(s)
    out.append(Batch.from_sequences(cur))
    return out


def rand_seqs(lens, vocab, seed=0):
    g = np.random.default_rng(seed)
    return [g.integers(5, vocab - 1, n) for n in lens]


def time_online(engine: Engine, L: int, iters: int, seqs: int = 1) -> dict:
    batch = Batch.from_sequences(rand_seqs([L] * seqs, engine.spec.vocab_size))
    for _ in range(5):  # eager hit, capture, replays
        engine.step(batch).synchronize()
    cuda = engine.device.type == "cuda"
    stream = (engine.runner.ops.stream if engine.runner else torch.cuda.current_stream()) if cuda else None
    wall, dev, launch = [], [], []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
        t0 = time.perf_counter()
        lazy = engine.step(batch)
        launch.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            end.record(stream)
        lazy.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            end.synchronize()
            dev.append(start.elapsed_time(end))
    p = percentiles(wall)
    if not cuda:
        return p
    d = float(np.median(dev))
    return {**p, "device_p50_ms": round(d, 4), "host_share": round(max(0.0, 1 - d / p["p50_ms"]), 3),
            "launch_p50_ms": round(float(np.median(launch)), 4), **_replay_call(engine, batch, iters)}


def _replay_call(engine: Engine, batch: Batch, iters: int) -> dict:
    """Host milliseconds of the bare replay call of this batch's graph (the runner's launcher: the
    launch cost of its kernels, without staging and copies), the GPU idle before each call."""
    r = engine.runner
    graph = r._graphs.get(r.key(batch, frozenset())) if r is not None else None
    if graph is None:
        return {}
    ts = []
    r.ops.use_stream()
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph[0]()
        ts.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return {"replay_call_p50_ms": round(float(np.median(ts)), 4)}


def time_throughput(engine: Engine, lens, repeats: int) -> dict:
    batches = budget_batches(rand_seqs(lens, engine.spec.vocab_size, seed=1))
    for _ in range(3):
        for b in batches:
            engine.step(b).synchronize()
    with GpuSampler() as gpu:  # the SM clock and power while it runs: is the board at its power cap?
        t0 = time.perf_counter()
        for _ in range(repeats):
            lazies = [engine.step(b) for b in batches]  # pipelined: launch all, then wait
            for lz in lazies:
                lz.synchronize()
        dt = time.perf_counter() - t0
    return {"emb_per_s": round(len(lens) * repeats / dt, 1), "repeats": repeats, "steps": len(batches), **gpu.summary()}


def hf_baseline(spec, L_list, iters, rec: Recorder, model_name: str, compiled: bool):
    """Hugging Face transformers on the same shapes (bf16, SDPA, in-process: no network): eager, or
    under torch.compile(mode="reduce-overhead") (CUDA graphs per shape; compiled on first use). The
    model is transformers' class for the family (`AutoModel`), named in the rows' backend."""
    import transformers

    hf_type = {"bidirectional_pplx_qwen3": "qwen3"}.get(spec.model_type, spec.model_type)  # remote code: Qwen3's
    cfg = transformers.AutoConfig.for_model(
        hf_type, **{k: v for k, v in spec.config.items() if k not in ("architectures", "model_type")})
    kw = {"add_pooling_layer": False} if spec.model_type in ("bert", "xlm-roberta") else {}
    model = transformers.AutoModel.from_config(cfg, **kw).to("cuda", torch.bfloat16).eval()
    model.config._attn_implementation = "sdpa"
    # transformers' own class for the family (Qwen3Model is causal even where the served model is not)
    backend = ("hf-compile-reduce-overhead" if compiled else "hf-eager-sdpa") + f" ({type(model).__name__})"
    run = torch.compile(model, mode="reduce-overhead", dynamic=False) if compiled else model

    def embed(ids):
        return run(input_ids=ids).last_hidden_state[:, 0].float().cpu()

    for L in L_list:
        ids = torch.randint(5, spec.vocab_size - 1, (1, L), device="cuda")
        with torch.inference_mode():
            for _ in range(3):
                embed(ids)
            torch.cuda.synchronize()
            ts = []
            for _ in range(iters):
                t0 = time.perf_counter()
                embed(ids)
                ts.append((time.perf_counter() - t0) * 1e3)
        rec.emit(bench="engine", cell=f"step 1x{L}", model=model_name, backend=backend, seqs=1, tokens=L,
                 **percentiles(ts))
    ids = torch.randint(5, spec.vocab_size - 1, (25, 512), device="cuda")
    with torch.inference_mode():
        for _ in range(3):
            embed(ids)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        reps = 5
        for _ in range(reps * 4):  # 100 sequences as 4 padded batches of 25
            embed(ids)
        dt = time.perf_counter() - t0
    rec.emit(bench="engine", cell="100x512 throughput", model=model_name, backend=backend, seqs=100, tokens=512,
             emb_per_s=round(100 * reps / dt, 1))


def chart(rows, model: str, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    ours = {r["tokens"]: r for r in rows if r.get("backend", "").startswith("rose") and r["cell"].startswith("step")}
    if not ours:
        return
    hf = {r["tokens"]: r for r in rows if r.get("backend") == "hf-eager-sdpa" and r["cell"].startswith("step")}
    hfc = {r["tokens"]: r for r in rows if r.get("backend") == "hf-compile-reduce-overhead"
           and r["cell"].startswith("step")}
    Ls = sorted(ours)
    pub = PUBLISHED.get(model, {}).get("online_p50_ms", {})
    tgt = ENGINE_TARGETS.get(model, {}).get("step_p50_ms", {})
    series = [("ROSE step (in-process)", [ours[L]["p50_ms"] for L in Ls]),
              ("ROSE device time", [ours[L].get("device_p50_ms", np.nan) for L in Ls])]
    if hf:
        series.append(("HF eager bf16 (in-process)", [hf.get(L, {}).get("p50_ms", np.nan) for L in Ls]))
    if hfc:
        series.append(("HF + torch.compile reduce-overhead", [hfc.get(L, {}).get("p50_ms", np.nan) for L in Ls]))
    if pub:
        series += [("published Tulip (end to end)", [pub.get(L, {}).get("tulip-rust", np.nan) for L in Ls]),
                   ("published vLLM 0.22 (end to end)", [pub.get(L, {}).get("vllm-0.22", np.nan) for L in Ls])]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    w = 0.8 / len(series)
    x = np.arange(len(Ls))
    for i, (name, vals) in enumerate(series):
        bars = ax.bar(x + i * w, vals, w, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    for j, L in enumerate(Ls):
        if L in tgt:
            ax.hlines(tgt[L], j - 0.1, j + 0.9, colors="red", linestyles="dashed",
                      label="target" if j == 0 else None)
    ax.set_xticks(x + 0.4 - w / 2, [f"1 x {L}" for L in Ls])
    ax.set_yscale("log")
    ax.set_ylabel("p50 latency, ms (log)")
    env = rows[0]
    ax.set_title(f"{model}: engine step, {env['gpu']}, torch {env['torch']}, {env['when'][:10]}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="preset:bge-m3")
    ap.add_argument("--graphs", default="lazy", choices=("lazy", "eager-all", "off"))
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--attention-table", default="", help="with --attention auto: the kernel sweep's table")
    ap.add_argument("--compile", action="store_true", help="fuse post-attention work with torch.compile")
    ap.add_argument("--kernel-tokens", type=int, default=EngineConfig.kernel_tokens,
                    help="steps of up to this many tokens take ROSE's Triton path (0: torch's)")
    ap.add_argument("--scoring", default="5x512", help="multi-sequence step cells, e.g. 5x512,25x512 ('' for none)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--lengths", default="128,512,4096")
    ap.add_argument("--hf-baseline", action="store_true", help="also time transformers eager (bf16, SDPA)")
    ap.add_argument("--hf-compile", action="store_true",
                    help="also time transformers under torch.compile(mode='reduce-overhead') (minutes to compile)")
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu (cpu: harness checks, not results)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())

    name = model_tag(args.model)
    attention = "table" if args.attention_table and args.attention == "auto" else args.attention
    tag = f"{name}_{attention}_{args.graphs}" + ("_compiled" if args.compile else "") + \
        ("_torch-small" if not args.kernel_tokens else "")
    rec = Recorder(args.out, f"engine_{tag}")
    mem = torch.cuda.memory_allocated if cuda else (lambda: 0)
    mem0 = mem()
    engine = Engine(EngineConfig(model=args.model, device="cuda" if cuda else "cpu",
                                 dtype="bfloat16" if cuda else "float32", attention=args.attention,
                                 graphs=args.graphs, compile=args.compile, attention_table=args.attention_table,
                                 kernel_tokens=args.kernel_tokens))
    weights_mb = (mem() - mem0) / 2**20
    backend = f"rose-{engine.attention.name}-graphs-{args.graphs}" + ("-compiled" if args.compile else "") + \
        (f"-triton<={engine.kernels}" if engine.kernels else "")
    Ls = [int(x) for x in args.lengths.split(",")]
    Ls = [L for L in Ls if L <= engine.spec.max_seq_len]
    for L in Ls:
        rec.emit(bench="engine", cell=f"step 1x{L}", model=args.model, backend=backend, seqs=1, tokens=L,
                 **time_online(engine, L, args.iters))
    for cell in filter(None, args.scoring.split(",")):
        n, L = map(int, cell.split("x"))
        L = min(L, engine.spec.max_seq_len)
        rec.emit(bench="engine", cell=f"step {n}x{L}", model=args.model, backend=backend, seqs=n, tokens=n * L,
                 **time_online(engine, L, args.iters, n))
    L = min(512, engine.spec.max_seq_len)
    rec.emit(bench="engine", cell=f"100x{L} throughput", model=args.model, backend=backend, seqs=100, tokens=L,
             **time_throughput(engine, [L] * 100, args.repeats))
    mixed = np.random.default_rng(2).integers(32, L + 1, 100).tolist()
    rec.emit(bench="engine", cell=f"100 mixed 32..{L} throughput", model=args.model, backend=backend, seqs=100,
             tokens=int(sum(mixed)), **time_throughput(engine, mixed, args.repeats))
    if engine.runner is not None:
        s = engine.runner.stats
        rec.emit(bench="engine", cell="graph stats", model=args.model, backend=backend, keys=s.keys, eager=s.eager,
                 captures=s.captures, replays=s.replays, oversize=s.oversize, capture_ms_total=round(s.capture_ms, 1),
                 capture_ms_by_key={"x".join(map(str, k[:3])) + "".join(f"+{e}" for e in sorted(k.extras)): round(v, 1)
                                   for k, v in s.capture_ms_by_key.items()},
                 weights_mb=round(weights_mb, 1),
                 other_mb=round((mem() - mem0) / 2**20 - weights_mb, 1))
    spec = engine.spec
    del engine
    if cuda:
        torch.cuda.empty_cache()
    for compiled in [False] * args.hf_baseline + [True] * args.hf_compile:
        if cuda:
            hf_baseline(spec, Ls, min(args.iters, 50), rec, args.model, compiled)
            torch.cuda.empty_cache()
    if args.out is not None:
        chart(rec.rows, args.model, args.out / f"engine_{tag}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
