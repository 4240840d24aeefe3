"""Tokenizers on one core: 514-token texts and a mix of lengths, with the model's 250k Unigram vocabulary.

    python -m benchmarks.tokenize --out benchmarks/results [--model preset:bge-m3] [--n 2000] [--cpu 0]

Candidates, where installed: Hugging Face `tokenizers` (`encode`, `encode_batch_fast` of one
text), `sentencepiece` (`encode` on the model's `sentencepiece.bpe.model`: its own ids, and mapped
to tokenizer.json's), `tokie` (`encode`, its own special tokens), `kitoken` (from the SentencePiece
model, raw and mapped), `fastokens`, and Ivy's own path (`ivy.tokenizer.TextTokenizer`: the backend
it picked, `ivy.native` on XLM-R-style and BERT tokenizers; ids into a numpy array). Pinned to one core
(`--cpu`; Rayon / OpenMP pools of one thread).
Per text length two modes: `distinct` (every call a new generated text, after each candidate has
encoded `--warm` other texts, so word caches hold what earlier traffic would have left, not the
text itself) and `repeat` (one text over and over, as published single-text figures usually are).
Candidates run in rounds of `--block` consecutive calls each, the order rotating, so that a noisy
machine slows all alike; call-by-call interleaving (`--block 1`) instead measures each library on
caches another one just evicted: tokie, whose tables are large, then ran 10-20x slower here.
`exact` says whether the ids equal `tokenizers`' on (up to 200 of) the row's texts. Packages that
cannot load the tokenizer.json get a row saying why (fastokens: no Precompiled normalizer).
The offload rows time `asyncio.to_thread` around one encode: what moving it off the loop costs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

TEXTS = {"en-514": (514, ("en",)), "multi-514": (514, None), "en-16": (16, ("en",)), "en-128": (128, ("en",)),
         "en-2048": (2048, ("en",))}


def pin(cpu: int | None) -> None:
    for var in ("RAYON_NUM_THREADS", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM"):
        os.environ.setdefault(var, "false" if var == "TOKENIZERS_PARALLELISM" else "1")
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def texts_of(reference, tokens: int, langs, count: int, seed: int = 3) -> list[str]:
    """`count` distinct generated texts (presets.standin) of `tokens` tokens with the special tokens,
    cut at the word where the count is reached (so a text may have a token or two more)."""
    from presets import standin

    out = []
    for i in range(count):
        text = standin.sample_text(tokens // 10 + 4, seed + i, langs or tuple(standin.LANGS))
        enc = reference.encode(text)
        while len(enc.ids) < tokens:
            text += " " + standin.sample_text(4, seed + i + 10_000 * len(text), langs or tuple(standin.LANGS))
            enc = reference.encode(text)
        n_special = sum(enc.special_tokens_mask)
        end = enc.offsets[tokens - n_special][1] if tokens > n_special else 0  # the last content token wanted
        cut = text.find(" ", end)
        out.append(text if cut < 0 else text[:cut])
    return out


def _sentencepiece(model: Path, reference) -> dict:
    import numpy as np
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model / "sentencepiece.bpe.model"))
    unk, bos, eos = reference.token_to_id("<unk>"), reference.token_to_id("<s>"), reference.token_to_id("</s>")
    # fairseq / XLM-R ids: model piece i is token i + 1, the model's <unk> (0) is <unk> (3)
    to_hf = np.arange(1, sp.get_piece_size() + 1, dtype=np.int64)
    to_hf[sp.unk_id()] = unk
    return {"sentencepiece.encode": lambda t: sp.encode(t),
            "sentencepiece.encode (mapped)": lambda t: [bos, *to_hf[sp.encode(t)].tolist(), eos]}


def _tokie(model: Path, reference) -> dict:
    import tokie

    tk = tokie.Tokenizer.from_json(str(model / "tokenizer.json"))
    return {"tokie.encode": lambda t: tk.encode(t).ids}


def _kitoken(model: Path, reference) -> dict:
    import kitoken
    import numpy as np

    kt = kitoken.Kitoken.from_sentencepiece_file(str(model / "sentencepiece.bpe.model"))
    kt_hf = np.arange(1, reference.get_vocab_size() - 1, dtype=np.int64)  # the same mapping as sentencepiece's
    kt_hf[0] = reference.token_to_id("<unk>")
    return {"kitoken.encode": lambda t: kt.encode(t, False),
            "kitoken.encode (mapped)": lambda t: [0, *kt_hf[kt.encode(t, False)].tolist(), 2]}


def _fastokens(model: Path, reference) -> dict:
    import fastokens

    ft = fastokens.Tokenizer.from_file(str(model / "tokenizer.json"))
    return {"fastokens.encode": lambda t: ft.encode(t).ids}


def candidates(model: Path, reference, max_len: int) -> tuple[dict, dict]:
    """name -> encode(text) -> ids (list or array), and name -> why it is missing."""

    from ivy.tokenizer import TextTokenizer

    have, missing = {}, {}
    batch = reference.encode_batch_fast
    have["tokenizers.encode"] = lambda t: reference.encode(t).ids
    have["tokenizers.encode_batch_fast"] = lambda t: batch([t])[0].ids
    ivy = TextTokenizer(model, max_len, 1 << 30)
    have[f"ivy ({ivy.backend})"] = lambda t: ivy._encode([t], False)[0]
    for lib, build in (("sentencepiece", _sentencepiece), ("tokie", _tokie), ("kitoken", _kitoken),
                       ("fastokens", _fastokens)):
        try:
            have.update(build(model, reference))
        except ImportError:
            missing[lib] = "not installed"
        except Exception as e:  # cannot load this tokenizer (a missing model file, an unsupported normalizer)
            missing[lib] = f"{type(e).__name__}: {e}"
    return have, missing


RAW = ("sentencepiece.encode", "kitoken.encode")  # the SentencePiece model's own ids: not comparable


def exact(name: str, ids, ref: list[int]) -> bool:
    return list(map(int, ids)) == ref


def timed(fns: dict, texts: list[str], block: int) -> dict[str, list[float]]:
    """One timed call of each candidate per text of `texts`, in rounds: each round runs every candidate
    on the next `block` texts, the order rotating from round to round (a noisy machine slows all alike;
    block 1 interleaves call by call, where each call meets the caches another library left)."""
    out = {k: [] for k in fns}
    names = list(fns)
    for f in fns.values():  # warm (the first calls page the tables in)
        for t in texts[:5]:
            f(t)
    clock = time.perf_counter_ns
    for r in range(-(-len(texts) // block)):
        chunk = texts[r * block:(r + 1) * block]
        for k in names[r % len(names):] + names[:r % len(names)]:
            f, times = fns[k], out[k]
            for t in chunk:
                t0 = clock()
                f(t)
                times.append((clock() - t0) / 1000)
    return out


def offload_cost(fn, text: str, n: int) -> dict[str, float]:
    """p50 of encoding inline and through asyncio.to_thread (the round trip a large batch would pay)."""
    import asyncio

    import numpy as np

    async def run():
        inline, thread = [], []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            fn(text)
            inline.append((time.perf_counter_ns() - t0) / 1000)
            t0 = time.perf_counter_ns()
            await asyncio.to_thread(fn, text)
            thread.append((time.perf_counter_ns() - t0) / 1000)
        return float(np.median(inline)), float(np.median(thread))

    a, b = asyncio.run(run())
    return {"inline_p50_us": round(a, 1), "to_thread_p50_us": round(b, 1), "offload_overhead_us": round(b - a, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="preset:bge-m3", help="a Hub id, preset:NAME or a model directory with "
                    "tokenizer.json")
    ap.add_argument("--n", type=int, default=2000, help="timed calls per candidate and text")
    ap.add_argument("--cpu", type=int, default=0, help="the core to pin to (-1: no pinning)")
    ap.add_argument("--texts", default=",".join(TEXTS), help=f"comma-separated, of {', '.join(TEXTS)}")
    ap.add_argument("--block", type=int, default=50, help="consecutive calls of one candidate per round "
                    "(1: call by call; then each call meets the caches another library left, which a server "
                    "running one tokenizer does not)")
    ap.add_argument("--pool", type=int, default=None, help="distinct texts per length (default: --n)")
    ap.add_argument("--warm", type=int, default=200, help="other texts each candidate encodes first (word caches "
                    "warmed by earlier traffic, as in a running server)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    pin(None if args.cpu < 0 else args.cpu)

    import numpy as np
    from tokenizers import Tokenizer

    from benchmarks.common import Recorder, model_tag
    from trellis.modeldir import ModelSpec
    from trellis.modelref import resolve_model_path

    model = resolve_model_path(args.model)
    spec = ModelSpec.read(model)
    reference = Tokenizer.from_file(str(model / "tokenizer.json"))
    reference.no_truncation()
    reference.no_padding()
    rec = Recorder(args.out, f"tokenize_{model_tag(args.model)}")
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        cpu = "unknown"
    have, missing = candidates(model, reference, spec.max_seq_len)
    meta = {"model": args.model, "vocab": reference.get_vocab_size(), "cpu": cpu,
            "pinned_cpu": None if args.cpu < 0 else args.cpu}
    for name, why in missing.items():
        rec.emit(bench="tokenize", tokenizer=name, missing=why, **meta)
    for label in args.texts.split(","):
        tokens, langs = TEXTS[label]
        pool = texts_of(reference, tokens, langs, args.pool or args.n)
        refs = [reference.encode(t).ids for t in pool]
        for t in texts_of(reference, tokens, langs, args.warm, seed=10_000_000):  # caches as after some traffic
            for f in have.values():
                f(t)
        for mode, texts in (("distinct", (pool * (-(-args.n // len(pool))))[:args.n]), ("repeat", pool[:1] * args.n)):
            row = dict(bench="tokenize", text=label, mode=mode, block=args.block,
                       tokens=round(float(np.mean([len(r) for r in refs])), 1) if mode == "distinct" else len(refs[0]),
                       chars=round(float(np.mean([len(t) for t in pool])), 1) if mode == "distinct" else len(pool[0]))
            for name, us in timed(have, texts, args.block).items():
                a = np.asarray(us)
                ok = all(exact(name, have[name](t), r) for t, r in zip(pool[:200], refs))
                rec.emit(**row, tokenizer=name, p50_us=round(float(np.percentile(a, 50)), 1),
                         p99_us=round(float(np.percentile(a, 99)), 1), mean_us=round(float(a.mean()), 1), n=len(a),
                         exact=None if name in RAW else ok, **meta)
        if label == "en-514":
            for name in ("tokenizers.encode_batch_fast", next(k for k in have if k.startswith("ivy"))):
                rec.emit(bench="tokenize_offload", tokenizer=name, text=label, tokens=len(refs[0]),
                         n=min(args.n, 500), **offload_cost(have[name], pool[0], min(args.n, 500)), **meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
