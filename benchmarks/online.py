"""Tulip over gRPC, client in another process: the published online, scoring and bulk workloads.

    python -m benchmarks.online --model preset:bge-m3 --out benchmarks/results \\
        --tulip-args "--compile --warmup 1x128" [--n 2000] [--target HOST:PORT]

Starts a Tulip (unless --target names a running one), checks correctness first (the served
vectors against this process's float32 eager engine on the same weights: cosine divergence
under 0.1%, or the run aborts), then measures, as published in ../shared/DESIGN.md:
1. online: pre-tokenized batch 1, sequential, L = 128 / 512 / 4096 (p50, p99 ms);
2. scoring: batch 5 / 25 / 50 at L = 512, sequential (p50, p99 ms);
3. bulk: batch 100, 4 concurrent client processes, L = 512 / 1024 / 4096 (emb/s).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import (
    PUBLISHED,
    Recorder,
    bulk_clients,
    free_port,
    model_tag,
    percentiles,
    progress,
    pyplot,
    run_client,
    spawn_until_ready,
)


def _stub(target):
    import grpc

    from trellis.tulip.v1 import tulip_pb2_grpc

    ch = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 256 << 20),
                                                ("grpc.max_send_message_length", 256 << 20)])
    return ch, tulip_pb2_grpc.TulipStub(ch)


def _request(seqs):
    from trellis.tulip.v1 import tulip_pb2
    from trellis.client import pack

    ids, lengths = pack(seqs)
    return tulip_pb2.EmbedRequest(token_ids=ids, lengths=lengths)


def rand_seqs(n, L, vocab, seed):
    g = np.random.default_rng(seed)
    return [g.integers(5, vocab - 1, L).astype(np.int32) for _ in range(n)]


def spawn_tulip(model: str, extra: str, port: int, log: Path):
    return spawn_until_ready(["tulip", "--model", model, "--port", str(port), *shlex.split(extra)], "TULIP_READY", log)


def correctness_gate(stub, model: str, vocab: int) -> float:
    """Served vectors vs a float32 eager engine on the same weights; returns the worst cosine."""
    import torch

    from rose.batch import Batch
    from rose.engine import Engine, EngineConfig
    from trellis.client import unpack

    seqs = [s for L in (1, 7, 128, 512, 3000) for s in rand_seqs(2, L, vocab, seed=L)]
    ref_engine = Engine(EngineConfig(model=model, device="cuda" if torch.cuda.is_available() else "cpu",
                                     dtype="float32", attention="sdpa", graphs="off"))
    seqs = [s[: ref_engine.spec.max_seq_len] for s in seqs]
    served = unpack(stub.Embed(_request(seqs)))
    ref = ref_engine.step(Batch.from_sequences(seqs)).synchronize().numpy()
    del ref_engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    cos = (served * ref).sum(1) / np.linalg.norm(served, axis=1) / np.linalg.norm(ref, axis=1)
    return float(cos.min())


def time_sequential(stub, n_seqs: int, L: int, n: int, vocab: int, target: str = "", transport: str = "unary",
                    spin_ms: float = 0.0) -> dict:
    """One request at a time: a blocking unary stub call, or a message on one open EmbedStream
    (from a uvloop event loop where uvloop is installed, as Ivy runs; `spin_ms`: TulipClient's)."""
    seqs = [rand_seqs(n_seqs, L, vocab, seed=i) for i in range(8)]
    if transport == "stream":
        return run_client(_sequential_stream(target, seqs, n, f"{n_seqs}x{L}", spin_ms))
    reqs = [_request(s) for s in seqs]
    for r in reqs:  # warm every graph key this cell uses
        stub.Embed(r)
    ts = []
    for i in progress(n, f"{n_seqs}x{L}"):
        t0 = time.perf_counter()
        stub.Embed(reqs[i % len(reqs)])
        ts.append((time.perf_counter() - t0) * 1e3)
    return percentiles(ts)


async def _sequential_stream(target: str, seqs: list, n: int, desc: str, spin_ms: float) -> dict:
    from trellis.client import TulipClient

    async with TulipClient(target, transport="stream", spin_ms=spin_ms) as c:
        for s in seqs:
            await c.embed(s)
        ts = []
        for i in progress(n, desc):
            t0 = time.perf_counter()
            await c.embed(seqs[i % len(seqs)])
            ts.append((time.perf_counter() - t0) * 1e3)
    return percentiles(ts)


def _bulk_client(target, L, n_req, vocab, seed, barrier, q):
    ch, stub = _stub(target)
    req = _request(rand_seqs(100, L, vocab, seed))
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(n_req):
        stub.Embed(req, timeout=600)
    q.put((t0, time.perf_counter(), 100 * n_req))
    ch.close()


def chart(rows, model: str, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return

    pub = PUBLISHED.get(model, {})
    lat = [r for r in rows if "p50_ms" in r]
    bulk = [r for r in rows if "emb_per_s" in r]
    if not lat or not bulk:
        print("chart needs both latency and bulk cells; see benchmarks.summary", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    ax = axes[0]
    names = [r["cell"] for r in lat]
    x = np.arange(len(lat))
    ours = [r["p50_ms"] for r in lat]
    tul = [pub.get("online_p50_ms", {}).get(r["tokens"], {}).get("tulip-rust", np.nan) if r["seqs"] == 1 else
           {5: 6.17, 25: 22.43, 50: 40.45}.get(r["seqs"], np.nan) for r in lat]
    vll = [pub.get("online_p50_ms", {}).get(r["tokens"], {}).get("vllm-0.22", np.nan) if r["seqs"] == 1 else
           {5: 9.60, 25: 26.59, 50: 47.29}.get(r["seqs"], np.nan) for r in lat]
    for i, (lab, vals) in enumerate([("Trellis (this run)", ours), ("published Tulip", tul), ("published vLLM 0.22", vll)]):
        bars = ax.bar(x + i * 0.27, vals, 0.27, label=lab)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(x + 0.27, names, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("p50 ms (log)")
    ax.legend(fontsize=8)
    ax = axes[1]
    x = np.arange(len(bulk))
    ours = [r["emb_per_s"] for r in bulk]
    pb = pub.get("bulk_emb_per_s", {})
    for i, (lab, vals) in enumerate([("Trellis (this run)", ours),
                                     ("published Tulip", [pb.get(r["tokens"], {}).get("tulip-rust", np.nan) for r in bulk]),
                                     ("published vLLM 0.22", [pb.get(r["tokens"], {}).get("vllm-0.22", np.nan) for r in bulk])]):
        bars = ax.bar(x + i * 0.27, vals, 0.27, label=lab)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(x + 0.27, [r["cell"] for r in bulk], fontsize=8)
    ax.set_ylabel("embeddings / s")
    env = rows[0]
    fig.suptitle(f"{model} through Tulip gRPC: {env['gpu']}, torch {env['torch']}, {env['when'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="preset:bge-m3", help="a Hub id, a model directory or preset:NAME (also "
                    "the correctness reference)")
    ap.add_argument("--target", default="", help="a running Tulip HOST:PORT (default: start one)")
    ap.add_argument("--tulip-args", default="", help="extra flags for the Tulip this starts")
    ap.add_argument("--n", type=int, default=10000, help="requests per online cell (published: 10,000)")
    ap.add_argument("--n-scoring", type=int, default=2000, help="requests per scoring cell (published: 10,000; 50 x 512 takes ~40 ms each)")
    ap.add_argument("--bulk-requests", default="10,5,2", help="requests per client at each bulk length")
    ap.add_argument("--lengths", default="128,512,4096", help="online sequence lengths")
    ap.add_argument("--scoring-length", type=int, default=512)
    ap.add_argument("--bulk-lengths", default="512,1024,4096")
    ap.add_argument("--suites", default="online,scoring,bulk")
    ap.add_argument("--transport", default="unary", choices=("unary", "stream"),
                    help="online/scoring requests as unary calls or messages on one open EmbedStream")
    ap.add_argument("--client-spin-ms", type=float, default=0.0,
                    help="with --transport stream: the client's event loop polls while a reply is due (TulipClient spin_ms)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)


    proc = None
    target = args.target
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out or Path("/tmp")) / "tulip.log"
    if not target:
        port = free_port()
        proc = spawn_tulip(args.model, args.tulip_args, port, log)
        target = f"127.0.0.1:{port}"
    name = model_tag(args.model)
    rec = Recorder(args.out, f"online_{name}")
    try:
        ch, stub = _stub(target)
        from trellis.tulip.v1 import tulip_pb2

        info = stub.Info(tulip_pb2.InfoRequest())
        vocab = info.vocab_size
        common = dict(model=args.model, backend=f"trellis-tulip {args.tulip_args}".strip(),
                      transport=f"grpc-{args.transport}", attention=info.attention)
        if args.client_spin_ms and args.transport == "stream":
            common["client_spin_ms"] = args.client_spin_ms
        cos = correctness_gate(stub, args.model, vocab)
        rec.emit(bench="gate", min_cosine=round(cos, 6), passed=cos >= 0.999, **common)
        if cos < 0.999:
            print(f"correctness gate FAILED: min cosine {cos:.6f} < 0.999; no timings taken", file=sys.stderr)
            return 1
        suites = args.suites.split(",")
        if "online" in suites:
            for L in map(int, args.lengths.split(",")):
                if L <= info.max_seq_len:
                    rec.emit(bench="online", cell=f"1x{L}", seqs=1, tokens=L, **common,
                             **time_sequential(stub, 1, L, args.n, vocab, target, args.transport,
                                                     args.client_spin_ms))
        if "scoring" in suites:
            L = min(args.scoring_length, info.max_seq_len)
            for b in (5, 25, 50):
                rec.emit(bench="scoring", cell=f"{b}x{L}", seqs=b, tokens=L, **common,
                         **time_sequential(stub, b, L, args.n_scoring, vocab, target, args.transport,
                                                     args.client_spin_ms))
        if "bulk" in suites:
            for L, n_req in zip(map(int, args.bulk_lengths.split(",")), map(int, args.bulk_requests.split(","))):
                if L <= info.max_seq_len:
                    rec.emit(bench="bulk", cell=f"100x{L} x4 clients", seqs=100, tokens=L, **common,
                             **bulk_clients(_bulk_client, (target, L, n_req, vocab), n_req))
        ch.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    if args.out is not None:
        chart([r for r in rec.rows if r["bench"] != "gate"], args.model, args.out / f"online_{name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
