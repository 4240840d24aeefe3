"""Ivy's FastAPI application: the OpenAI-compatible HTTP API in front of Tulip.

Routes: POST /v1/embeddings, POST /v1/rerank and Cohere's POST /v2/rerank (documents by a
cross-encoder's score of each (query, document) pair, or by cosine similarity to the query's
embedding), vLLM's POST /v1/score (the same scores for 1:N or N:N text pairs), POST /v1/tokenize,
GET /v1/models, GET /v1/models/{id}, GET /health (process alive), GET /ready (a Tulip answers its
health check), GET /metrics.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import gc
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import numpy as np
import orjson
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.responses import Response

from ivy import errors
from ivy.balancer import Balancer
from ivy.config import IvyConfig
from ivy.errors import APIError, input_kind_error
from ivy.front import REQUEST_ID, Front, Stamp, _no_stamp
from ivy.schemas import EmbeddingRequest, RerankRequest, ScoreRequest, TokenizeRequest, schema
from ivy.templates import Templates
from ivy.tokenizer import TextTokenizer
from trellis.modeldir import ModelSpec, default_served_name, resolve_model_path
from trellis.tulip.v1 import tulip_pb2

log = logging.getLogger("ivy")


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("ivy_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry)
        self.latency = Histogram(
            "ivy_request_seconds", "embedding request latency", registry=self.registry,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
        )
        self.tokens = Counter("ivy_prompt_tokens", "tokens embedded", registry=self.registry)


INFO_WAIT_S = 5.0  # a request reaching a worker that has not heard from a replica yet waits this long, then 503
ROUTES = {"/v1/embeddings", "/v1/rerank", "/v2/rerank", "/v1/score", "/v1/tokenize", "/v1/models", "/health", "/ready", "/metrics", "/docs", "/openapi.json"}
ENCODINGS = {"float": tulip_pb2.ENCODING_FLOAT32, "base64": tulip_pb2.ENCODING_FLOAT32,
             "base64_int8": tulip_pb2.ENCODING_INT8, "base64_binary": tulip_pb2.ENCODING_BINARY}


def body(model) -> dict:
    """OpenAPI for a route that parses its raw body itself (errors.parse_body)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema(model)}}}}


class IvyAPI(FastAPI):
    """FastAPI with `front` (ivy.front.Front) in front of its middleware stack."""

    front: Front | None = None

    async def __call__(self, scope, receive, send):
        if self.front is None:
            return await super().__call__(scope, receive, send)
        await self.front(scope, receive, send)


def _raw(handler):
    """A fast handler as a FastAPI route (the same code; only reached without the front)."""
    async def route(request: Request):
        return Response(await handler(await request.body(), _no_stamp), media_type="application/json")

    return route


def pool_windows(vectors: np.ndarray, seqs: list[np.ndarray], windows: list[int], normalized: bool,
                 dims: int) -> np.ndarray:
    """truncate "chunk": per input the mean of its windows' vectors weighted by their token counts
    (special tokens included), L2-normalised again where the model normalises; then `dims`
    (Matryoshka, 0: all) as Tulip applies it: the first `dims` values, L2-normalised."""
    v = vectors.astype(np.float64)
    if len(windows) < len(seqs):
        w = np.array([len(s) for s in seqs], dtype=np.float64)
        starts = np.cumsum([0, *windows[:-1]])
        v = np.add.reduceat(v * w[:, None], starts, axis=0) / np.add.reduceat(w, starts)[:, None]
        if normalized:
            v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    if dims and dims < v.shape[1]:
        v = v[:, :dims]
        v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    return v.astype("<f4")


def create_app(cfg: IvyConfig) -> FastAPI:
    model_path = resolve_model_path(cfg.model)
    spec = ModelSpec.read(model_path)
    served = cfg.served_model_name or default_served_name(cfg.model, model_path)
    tokenizer = TextTokenizer(model_path, spec.max_seq_len, cfg.tokenize_offload_chars)
    templates = Templates(spec.prompts, Path(cfg.prompts_file) if cfg.prompts_file else None)
    # sentence-transformers' include_prompt: false (last-token pooling is not affected by it)
    pool_without_prompt = spec.pooling != "last" and not spec.include_prompt
    metrics = Metrics()
    created = int(time.time())
    balancer: Balancer  # gRPC channels must be made on the server's event loop: see lifespan

    @asynccontextmanager
    async def lifespan(app):
        nonlocal balancer
        balancer = Balancer(cfg.tulip, cfg.max_chunk_tokens, cfg.transport, cfg.tulip_spin_ms, cfg.resolve_interval)
        app.state.balancer = balancer
        balancer.start()
        gc.collect()
        gc.freeze()  # start-up objects live for the whole process: keep them out of collections
        yield
        await balancer.close()

    app = IvyAPI(title="Trellis Ivy", version="0.1.0", lifespan=lifespan)
    errors.install(app)

    async def model_info() -> tulip_pb2.InfoReply:
        info = await balancer.info(wait=INFO_WAIT_S)
        if info is None:
            raise APIError(503, "no inference server is reachable yet; retry shortly", None, "replica_unavailable")
        return info

    def model_card() -> dict:
        return {"id": served, "object": "model", "created": created, "owned_by": "trellis"}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if await balancer.ready():
            return {"status": "ready"}
        return errors.error_response(503, "no inference server answers its health check", None, "not_ready")

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        check_model(model_id)
        return model_card()

    async def embeddings(body: bytes, stamp: Stamp) -> bytes:
        t0 = time.perf_counter()
        req = errors.parse_body(EmbeddingRequest, body)
        stamp("decode")
        check_model(req.model)
        check_room()
        info = await model_info()
        if info.num_labels:
            raise APIError(400, f"'{served}' is a cross-encoder: it scores query-document pairs and returns no "
                           "embeddings; use POST /v1/rerank", "model", "model_not_embedding")
        stamp("checks")
        dims = 0
        if req.dimensions is not None:
            if not 1 <= req.dimensions <= info.embedding_dim:
                raise APIError(400, f"dimensions must be between 1 and {info.embedding_dim}, got {req.dimensions}", "dimensions")
            dims = req.dimensions
        encoding = ENCODINGS[req.encoding_format]
        if encoding not in info.encodings:
            raise APIError(400, f"encoding_format '{req.encoding_format}' is not supported by this model",
                           "encoding_format")
        outputs = tuple(o for o, asked in ((tulip_pb2.OUTPUT_SPARSE, req.return_sparse),
                                           (tulip_pb2.OUTPUT_COLBERT, req.return_colbert)) if asked)
        for o in outputs:
            if o not in info.outputs:
                name = "return_sparse" if o == tulip_pb2.OUTPUT_SPARSE else "return_colbert"
                raise APIError(400, f"'{name}' is not supported by this model (it has no such head)", name)
        chunked = req.mode == "chunk"
        if chunked and (outputs or encoding != tulip_pb2.ENCODING_FLOAT32):
            raise APIError(400, "truncate \"chunk\" pools float vectors: it takes encoding_format float or base64 "
                           "and no return_sparse / return_colbert", "truncate")
        stamp("checks")  # accumulates with the one above
        seqs, pool_from, windows = await _sequences(req, info, stamp)
        try:  # chunked windows come back whole: pooled, then Matryoshka-cut here
            result = await balancer.embed(seqs, 0 if chunked else dims, cfg.request_timeout_s, encoding, outputs,
                                          pool_from, stamp, request_id=REQUEST_ID.get())
        except grpc.aio.AioRpcError as e:
            raise errors.from_grpc(e) from None
        stamp("grpc")
        if chunked:
            result.vectors = pool_windows(result.vectors, seqs, windows, info.normalized, dims)
        tokens = int(sum(map(len, seqs)))
        b64 = req.encoding_format != "float"  # rows are already float32 LE, int8 or packed bits
        # float rows go to orjson as numpy views of the reply's bytes (no list, no copy); base64 ones
        # are encoded from those views
        data = [{"object": "embedding", "index": i, "embedding": base64.b64encode(v).decode() if b64 else v}
                for i, v in enumerate(result.vectors)]
        for item, (ids, weights) in zip(data, result.sparse):
            keys = [str(t) for t in ids.tolist()]
            item["sparse_embedding"] = dict(zip(keys, weights.tolist()))
            item["sparse_tokens"] = {k: tokenizer.token(int(k)) for k in keys}
        for item, vecs in zip(data, result.colbert):
            item["colbert_embedding"] = base64.b64encode(vecs.astype("<f4").tobytes()).decode() if b64 else vecs
        out = orjson.dumps({"object": "list", "data": data, "model": served,
                            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                           option=orjson.OPT_SERIALIZE_NUMPY)
        latency.observe(time.perf_counter() - t0)
        prompt_tokens.inc(tokens)
        stamp("encode")
        return out

    latency, prompt_tokens = metrics.latency, metrics.tokens

    def check_room() -> None:
        """A 429 at once, before any tokenizing, while every replica's queue is known to be full."""
        if balancer.full():
            raise APIError(429, "every inference server's queue is full; retry shortly", None, "overloaded")

    def check_model(model: str | None) -> None:
        if model is not None and model != served:
            raise APIError(404, f"model '{model}' does not exist; this server serves '{served}'", "model", "model_not_found")

    def check_count(n: int, param: str) -> None:
        if n > cfg.max_inputs:
            raise APIError(400, f"'{param}' has {n} items; at most {cfg.max_inputs} are accepted per request", param)

    def input_list(inp) -> list:
        """A request's 'input' as a non-empty list of at most max_inputs items."""
        inp = [inp] if isinstance(inp, str) else inp
        if not inp:
            raise APIError(400, "'input' must not be empty", "input")
        check_count(len(inp), "input")
        return inp

    async def rerank(body: bytes, stamp: Stamp) -> bytes:
        req = errors.parse_body(RerankRequest, body)
        check_model(req.model)
        check_room()
        if not req.documents:
            raise APIError(400, "'documents' must not be empty", "documents")
        check_count(len(req.documents) + 1, "documents")
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
            docs = await _offload(sum(map(len, docs)), tokenizer.cut, docs, req.max_tokens_per_doc)
        seqs, scores = await _scores(req.query, docs, req.truncate, req.raw_scores, req.instruction,
                                     ("query", None), ("documents", "document"), "document {} with the query")
        order = np.argsort(-scores, kind="stable")[: req.top_n]
        tokens = int(sum(len(s) for s in seqs))
        prompt_tokens.inc(tokens)
        results = [{"index": int(i), "relevance_score": float(scores[i]),
                    **({"document": {"text": req.documents[i]}} if req.return_documents else {})} for i in order]
        # Jina's reply (model, results, usage) and Cohere's (id, results, meta) in one
        return orjson.dumps({"id": f"rerank-{uuid.uuid4().hex}", "model": served, "results": results,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                             "meta": {"tokens": {"input_tokens": tokens, "output_tokens": 0}}})

    async def score(body: bytes, stamp: Stamp) -> bytes:
        """vLLM's score API: 1:N (text_1 one text) or N:N (pairwise) relevance scores."""
        req = errors.parse_body(ScoreRequest, body)
        check_model(req.model)
        check_room()
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
        check_count(len(t1) + len(t2), "text_2")
        one = t1[0] if len(t1) == 1 else t1
        seqs, scores = await _scores(
            one, t2, req.truncate, req.raw_scores, None,
            ("text_1", None if isinstance(req.text_1, str) else "text_1 item"),
            ("text_2", None if isinstance(req.text_2, str) else "text_2 item"),
            "pair {} (text_1, text_2)" if len(t1) > 1 else "text_2 item {} with text_1")
        tokens = int(sum(len(s) for s in seqs))
        prompt_tokens.inc(tokens)
        return orjson.dumps({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                             "model": served,
                             "data": [{"index": i, "object": "score", "score": float(v)} for i, v in enumerate(scores)],
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def _offload(chars: int, fn, *args):
        return fn(*args) if chars <= cfg.tokenize_offload_chars else await asyncio.to_thread(fn, *args)

    async def _scores(queries: str | list[str], documents: list[str], truncate: bool, raw_scores: bool,
                      instruction: str | None, query_names: tuple[str, str | None],
                      document_names: tuple[str, str | None], pair_item: str) -> tuple[list[np.ndarray], np.ndarray]:
        """Per document its score against the query (one for all, or one per document): a
        cross-encoder's score of the pair, or the cosine of a bi-encoder's embeddings. `*_names`:
        the request field and item label (None: one text) that length errors name."""
        info = await model_info()
        if info.num_labels:
            return await _pair_scores(queries, documents, truncate, raw_scores, instruction, info,
                                      document_names[0], pair_item)
        if raw_scores:
            raise APIError(400, "'raw_scores' applies to cross-encoders; this model scores by cosine similarity",
                           "raw_scores")
        return await _cosine_scores([queries] if isinstance(queries, str) else queries, documents, instruction,
                                    truncate, query_names, document_names)

    async def _cosine_scores(queries: list[str], documents: list[str], instruction: str | None, truncate: bool,
                             query_names: tuple[str, str | None], document_names: tuple[str, str | None]
                             ) -> tuple[list[np.ndarray], np.ndarray]:
        """A bi-encoder's scores: each document's cosine similarity to its query (or the one query),
        the queries with the model's query prompt, the documents with its document prompt, all in one
        request to Tulip."""
        q, q_pool = await _text_sequences(queries, "query", instruction, truncate, *query_names)
        d, d_pool = await _text_sequences(documents, "document", None, truncate, *document_names)
        pool_from = (q_pool or [0] * len(q)) + (d_pool or [0] * len(d)) if q_pool or d_pool else []
        seqs = q + d
        try:
            result = await balancer.embed(seqs, 0, cfg.request_timeout_s, tulip_pb2.ENCODING_FLOAT32, (), pool_from,
                                          request_id=REQUEST_ID.get())
        except grpc.aio.AioRpcError as e:
            raise errors.from_grpc(e) from None
        v = result.vectors.astype(np.float64)
        v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        return seqs, (v[len(q):] * v[: len(q)]).sum(1)  # one query row broadcasts over the documents

    async def _pair_scores(queries: str | list[str], documents: list[str], truncate: bool, raw_scores: bool,
                           instruction: str | None, info: tulip_pb2.InfoReply, param: str, pair_item: str
                           ) -> tuple[list[np.ndarray], np.ndarray]:
        """A cross-encoder's scores: each (query, document) pair scored together, as
        sentence-transformers' CrossEncoder.predict scores it (activated, or raw logits with raw_scores)."""
        if info.num_labels != 1:
            raise APIError(400, f"'{served}' gives {info.num_labels} scores per pair (a classifier); scoring "
                           "pairs needs one relevance score per pair", "model")
        if instruction is not None:
            raise APIError(400, "'instruction' applies to a bi-encoder's query prompt; this cross-encoder reads "
                           "the query and each document together, without one", "instruction")
        seqs, starts = await tokenizer.encode_pairs(queries, documents, truncate, param, pair_item)
        try:
            result = await balancer.embed(seqs, 0, cfg.request_timeout_s, tulip_pb2.ENCODING_FLOAT32,
                                          segment_starts=starts if any(starts) else (), raw_scores=raw_scores,
                                          request_id=REQUEST_ID.get())
        except grpc.aio.AioRpcError as e:
            raise errors.from_grpc(e) from None
        return seqs, result.scores[:, 0].astype(np.float64)

    async def tokenize(body: bytes, stamp: Stamp) -> bytes:
        req = errors.parse_body(TokenizeRequest, body)
        check_model(req.model)
        inp = input_list(req.input)
        seqs = await tokenizer.encode(templates.apply(inp, req.input_type, req.instruction), req.truncate,
                                      check_length=False)
        return orjson.dumps({"object": "list", "model": served, "max_model_len": tokenizer.max_len,
                             "data": [{"index": i, "tokens": s, "count": len(s)} for i, s in enumerate(seqs)]},
                            option=orjson.OPT_SERIALIZE_NUMPY)

    async def _text_sequences(texts: list[str], input_type: str | None, instruction: str | None,
                              truncate: bool, param: str = "input", item: str | None = "input",
                              stamp: Stamp = _no_stamp) -> tuple[list[np.ndarray], list[int]]:
        """Token ids of texts with the model's prompt for `input_type`, and per text the leading prompt
        tokens pooling leaves out (empty unless the model's pooling has include_prompt: false)."""
        prefix = templates.prefix(input_type, instruction)
        stamp("template")
        seqs = await tokenizer.encode([prefix + t for t in texts] if prefix else texts, truncate, param=param,
                                      item=item)
        stamp("tokenize")
        if prefix and pool_without_prompt:
            n = tokenizer.prompt_length(prefix)
            return seqs, [min(n, len(s) - 1) for s in seqs]
        return seqs, []

    async def _long_text_sequences(texts: list[str], mode: str, input_type: str | None, instruction: str | None,
                                   stamp: Stamp) -> tuple[list[np.ndarray], list[int], list[int]]:
        """truncate "start" / "chunk": each text encoded whole with its prompt, and one over the
        maximum cut to its last tokens (the prompt kept) or split into windows (the prompt in the
        first). Returns the sequences, their pool_from (as `_text_sequences`), windows per text."""
        prefix = templates.prefix(input_type, instruction)
        stamp("template")
        whole = await tokenizer.encode([prefix + t for t in texts] if prefix else texts, False, check_length=False)
        n_prompt = tokenizer.prompt_length(prefix) if prefix else 0
        keep = max(n_prompt - len(tokenizer.wrap[0]), 0) if prefix and tokenizer.wrap else 0
        seqs, pool_from, windows = [], [], []
        for s in whole:
            parts = [s] if len(s) <= tokenizer.max_len else tokenizer.windows(s, mode, keep)
            seqs += parts
            windows.append(len(parts))
            pool_from += [min(n_prompt, len(parts[0]) - 1)] + [0] * (len(parts) - 1)
        stamp("tokenize")
        return seqs, pool_from if prefix and pool_without_prompt else [], windows

    async def _sequences(req: EmbeddingRequest, info: tulip_pb2.InfoReply,
                         stamp: Stamp) -> tuple[list[np.ndarray], list[int], list[int]]:
        """Token-id arrays for the request's inputs, per sequence the leading prompt tokens mean
        pooling leaves out (empty unless the model's pooling has include_prompt: false), and per
        input how many sequences (windows) it became (all 1 unless truncate is "chunk")."""
        inp = input_list(req.input)
        kinds = set(map(type, inp))  # one kind per array (the decoder takes str, int or int arrays per item)
        if len(kinds) != 1:
            raise input_kind_error()
        mode = req.mode
        if str in kinds:
            for i, s in enumerate(inp):
                if not s:
                    raise APIError(400, f"input {i} is an empty string", "input")
            if mode in ("start", "chunk"):
                return await _long_text_sequences(inp, mode, req.input_type, req.instruction, stamp)
            seqs, pool_from = await _text_sequences(inp, req.input_type, req.instruction, mode == "end", stamp=stamp)
            return seqs, pool_from, [1] * len(seqs)
        if req.input_type is not None or req.instruction is not None:
            raise APIError(400, "'input_type' and 'instruction' apply to text inputs, not token ids", "input_type")
        if int in kinds:
            inp = [inp]
        seqs, windows, cap = [], [], info.max_seq_len
        for i, ids in enumerate(inp):
            if not ids:
                raise APIError(400, f"input {i} is an empty token array", "input")
            try:
                a = np.array(ids, dtype=np.int64)
                lo, hi = int(a.min()), int(a.max())
            except OverflowError:  # beyond int64: certainly outside any vocabulary
                lo = hi = max(ids, key=abs)
            if lo < 0 or hi >= info.vocab_size:
                raise APIError(400, f"input {i} has token id {lo if lo < 0 else hi}, outside the vocabulary [0, {info.vocab_size})", "input")
            a = a.astype(np.int32)
            if len(a) > cap:  # token ids are the caller's: cut as they are, no special tokens added
                if mode is None:
                    raise APIError(
                        400, f"input {i} has {len(a)} tokens, more than this model's maximum of {cap}; "
                        "shorten it or send \"truncate\": true", "input", "context_length_exceeded")
                parts = ([a[:cap]] if mode == "end" else [a[len(a) - cap:]] if mode == "start"
                         else [a[k: k + cap] for k in range(0, len(a), cap)])
            else:
                parts = [a]
            seqs += parts
            windows.append(len(parts))
        stamp("tokenize")
        return seqs, [], windows

    fast = {"/v1/embeddings": embeddings, "/v1/rerank": rerank, "/v2/rerank": rerank, "/v1/score": score,
            "/v1/tokenize": tokenize}
    models = (EmbeddingRequest, RerankRequest, RerankRequest, ScoreRequest, TokenizeRequest)
    for (path, handler), model in zip(fast.items(), models):
        name = "rerank_v2" if path == "/v2/rerank" else handler.__name__  # Cohere's path, the same handler
        app.post(path, openapi_extra=body(model), name=name)(_raw(handler))
    app.front = Front(functools.partial(FastAPI.__call__, app), fast, ROUTES, cfg.max_request_mb << 20,
                      metrics.requests, cfg.api_keys)
    return app


def create_app_from_env() -> FastAPI:
    """The server's factory for multi-worker runs: the config travels in IVY_CONFIG_JSON."""
    return create_app(IvyConfig.from_json(os.environ["IVY_CONFIG_JSON"]))
