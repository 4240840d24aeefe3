"""POST /v1/rerank and Cohere's /v2/rerank (documents by a cross-encoder's score of each (query,
document) pair, or by cosine similarity to the query's embedding, or with `weights` by BGE-M3's
hybrid of dense, sparse and ColBERT scores) and vLLM's POST /v1/score (the same scores, 1:N or
N:N), each routed by `model`."""

from __future__ import annotations

import math
import time
import uuid

import numpy as np
import orjson

from ivy import errors
from ivy.errors import APIError
from ivy.front import Stamp
from ivy.routes.common import Context, Routes, tulip_call, verify
from ivy.routes.embeddings import embed
from ivy.routes.images import has_items, image_scores
from ivy.schemas import RerankRequest, ScoreRequest, ScoreWeights
from ivy.served import ServedModel
from trellis.options import Options
from trellis.tulip.v1 import tulip_pb2

MODES = ("dense", "sparse", "colbert")  # the order of FlagEmbedding's weights_for_different_modes
MODE_OUTPUTS = {"sparse": tulip_pb2.OUTPUT_SPARSE, "colbert": tulip_pb2.OUTPUT_COLBERT}


def hybrid_weights(w: ScoreWeights | list[float] | None) -> tuple[float, float, float] | None:
    """A request's `weights` as (dense, sparse, colbert), checked: each finite and >= 0, one > 0."""
    if w is None:
        return None
    if isinstance(w, list):
        if len(w) != 3:
            raise APIError(400, f"'weights' as an array is [dense, sparse, colbert] (FlagEmbedding's "
                           f"weights_for_different_modes): 3 numbers, got {len(w)}", "weights")
        vals = tuple(w)
    else:
        vals = (w.dense, w.sparse, w.colbert)
    for mode, v in zip(MODES, vals):
        if not math.isfinite(v) or v < 0:
            raise APIError(400, f"weights.{mode} must be a finite number >= 0, got {v}", "weights")
    if not any(vals):
        raise APIError(400, "'weights' are all zero: give at least one of dense, sparse, colbert a positive weight",
                       "weights")
    return vals


def lexical_match(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """BGE-M3's sparse score of two texts' lexical weights ((token ids, weights), one weight per id):
    the sum over the token ids both hold of the product of their weights."""
    _, ia, ib = np.intersect1d(a[0], b[0], assume_unique=True, return_indices=True)
    return float(np.dot(a[1][ia].astype(np.float64), b[1][ib].astype(np.float64)))


def maxsim(q: np.ndarray, docs: list[np.ndarray]) -> np.ndarray:
    """ColBERT's score of a query's vectors against each document's (all L2-normalised here): the
    mean over the query's vectors of the largest dot product with one of the document's vectors."""
    out = np.zeros(len(docs))
    keep = [i for i, d in enumerate(docs) if len(d)]
    if not len(q) or not keep:
        return out
    flat = unit(np.concatenate([docs[i] for i in keep]))
    starts = np.cumsum([0] + [len(docs[i]) for i in keep[:-1]])
    sims = unit(q) @ flat.T  # [query vectors, every document's vectors]
    out[keep] = np.maximum.reduceat(sims, starts, axis=1).mean(0)
    return out


def unit(v: np.ndarray) -> np.ndarray:
    """Rows (the last axis) L2-normalised, in float64."""
    v = v.astype(np.float64)
    return v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12)


async def ranked(ctx: Context, req: RerankRequest) -> tuple[ServedModel, np.ndarray, np.ndarray, int]:
    """A rerank request's checks and scores, whichever route took it: (the model, the documents'
    indices best first (`top_n` of them), every document's score, the request's token count)."""
    weights = hybrid_weights(req.weights)
    model = ctx.models.get(req.model)
    model.check_room()
    if not req.documents:
        raise APIError(400, "'documents' must not be empty", "documents")
    ctx.check_count(len(req.documents) + 1, "documents")
    if req.top_n is not None and req.top_n < 1:
        raise APIError(400, f"top_n must be at least 1, got {req.top_n}", "top_n")
    if req.max_tokens_per_doc is not None and req.max_tokens_per_doc < 1:
        raise APIError(400, f"max_tokens_per_doc must be at least 1, got {req.max_tokens_per_doc}",
                       "max_tokens_per_doc")
    for i, d in enumerate([req.query, *req.documents]):
        if not d:
            raise APIError(400, "'query' is an empty string" if i == 0 else f"document {i - 1} is an empty string",
                           "query" if i == 0 else "documents")
    docs = req.documents
    if req.max_tokens_per_doc is not None:
        docs = await model.offload(sum(map(len, docs)), model.tokenizer.cut, docs, req.max_tokens_per_doc)
    seqs, scores = await _scores(ctx, model, req.query, docs, req.truncate, req.raw_scores, req.instruction,
                                 weights, ("query", None), ("documents", "document"), "document {} with the query",
                                 req.priority)
    tokens = int(sum(len(s) for s in seqs))
    ctx.metrics.tokens.labels(model.name).inc(tokens)
    return model, np.argsort(-scores, kind="stable")[: req.top_n], scores, tokens


async def _scores(ctx: Context, model: ServedModel, queries: str | list[str], documents: list[str], truncate: bool,
                  raw_scores: bool, instruction: str | None, weights: tuple[float, float, float] | None,
                  query_names: tuple[str, str | None], document_names: tuple[str, str | None],
                  pair_item: str, priority: str | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """Per document its score against the query (one for all, or one per document): a
    cross-encoder's score of the pair, or the cosine of a bi-encoder's embeddings, or with
    `weights` BGE-M3's hybrid. `*_names`: the request field and item label (None: one text) that
    length errors name; `priority`: the body's (`Context.options`)."""
    info = await model.info()
    if info.num_labels:
        if weights is not None:
            raise APIError(400, "'weights' mix an embedding model's dense, sparse and ColBERT scores (BGE-M3); "
                           f"'{model.name}' is a cross-encoder: it gives one score per pair", "weights")
        return await _pair_scores(ctx, model, queries, documents, truncate, raw_scores, instruction, info,
                                  document_names[0], pair_item, priority)
    verify(Options(raw_scores=raw_scores), info)  # raw_scores: a cross-encoder's; this model scores by cosine
    outputs = ()
    if weights is not None:
        missing = [m for m, w in zip(MODES, weights) if w and m in MODE_OUTPUTS
                   and MODE_OUTPUTS[m] not in info.outputs]
        if missing:
            raise APIError(400, f"'weights' give {' and '.join(missing)} a weight, but '{model.name}' has no "
                           f"{' or '.join(missing)} head (BGE-M3's sparse_linear.pt / colbert_linear.pt)",
                           "weights")
        outputs = tuple(MODE_OUTPUTS[m] for m, w in zip(MODES, weights) if w and m in MODE_OUTPUTS)
    return await _embedding_scores(ctx, model, [queries] if isinstance(queries, str) else queries, documents,
                                   instruction, truncate, weights, outputs, query_names, document_names, priority)


async def _embedding_scores(ctx: Context, model: ServedModel, queries: list[str], documents: list[str],
                            instruction: str | None, truncate: bool, weights: tuple[float, float, float] | None,
                            outputs: tuple[int, ...], query_names: tuple[str, str | None],
                            document_names: tuple[str, str | None],
                            priority: str | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """A bi-encoder's scores: each document's cosine similarity to its query (or the one query),
    or with `weights` the weighted mean of that, the lexical match and ColBERT's max-sim (the
    `outputs` those need asked of Tulip); the queries with the model's query prompt, the
    documents with its document prompt, every text once in one request to Tulip."""
    prompt = model.templates.prefix
    q, q_pool = await model.text_sequences(queries, prompt("query", instruction), truncate, *query_names)
    d, d_pool = await model.text_sequences(documents, prompt("document", None), truncate, *document_names)
    pool_from = (q_pool or [0] * len(q)) + (d_pool or [0] * len(d)) if q_pool or d_pool else []
    seqs = q + d
    result = await tulip_call(model.balancer, seqs, ctx.options(pool_from=pool_from, outputs=outputs,
                                                                priority=priority))
    v = unit(result.vectors)
    dense = (v[len(q):] * v[: len(q)]).sum(1)  # one query row broadcasts over the documents
    if weights is None:
        return seqs, dense
    w_dense, w_sparse, w_colbert = weights
    nq, nd = len(q), len(d)
    total = w_dense * dense
    if w_sparse:
        sp = result.sparse
        total += w_sparse * np.array([lexical_match(sp[0 if nq == 1 else i], sp[nq + i]) for i in range(nd)])
    if w_colbert:
        cb = result.colbert
        total += w_colbert * (maxsim(cb[0], cb[nq:]) if nq == 1 else
                              np.array([maxsim(cb[i], [cb[nq + i]])[0] for i in range(nd)]))
    return seqs, total / sum(weights)


async def _pair_scores(ctx: Context, model: ServedModel, queries: str | list[str], documents: list[str],
                       truncate: bool, raw_scores: bool, instruction: str | None, info: tulip_pb2.InfoReply, param: str,
                       pair_item: str, priority: str | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """A cross-encoder's scores: each (query, document) pair scored together, as
    sentence-transformers' CrossEncoder.predict scores it (activated, or raw logits with raw_scores);
    `instruction` is its `prompt` for a model whose pairs go through a chat template (the system message)."""
    if info.num_labels != 1:
        raise APIError(400, f"'{model.name}' gives {info.num_labels} scores per pair (a classifier); scoring "
                       "pairs needs one relevance score per pair", "model")
    if instruction is not None and model.tokenizer.chat is None:
        raise APIError(400, "'instruction' applies to a bi-encoder's query prompt or a chat-template reranker's "
                       "system message; this cross-encoder reads the query and each document together, "
                       "without one", "instruction")
    seqs, starts = await model.pair_sequences(queries, documents, truncate, param, pair_item, instruction)
    opts = ctx.options(segment_starts=starts if any(starts) else (), raw_scores=raw_scores, priority=priority)
    result = await tulip_call(model.balancer, seqs, opts)
    return seqs, result.scores[:, 0].astype(np.float64)


def routes(ctx: Context) -> Routes:
    models, prompt_tokens = ctx.models, ctx.metrics.tokens
    out = Routes()

    async def rerank(body: bytes, stamp: Stamp) -> bytes:
        req = errors.parse_body(RerankRequest, body)
        model, order, scores, tokens = await ranked(ctx, req)
        results = [{"index": int(i), "relevance_score": float(scores[i]),
                    **({"document": {"text": req.documents[i]}} if req.return_documents else {})} for i in order]
        # Jina's reply (model, results, usage) and Cohere's (id, results, meta) in one
        return orjson.dumps({"id": f"rerank-{uuid.uuid4().hex}", "model": model.name, "results": results,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                             "meta": {"tokens": {"input_tokens": tokens, "output_tokens": 0}}})

    async def score(body: bytes, stamp: Stamp) -> bytes:
        """vLLM's score API: 1:N (text_1 one text) or N:N (pairwise) relevance scores."""
        req = errors.parse_body(ScoreRequest, body)
        if has_items(req.text_2):  # Jina's {"text"} / {"image"} items: texts against images (ivy/routes/images.py)
            return await image_scores(ctx, req, embed, stamp)
        weights = hybrid_weights(req.weights)
        model = models.get(req.model)
        model.check_room()
        t1, t2 = ([t] if isinstance(t, str) else t for t in (req.text_1, req.text_2))
        for name, texts, sent in (("text_1", t1, req.text_1), ("text_2", t2, req.text_2)):
            if not texts:
                raise APIError(400, f"'{name}' must not be empty", name)
            for i, t in enumerate(texts):
                if not t:
                    raise APIError(400, f"'{name}' is an empty string" if isinstance(sent, str)
                                   else f"{name} item {i} is an empty string", name)
        if len(t1) not in (1, len(t2)):
            raise APIError(400, f"'text_1' has {len(t1)} texts and 'text_2' has {len(t2)}: send one text_1 to "
                           "score against every text_2 (1:N), or as many as text_2 to score pairwise (N:N)",
                           "text_1")
        ctx.check_count(len(t1) + len(t2), "text_2")
        one = t1[0] if len(t1) == 1 else t1
        seqs, scores = await _scores(
            ctx, model, one, t2, req.truncate, req.raw_scores, None, weights,
            ("text_1", None if isinstance(req.text_1, str) else "text_1 item"),
            ("text_2", None if isinstance(req.text_2, str) else "text_2 item"),
            "pair {} (text_1, text_2)" if len(t1) > 1 else "text_2 item {} with text_1", req.priority)
        tokens = int(sum(len(s) for s in seqs))
        prompt_tokens.labels(model.name).inc(tokens)
        return orjson.dumps({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                             "model": model.name,
                             "data": [{"index": i, "object": "score", "score": float(v)} for i, v in enumerate(scores)],
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    out.post("/v1/rerank", rerank, RerankRequest)
    out.post("/v2/rerank", rerank, RerankRequest, name="rerank_v2")  # Cohere's path, the same handler
    out.post("/v1/score", score, ScoreRequest)
    return out
