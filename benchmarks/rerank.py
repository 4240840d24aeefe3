"""Reranking through Ivy (issue #15): one query against D documents of L tokens per `/v1/rerank`
request, a cross-encoder (each (query, document) pair scored together) beside a bi-encoder (the
documents' cosine to the query), text in, tokenization included.

    python -m benchmarks.rerank --model preset:bge-reranker-v2-m3 --model preset:bge-m3 --documents 50 --doc-tokens 256 \\
        --n 200 --out benchmarks/results [--quick] [--target URL]

For each model: starts `deploy.local` (one Tulip, one Ivy; Tulip settings through TULIP_* variables as
for benchmarks.concurrency, e.g. TULIP_COMPILE=true), or uses the Ivy at `--target` (one model), builds
a query of `--query-tokens` tokens and D distinct documents of exactly `--doc-tokens` tokens each with
the model's own tokenizer (special tokens included, as each document is embedded alone; a
cross-encoder's pair is the query and the document in its pair template), checks correctness first
and aborts the run (exit 1) when that fails:

- cross-encoder: the pair scores Ivy returns (raw logits, `raw_scores: true`, and the activated scores)
  against a float32 eager engine on the same weights and device, over the pairs as the tokenizer's
  pair template builds them (`tokenizers`' `encode(query, document)`, token types from its type ids);
- bi-encoder: the cosine scores (and so the ordering) against the float32 engine's embeddings of the
  query and the documents, each tokenized alone (a model with query / document prompts is refused);

both pass when Ivy counted the reference's tokens, the largest difference of a score is within
TOLERANCE (about three times what bfloat16 serving moved the random-weight presets' scores, measured
on a CPU) and the served scores follow the reference's across the documents (Pearson >=
MIN_CORRELATION, where D >= 3 and they vary). Then `/v1/rerank` requests (activated scores) from 1 client,
sequential (p50 / p99 ms, documents/s), and from 4 concurrent clients (throughput), `--n` requests per
cell. One JSON-lines file per model (`rerank_<model>.jsonl`) and `rerank_p50.png`: p50 by model.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.common import Recorder, free_port, model_tag, pyplot, spawn_until_ready
from benchmarks.concurrency import http_level, text_of

# Largest |served - reference| a score may differ by: raw logits and activated scores of a
# cross-encoder, cosines of a bi-encoder. bfloat16 serving against float32, on a 2-core CPU with
# the random-weight presets at 12 documents of 256 tokens: logits up to 0.009 apart (their spread
# over documents 0.023, correlation 0.989), bge-m3's cosines 0.0005 (spread 0.003, correlation 0.997).
TOLERANCE = {"cross-encoder": 0.03, "bi-encoder": 0.005}
MIN_CORRELATION = 0.9
QUERY_WORDS = ("which signals do search engines use to rank the most relevant documents for a short "
               "question").split()
DOC_WORDS = ("retrieval systems score passages against questions with learned dense vectors sparse "
             "lexical weights and cross attention over both texts then sort them by relevance before "
             "showing the best few results to readers in many languages and domains").split()
FULL = {"documents": 50, "doc_tokens": 256, "query_tokens": 16, "n": 200}
QUICK = {"documents": 4, "doc_tokens": 24, "query_tokens": 8, "n": 6}


def texts(tokenizer_path: Path, query_tokens: int, doc_tokens: int, documents: int) -> tuple[str, list[str]]:
    """The query (`query_tokens` tokens) and `documents` distinct documents of `doc_tokens` tokens each
    (special tokens included), from the model's tokenizer.json."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    query = text_of(tok, query_tokens, words=QUERY_WORDS)
    docs = [text_of(tok, doc_tokens, seed=i, words=DOC_WORDS) for i in range(documents)]
    lengths = {len(tok.encode(d).ids) for d in docs}
    if lengths != {doc_tokens} or len({tuple(tok.encode(d).ids) for d in docs}) != documents:
        raise ValueError(f"documents of {sorted(lengths)} tokens (asked for {doc_tokens}), "
                         f"{len(set(docs))} distinct of {documents}")
    return query, docs


def _rerank(url: str, body: dict) -> dict:
    import httpx

    r = httpx.post(url + "/v1/rerank", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"Ivy answered {r.status_code}: {r.text}")
    return r.json()


def _by_index(reply: dict, n: int) -> np.ndarray:
    scores = np.full(n, np.nan)
    for res in reply["results"]:
        scores[res["index"]] = res["relevance_score"]
    return scores


def reference(model: str, query: str, docs: list[str]) -> dict:
    """The float32 eager engine's scores (on the GPU where there is one, as the benchmark serves):
    a cross-encoder's logits and activated scores of each pair, or a bi-encoder's cosines."""
    import torch
    from tokenizers import Tokenizer

    from rose.batch import Batch
    from rose.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=model, device="cuda" if torch.cuda.is_available() else "cpu",
                                 dtype="float32", attention="sdpa", graphs="off"))
    try:
        tok = Tokenizer.from_file(str(engine.spec.path / "tokenizer.json"))
        tok.no_padding()
        tok.no_truncation()
        if engine.num_labels and engine.spec.chat_template:  # a decoder reranker: pairs rendered as Ivy renders
            from ivy.chat import ChatPairs, special_tokens  # them (tokens checked against sentence-transformers'
            # by tests/test_chat_reranker.py)
            spec = engine.spec
            chat = ChatPairs(spec.chat_template, spec.message_format, tok, spec.max_seq_len, special_tokens(spec.path))
            seqs = [s.tolist() for s in chat.encode([(query, d) for d in docs], True)]
            starts = [0] * len(seqs)
        elif engine.num_labels:
            encs = tok.encode_batch([(query, d) for d in docs])
            seqs = [e.ids for e in encs]
            starts = [e.type_ids.index(1) if 1 in e.type_ids else 0 for e in encs]
        if engine.num_labels:
            logits = engine.step(Batch.from_sequences(seqs, None, starts)).synchronize().numpy()
            return {"kind": "cross-encoder", "tokens": sum(map(len, seqs)), "logits": logits[:, 0].astype(np.float64),
                    "scores": engine.activate(logits)[:, 0].astype(np.float64)}
        if any(engine.spec.prompts.get(k) for k in ("query", "document")):
            raise ValueError(f"{model} has query / document prompts; this gate's reference does not apply them")
        seqs = [e.ids for e in tok.encode_batch([query, *docs])]
        v = engine.step(Batch.from_sequences(seqs)).synchronize().numpy().astype(np.float64)
        v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        return {"kind": "bi-encoder", "tokens": sum(map(len, seqs)), "scores": v[1:] @ v[0]}
    finally:
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def compare(served: np.ndarray, ref: np.ndarray) -> tuple[float, float | None]:
    """The largest difference, and the Pearson correlation across documents (None where there are
    fewer than 3 or the reference does not vary)."""
    diff = float(np.max(np.abs(served - ref))) if np.isfinite(served).all() else float("inf")
    corr = None
    if len(ref) >= 3 and np.std(ref) > 0 and np.isfinite(served).all():
        corr = float(np.corrcoef(served, ref)[0, 1]) if np.std(served) > 0 else 0.0
    return diff, corr


def gate(url: str, served_name: str, ref: dict, query: str, docs: list[str]) -> dict:
    """Served scores against `ref` (`reference(model, query, docs)`): the gate row's fields."""
    kind, tol = ref["kind"], TOLERANCE[ref["kind"]]
    body = {"model": served_name, "query": query, "documents": docs}
    reply = _rerank(url, body)
    checks = {"scores": compare(_by_index(reply, len(docs)), ref["scores"])}
    if kind == "cross-encoder":
        checks["logits"] = compare(_by_index(_rerank(url, {**body, "raw_scores": True}), len(docs)), ref["logits"])
    tokens = reply["usage"]["prompt_tokens"]
    passed = tokens == ref["tokens"] and all(
        d <= tol and (c is None or c >= MIN_CORRELATION) for d, c in checks.values())
    row = {"kind": kind, "passed": passed, "tolerance": tol, "min_correlation": MIN_CORRELATION,
           "served_tokens": tokens, "reference_tokens": ref["tokens"],
           "reference_spread": round(float(np.std(ref.get("logits", ref["scores"]))), 6)}
    for name, (d, c) in checks.items():
        row[f"max_abs_diff_{name}"] = round(d, 6)
        row[f"correlation_{name}"] = None if c is None else round(c, 6)
    return row


def chart(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    cells = [r for r in rows if r["bench"] == "rerank" and r["clients"] == 1]
    if not cells:
        return
    fig, ax = plt.subplots(figsize=(1.8 * len(cells) + 2.5, 3.6))
    names = [f"{r['model']}\n({r['kind']})" for r in cells]
    bars = ax.bar(names, [r["p50_ms"] for r in cells], color=["#4c72b0" if r["kind"] == "cross-encoder" else "#dd8452"
                                                              for r in cells])
    for b, r in zip(bars, cells):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{r['p50_ms']:.1f} ms\np99 {r['p99_ms']:.1f}",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("p50 ms per request (1 client)")
    ax.set_ylim(0, 1.3 * max(r["p99_ms"] for r in cells))
    c = cells[0]
    ax.set_title(f"/v1/rerank: 1 query x {c['documents']} documents of {c['doc_tokens']} tokens, {c['gpu']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="a Hub id, a model directory or preset:NAME (repeat: each in "
                    "turn; default preset:bge-reranker-v2-m3 then preset:bge-m3)")
    ap.add_argument("--documents", type=int, help=f"documents per request (default {FULL['documents']})")
    ap.add_argument("--doc-tokens", type=int, help=f"tokens per document (default {FULL['doc_tokens']})")
    ap.add_argument("--query-tokens", type=int, help=f"tokens of the query (default {FULL['query_tokens']})")
    ap.add_argument("--n", type=int, help=f"requests per cell (default {FULL['n']})")
    ap.add_argument("--clients", default="1,4", help="concurrent clients per cell")
    ap.add_argument("--target", default="", help="an Ivy already serving the one --model (its base URL)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="tiny cells: a harness check, not a measurement")
    args = ap.parse_args(argv)
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    models = args.model or ["preset:bge-reranker-v2-m3", "preset:bge-m3"]
    if args.target and len(models) != 1:
        ap.error("--target serves one model: give one --model (the gate's reference)")
    from trellis.modelref import resolve_model_path

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for model in models:
        path = resolve_model_path(model)
        query, docs = texts(path / "tokenizer.json", args.query_tokens, args.doc_tokens, args.documents)
        proc = None
        with ThreadPoolExecutor(1) as pool:  # the reference is computed while the stack starts
            ref = pool.submit(reference, model, query, docs)
            if args.target:
                url = args.target.rstrip("/")
            else:
                port = free_port()
                log = (args.out or Path("/tmp")) / f"stack_rerank_{model_tag(model)}.log"
                proc = spawn_until_ready(["deploy.local", "--model", model, "--port", str(port)], "Trellis is ready",
                                         log)
                url = f"http://127.0.0.1:{port}"
        try:
            ref = ref.result()
            rec = Recorder(args.out, f"rerank_{model_tag(model)}")
            with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
                served_name = json.load(r)["data"][0]["id"]
            common = dict(model=model_tag(model), backend="trellis-ivy", transport="http", documents=args.documents,
                          doc_tokens=args.doc_tokens, query_tokens=args.query_tokens)
            g = gate(url, served_name, ref, query, docs)
            rows.append(rec.emit(bench="gate", **g, **common))
            if not g["passed"]:
                print(f"correctness gate FAILED for {model}: {json.dumps(g)}; no timings taken", file=sys.stderr)
                return 1
            body = {"model": served_name, "query": query, "documents": docs}
            for c in map(int, args.clients.split(",")):
                cell = http_level(url, "/v1/rerank", body, c, args.n)
                rows.append(rec.emit(bench="rerank", kind=g["kind"], clients=c,
                                     cell=f"1 query x {args.documents} x {args.doc_tokens} tokens, {c} clients",
                                     tokens_per_request=g["served_tokens"],
                                     docs_per_s=round(cell["req_per_s"] * args.documents, 1), **cell, **common))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    if args.out is not None:
        chart(rows, args.out / "rerank_p50.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
