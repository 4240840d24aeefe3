"""fp8's fidelity (issue 52), stated not assumed: the same sentences embedded by the bf16 engine and by the fp8
one (`--quantization fp8`, every step through the fp8 GEMMs), compared vector by vector and as a ranking.

    python -m benchmarks.fp8_fidelity --model default --model preset:bge-m3 --sentences 3000 --out DIR

Per model, one JSON line: cosine of each fp8 vector to its bf16 one (min, p01, p50, mean), the Spearman
correlation of all pairwise cosine similarities (fp8's against bf16's), the overlap of each sentence's
top-10 neighbours (mean, min, p01), with `--fp32` the same of bf16 and of fp8 against float32 (how far
bf16 itself is), plus the machine, versions, revision and date. On a CPU the fp8 GEMMs run too (torch's
`_scaled_mm`, slowly) with the fused kernels' maths in torch (`rose.layers.fp8`); on CUDA the Triton kernels.
Sentences: generated, varied (questions, statements, product and support queries, code, numbers, several
languages), seeded; steps of up to `--step-tokens` tokens.
The recipe is `rose.layers.fp8`'s (first block's FFN and last block's qkv / out in bf16, searched weight scales);
ROSE_FP8_OPS (GEMMs) and ROSE_FP8_BF16_LAYERS (blocks or GEMMs kept in bf16, e.g. "0" the first block whole, "-1:qkv"
the last block's qkv, "" none) attribute the loss.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import Recorder, model_tag
from rose.batch import Batch
from rose.engine import Engine, EngineConfig

SUBJECTS = ["the city council", "my landlord", "a small startup", "the research team", "our new neighbour",
            "the football club", "a local bakery", "the hospital", "my grandmother", "the airline",
            "the school board", "a software engineer", "the museum", "the central bank", "a freelance designer"]
VERBS = ["announced", "cancelled", "postponed", "approved", "criticised", "celebrated", "investigated",
         "funded", "redesigned", "questioned", "launched", "recommended"]
OBJECTS = ["a new recycling programme", "the summer festival", "plans for a bike lane", "the annual budget",
           "a cheaper subscription", "the opening of a second branch", "an experimental vaccine trial",
           "the evening train schedule", "a chess tournament for children", "the price of bread",
           "a scholarship for nurses", "the renovation of the old bridge", "a remote work policy"]
WHEN = ["on Monday", "last week", "after a long debate", "despite the protests", "without warning",
        "for the third time this year", "in March", "before the election", "during the storm"]
QUESTIONS = ["How do I {v} {o}?", "What is the best way to {v} {o}?", "Why would anyone {v} {o}?",
             "Can you explain how to {v} {o} step by step?", "Is it safe to {v} {o} at home?",
             "Where can I {v} {o} near me?"]
ACTIONS = ["reset", "repair", "clean", "install", "cancel", "upgrade", "back up", "paint", "sell", "insure"]
THINGS = ["a leaking kitchen tap", "my email password", "an old laptop battery", "a wooden garden fence",
          "the car's air filter", "a Python virtual environment", "a wireless router", "my phone contract",
          "a bathroom ceiling", "winter tyres", "a second-hand bicycle", "the family photo archive"]
PRODUCTS = ["running shoes", "noise cancelling headphones", "a gaming chair", "organic coffee beans",
            "a 4K monitor", "a standing desk", "a cast iron pan", "a children's tent", "an electric kettle"]
ADJ = ["cheap", "durable", "lightweight", "waterproof", "quiet", "refurbished", "eco-friendly", "compact"]
OTHER = [
    "Paris is the capital and most populous city of France.", "東京は日本の首都です。", "我喜欢在周末去公园散步。",
    "Die Katze sitzt auf der Matte und schaut aus dem Fenster.", "¿Dónde está la estación de tren más cercana?",
    "Привет, как дела? Сегодня хорошая погода.", "서울은 대한민국의 수도입니다.", "मुझे किताबें पढ़ना पसंद है।",
    "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "SELECT id, name FROM users WHERE created_at > NOW() - INTERVAL '7 days';",
    "The invoice total was $1,234.56, due on 2026-12-31.", "I ❤️ pizza 🍕 and sushi 🍣!!!",
]


def sentences(n: int, seed: int = 0) -> list[str]:
    """n distinct varied sentences (seeded): news-like statements, how-to questions, shopping queries,
    support requests, numbers, a few in other languages and code."""
    rng = random.Random(seed)
    out, seen = [], set()
    makers = [
        lambda: f"{rng.choice(SUBJECTS).capitalize()} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(WHEN)}.",
        lambda: rng.choice(QUESTIONS).format(v=rng.choice(ACTIONS), o=rng.choice(THINGS)),
        lambda: f"{rng.choice(ADJ)} {rng.choice(PRODUCTS)} under {rng.randrange(20, 400)} euros",
        lambda: f"best {rng.choice(ADJ)} {rng.choice(PRODUCTS)} for {rng.choice(['beginners', 'kids', 'travel', 'the office', 'winter'])} {rng.randrange(2020, 2027)}",
        lambda: f"My order #{rng.randrange(10000, 99999)} of {rng.choice(PRODUCTS)} arrived {rng.choice(['broken', 'late', 'without the charger', 'in the wrong colour'])}; "
                f"I would like to {rng.choice(['return it', 'get a refund', 'exchange it', 'speak to someone'])}.",
        lambda: f"{rng.choice(SUBJECTS).capitalize()} said that {rng.choice(OBJECTS)} would cost about "
                f"{rng.randrange(2, 90)} million and take {rng.randrange(2, 30)} months.",
        lambda: rng.choice(OTHER) + ("" if rng.random() < 0.5 else f" ({rng.randrange(1, 1000)})"),
    ]
    while len(out) < n:
        s = rng.choice(makers)()
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def tokenize(path: Path, texts: list[str], max_len: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.enable_truncation(max_len)
    tok.no_padding()
    return [e.ids for e in tok.encode_batch(texts)]


def steps(seqs: list[list[int]], budget: int) -> list[Batch]:
    out, cur, n = [], [], 0
    for s in seqs:
        if cur and n + len(s) > budget:
            out.append(Batch.from_sequences(cur))
            cur, n = [], 0
        cur.append(s)
        n += len(s)
    return out + [Batch.from_sequences(cur)]


def embed_all(engine: Engine, batches: list[Batch]) -> torch.Tensor:
    return torch.cat([engine.step(b).synchronize().clone() for b in batches]).float()


def compare(test: torch.Tensor, ref: torch.Tensor, k: int = 10) -> dict:
    """Per vector cosine, the Spearman correlation of the pairwise similarities (upper triangle), top-k
    neighbour overlap (each sentence's k most similar others under `ref` and under `test`)."""
    a, b = torch.nn.functional.normalize(test, dim=1), torch.nn.functional.normalize(ref, dim=1)
    cos = (a * b).sum(1).double().numpy()
    sa, sb = a @ a.T, b @ b.T
    iu = torch.triu_indices(len(a), len(a), 1)
    x, y = sa[iu[0], iu[1]], sb[iu[0], iu[1]]

    def ranks(v):
        r = torch.empty_like(v, dtype=torch.float64)
        r[v.argsort()] = torch.arange(len(v), dtype=torch.float64)
        return r

    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    spearman = float((rx * ry).sum() / (rx.norm() * ry.norm()))
    eye = torch.eye(len(a), dtype=torch.bool)
    ta = sa.masked_fill(eye, -2).topk(k, dim=1).indices
    tb = sb.masked_fill(eye, -2).topk(k, dim=1).indices
    overlap = np.array([len(set(p.tolist()) & set(q.tolist())) / k for p, q in zip(ta, tb)])
    return {"cos_min": round(float(cos.min()), 6), "cos_p01": round(float(np.percentile(cos, 1)), 6),
            "cos_p50": round(float(np.median(cos)), 6), "cos_mean": round(float(cos.mean()), 6),
            "spearman_pairwise": round(spearman, 6), "pairs": len(x),
            f"top{k}_overlap_mean": round(float(overlap.mean()), 4), f"top{k}_overlap_min": round(float(overlap.min()), 4),
            f"top{k}_overlap_p01": round(float(np.percentile(overlap, 1)), 4)}


def measure(model: str, n: int, device: str, step_tokens: int, fp32: bool, seed: int) -> dict:
    common = dict(model=model, device=device, kernel_tokens=0, graphs="off")
    t0 = time.perf_counter()
    bf16 = Engine(EngineConfig(dtype="bfloat16", **common))
    path = bf16.spec.path
    seqs = tokenize(path, sentences(n, seed), bf16.spec.max_seq_len)
    batches = steps(seqs, step_tokens)
    ref = embed_all(bf16, batches)
    del bf16
    fp8 = Engine(EngineConfig(quantization="fp8", fp8_min_tokens=1, **common))  # every step through fp8
    got = embed_all(fp8, batches)
    kernels = "triton" if fp8.device.type == "cuda" else "torch (CPU: the fused kernels' maths in torch)"
    del fp8
    row = {"bench": "fp8_fidelity", "model": model, "sentences": n, "tokens": int(sum(map(len, seqs))),
           "steps": len(batches), "step_tokens": step_tokens, "device": device, "fused_kernels": kernels,
           "fp8_vs_bf16": compare(got, ref)}
    if fp32:
        full = Engine(EngineConfig(dtype="float32", **common))
        want = embed_all(full, batches)
        row["bf16_vs_fp32"] = compare(ref, want)
        row["fp8_vs_fp32"] = compare(got, want)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="model reference (repeatable); default: default (MiniLM)")
    ap.add_argument("--sentences", type=int, default=3000)
    ap.add_argument("--step-tokens", type=int, default=8192, help="tokens per engine step")
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu")
    ap.add_argument("--fp32", action="store_true", help="also compare bf16 and fp8 with float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    models = args.model or ["default"]
    rec = Recorder(args.out, "fp8_fidelity_" + "_".join(model_tag(m) for m in models))
    for m in models:
        row = measure(m, args.sentences, device, args.step_tokens, args.fp32, args.seed)
        rec.emit(**row)
        f = row["fp8_vs_bf16"]
        print(json.dumps({"model": m, "summary": f"fp8 vs bf16: min cos {f['cos_min']}, p01 {f['cos_p01']}, "
                          f"Spearman {f['spearman_pairwise']}, top-10 overlap {f['top10_overlap_mean']}"}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
