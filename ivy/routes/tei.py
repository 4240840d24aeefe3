"""Hugging Face text-embeddings-inference's HTTP API (TEI), for callers written against it:
POST /embed, /embed_sparse, /rerank, /predict, /similarity, /tokenize, /decode, GET /info, and
POST / (and /invocations) taking what TEI's root takes for the model served (a cross-encoder:
rerank, or predict for one with several labels; SPLADE: sparse embeddings; a body with
similarity's `{"source_sentence", "sentences"}` inputs: similarity, as the Hub's sentence-similarity
task sends it; else embeddings), so that `huggingface_hub.InferenceClient` pointed at Ivy works.

The embedding and scoring routes do the work of the OpenAI-shaped ones (`embeddings.embed`,
`scores.ranked`), /tokenize and /decode the model's tokenizer.json's; each with TEI's body, reply and
errors (`ivy.errors.TEIError`: {"error", "error_type"}, 422 for what TEI calls invalid).
`model` (an extension) routes a request to a served model; absent, the default one.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json

import msgspec
import numpy as np
import orjson
from tokenizers import Tokenizer

from ivy import errors
from ivy.errors import APIError, TEIError
from ivy.front import Handler, Stamp
from ivy.routes.common import Context, Routes, tulip_call, verify
from ivy.routes.embeddings import embed
from ivy.routes.scores import ranked, unit
from ivy.schemas import (EmbeddingRequest, RerankRequest, SimilarityParameters, TEIDecodeRequest, TEIEmbedRequest,
                         TEIPredictRequest, TEIRerankRequest, TEISimilarityRequest, TEITokenizeRequest, lax_bool)
from ivy.served import ServedModel
from ivy.tokenizer import TextTokenizer
from ivy.tokenizer_long import SEGMENT_CHARS
from trellis.options import Options
from trellis.postprocess import matryoshka
from trellis.tulip.v1 import tulip_pb2


def _tei(ctx: Context, handler) -> Handler:
    """`handler(ctx, body, stamp)` bound to `ctx` as a route's `Handler(body, stamp)`, its errors in
    TEI's shape; its name and docstring kept (Routes.post names the route by it)."""
    @functools.wraps(handler)
    async def run(body: bytes, stamp: Stamp) -> bytes:
        try:
            return await handler(ctx, body, stamp)
        except TEIError:
            raise
        except APIError as e:
            raise TEIError(e) from None

    return run


def _truncation(truncate, direction: str):
    """TEI's `truncate` (absent: on, as TEI's --auto-truncate defaults) and `truncation_direction` as
    EmbeddingRequest's `truncate`: False, True (keep the first tokens) or "start" (keep the last)."""
    try:
        on = True if truncate is None else lax_bool(truncate)
    except ValueError as e:
        raise APIError(400, f"invalid value for 'truncate': {e}", "truncate") from None
    return ("start" if direction.lower() == "left" else True) if on else False


def _nonempty(inputs, param: str = "inputs") -> None:
    if not inputs:
        raise APIError(400, f"'{param}' must not be empty", param, "empty")


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@functools.cache
def _labels(config_path: str, num_labels: int) -> dict[str, str]:
    """A classifier's id2label from its config.json (transformers' LABEL_i where it names none)."""
    try:
        with open(config_path) as f:
            given = json.load(f).get("id2label")
    except (OSError, ValueError, AttributeError):
        given = None
    given = given if isinstance(given, dict) else {}
    return {str(i): str(given.get(str(i), f"LABEL_{i}")) for i in range(num_labels)}


def _token_rows(tokenizer: Tokenizer, text: str, base: int, add_special_tokens: bool) -> list[dict]:
    """TEI's token rows of `text`, its byte offsets shifted by `base`."""
    enc = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    at = None if text.isascii() else np.cumsum([0, *(len(c.encode()) for c in text)]).tolist()
    return [{"id": i, "text": tok, "special": True, "start": None, "stop": None} if special else
            {"id": i, "text": text[a:b], "special": False, "start": base + (a if at is None else at[a]),
             "stop": base + (b if at is None else at[b])}
            for i, (a, b), special, tok in zip(enc.ids, enc.offsets, enc.special_tokens_mask, enc.tokens)]


def _tokens(tok: TextTokenizer, add_special_tokens: bool, max_bytes: int, texts: list[str]) -> bytes:
    """/tokenize's reply for `texts` (with their prompts): TEI's tokens, offsets in bytes. A long text
    a segment at a time (ivy.tokenizer_long; a `tokenizers` Encoding and a dict per token cost
    hundreds of bytes a token), its rows serialized as they come; more tokens than
    --max-request-tokens, or a reply over `max_bytes` (--max-reply-mb), is a 413 as soon as it is."""
    out, size, tokens = [b"["], 1, 0
    wrap = tok.wrap if add_special_tokens else ([], [])
    for n, text in enumerate(texts):
        if tok.segmentable and wrap is not None and len(text) > SEGMENT_CHARS:
            pieces, base = [], 0
            for start, end in tok.segments(text):
                pieces.append((text[start:end], base))
                base += len(text[start:end].encode("utf-8", "surrogatepass"))
            groups = [[{"id": i, "text": tok.token(i), "special": True, "start": None, "stop": None}
                       for i in wrap[0]], *((seg, b, False) for seg, b in pieces),
                      [{"id": i, "text": tok.token(i), "special": True, "start": None, "stop": None} for i in wrap[1]]]
        else:
            groups = [(text, 0, add_special_tokens)]
        parts = []
        for g in groups:
            rows = _token_rows(tok.exact, *g) if isinstance(g, tuple) else g
            tokens += len(rows)
            if tokens > tok.max_request_tokens:
                raise tok.too_many_tokens()
            if rows:
                parts.append(orjson.dumps(rows)[1:-1])
                size += len(parts[-1]) + 1
            if size > max_bytes:
                raise APIError(413, f"the reply would be larger than {max_bytes >> 20} MiB (this server's "
                               "--max-reply-mb); send fewer or shorter texts", None, "reply_too_large")
        out += [b"," if n else b"", b"[", b",".join(parts), b"]"]
        size += 3
    out.append(b"]")
    return b"".join(out)


TEI_POOLING = {"last": "last_token"}  # Ivy's pooling names where TEI's differ


class _Peek(msgspec.Struct):
    """What POST / reads before it dispatches: the model and whether `inputs` is an object."""

    inputs: msgspec.Raw = msgspec.Raw(b"null")
    model: str | None = None


async def tei_embed(ctx: Context, body: bytes, stamp: Stamp) -> bytes:
    """POST /embed: one float vector per input, L2-normalised with `normalize` (the default)."""
    req = errors.parse_body(TEIEmbedRequest, body)
    _nonempty(req.inputs)
    model = ctx.models.get(req.model)
    info = await model.info()
    if not req.normalize and info.normalized:
        raise APIError(400, f"'{model.name}' normalises its embeddings (its sentence-transformers pipeline ends "
                       "in Normalize): normalize false is not available for it", "normalize")
    verify(Options(dimensions=req.dimensions), info)
    _, _, result, _ = await embed(ctx, EmbeddingRequest(
        input=req.inputs, model=req.model, truncate=_truncation(req.truncate, req.truncation_direction),
        prompt_name=req.prompt_name), stamp)
    # TEI's order: the Matryoshka cut, then the norm where asked (not re-normalised without `normalize`)
    v = matryoshka(result.vectors, req.dimensions, renormalize=False)
    if req.normalize and (req.dimensions is not None or not info.normalized):
        v = unit(v).astype(np.float32)
    return orjson.dumps(np.ascontiguousarray(v), option=orjson.OPT_SERIALIZE_NUMPY)  # orjson: C-ordered arrays

async def tei_embed_sparse(ctx: Context, body: bytes, stamp: Stamp) -> bytes:
    """POST /embed_sparse: per input its nonzero weights by token id, [{"index", "value"}] in id order
    (SPLADE's vocabulary weights, BGE-M3's lexical weights)."""
    req = errors.parse_body(TEIEmbedRequest, body)
    _nonempty(req.inputs)
    model = ctx.models.get(req.model)
    if tulip_pb2.OUTPUT_SPARSE not in (await model.info()).outputs:
        raise APIError(400, f"'{model.name}' has no sparse output (SPLADE's, or BGE-M3's sparse head); use "
                       "/embed", "model")
    _, _, result, _ = await embed(ctx, EmbeddingRequest(
        input=req.inputs, model=req.model, truncate=_truncation(req.truncate, req.truncation_direction),
        prompt_name=req.prompt_name, return_sparse=True), stamp)
    rows = []
    for ids, weights in result.sparse:
        order = np.argsort(ids, kind="stable")
        rows.append([{"index": i, "value": w} for i, w in zip(ids[order].tolist(), weights[order].tolist())
                     if w != 0])
    return orjson.dumps(rows)

async def tei_rerank(ctx: Context, body: bytes, stamp: Stamp) -> bytes:
    """POST /rerank: [{"index", "score"(, "text")}], best first, as /v1/rerank scores them."""
    req = errors.parse_body(TEIRerankRequest, body)
    _nonempty(req.texts, "texts")
    if len(req.texts) >= ctx.cfg.max_inputs:
        raise APIError(400, f"'texts' has {len(req.texts)} items; at most {ctx.cfg.max_inputs - 1} are accepted "
                       "(with the query, max_client_batch_size texts in all)", "texts")
    truncate = _truncation(req.truncate, req.truncation_direction)
    if truncate == "start":
        raise APIError(400, "truncation_direction 'left' is not available on /rerank: a pair over the maximum "
                       "is cut on its longer side's end, as sentence-transformers' CrossEncoder cuts it",
                       "truncation_direction")
    _, order, scores, _ = await ranked(ctx, RerankRequest(
        query=req.query, documents=req.texts, model=req.model, truncate=truncate, raw_scores=req.raw_scores))
    return orjson.dumps([{"index": int(i), "score": float(scores[i]),
                          **({"text": req.texts[i]} if req.return_text else {})} for i in order])

async def tei_predict(ctx: Context, body: bytes, stamp: Stamp) -> bytes:
    """POST /predict: per input every label with its score, best first ([{"score", "label"}]; a batch:
    one such list per input), as TEI scores them: softmax over several labels, the sigmoid of one."""
    req = errors.parse_body(TEIPredictRequest, body)
    _nonempty(req.inputs)
    one = isinstance(req.inputs, str) or all(isinstance(t, str) for t in req.inputs)
    items = [req.inputs] if one else req.inputs
    items = [[t] if isinstance(t, str) else t for t in items]
    ctx.check_count(len(items), "inputs")
    for i, t in enumerate(items):
        if not 1 <= len(t) <= 2 or not all(isinstance(x, str) and x for x in t):
            raise APIError(400, f"input {i} must be a text or a pair [text, text] of non-empty texts", "inputs")
    model = ctx.models.get(req.model)
    model.check_room()
    info = await model.info()
    if not info.num_labels:
        raise APIError(400, f"'{model.name}' is an embedding model: /predict needs a classifier (a "
                       "*ForSequenceClassification model); use /embed", "model")
    truncate = _truncation(req.truncate, req.truncation_direction)
    if truncate == "start":
        raise APIError(400, "truncation_direction 'left' is not available on /predict", "truncation_direction")
    tok = model.tokenizer
    pairs = [i for i, t in enumerate(items) if len(t) == 2]
    singles = [i for i, t in enumerate(items) if len(t) == 1]
    seqs: list = [None] * len(items)
    starts = [0] * len(items)
    if singles and tok.chat is not None:
        raise APIError(400, f"'{model.name}' scores (query, document) pairs through its chat template; input "
                       f"{singles[0]} is a single text: send pairs [text, text]", "inputs")
    if pairs:
        got, got_starts = await model.pair_sequences([items[i][0] for i in pairs], [items[i][1] for i in pairs],
                                                     truncate, "inputs", "pair {}")
        for i, s_, st in zip(pairs, got, got_starts):
            seqs[i], starts[i] = s_, st
    if singles:
        for i, s_ in zip(singles, await tok.encode([items[i][0] for i in singles], truncate, param="inputs")):
            seqs[i] = s_
    opts = ctx.options(segment_starts=starts if any(starts) else (), raw_scores=True)
    result = await tulip_call(model.balancer, seqs, opts)
    ctx.metrics.tokens.labels(model.name).inc(int(sum(map(len, seqs))))
    z = result.scores.astype(np.float64)
    if not req.raw_scores:
        z = 1 / (1 + np.exp(-z)) if z.shape[1] == 1 else _softmax(z)
    labels = _labels(str(model.path / "config.json"), info.num_labels)
    out = [[{"score": float(row[j]), "label": labels[str(j)]} for j in np.argsort(-row, kind="stable")]
           for row in z]
    return orjson.dumps(out[0] if one else out)

async def tei_similarity(ctx: Context, body: bytes, stamp: Stamp) -> bytes:
    """POST /similarity: the cosine of `source_sentence`'s embedding to each of `sentences`'."""
    req = errors.parse_body(TEISimilarityRequest, body)
    p = req.parameters or SimilarityParameters()
    _nonempty(req.inputs.sentences, "inputs.sentences")
    _, _, result, _ = await embed(ctx, EmbeddingRequest(
        input=[req.inputs.source_sentence, *req.inputs.sentences], model=req.model,
        truncate=_truncation(p.truncate, p.truncation_direction), prompt_name=p.prompt_name), stamp)
    v = unit(result.vectors)
    return orjson.dumps((v[1:] @ v[0]).tolist())

async def tei_tokenize(ctx: Context, body: bytes, stamp: Stamp) -> bytes:
    """POST /tokenize: per text its tokens, [{"id", "text", "special", "start", "stop"}] (start / stop:
    byte offsets in the text with its prompt; null for special tokens, whose text is the token's)."""
    req = errors.parse_body(TEITokenizeRequest, body)
    texts = [req.inputs] if isinstance(req.inputs, str) else req.inputs
    _nonempty(texts)
    if not all(texts):
        raise APIError(400, f"input {texts.index('')} is an empty string", "inputs", "empty")
    ctx.check_count(len(texts), "inputs")
    model = ctx.models.get(req.model)
    texts = model.templates.apply(texts, None, None, req.prompt_name)
    tokens = functools.partial(_tokens, model.tokenizer, req.add_special_tokens, ctx.cfg.max_reply_mb << 20)
    return await model.offload(sum(map(len, texts)), tokens, texts)

async def tei_decode(ctx: Context, body: bytes, stamp: Stamp) -> bytes:
    """POST /decode: one text per sequence of ids (one sequence, or an array of them)."""
    req = errors.parse_body(TEIDecodeRequest, body)
    _nonempty(req.ids, "ids")
    kinds = {type(i) for i in req.ids}
    if len(kinds) != 1:
        raise APIError(400, "'ids' must be token ids or an array of token-id arrays, not a mix", "ids")
    seqs = [req.ids] if int in kinds else req.ids
    ctx.check_count(len(seqs), "ids")
    model = ctx.models.get(req.model)
    vocab = model.spec.vocab_size
    for n, ids in enumerate(seqs):
        if not ids:
            raise APIError(400, f"ids {n} is empty", "ids", "empty")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= vocab:
            raise APIError(400, f"ids {n} has token id {lo if lo < 0 else hi}, outside the vocabulary "
                           f"[0, {vocab})", "ids")
    decode = functools.partial(model.tokenizer.exact.decode_batch, skip_special_tokens=req.skip_special_tokens)
    return orjson.dumps(await model.offload(sum(map(len, seqs)) * 4, decode, seqs))

async def tei_root(ctx: Context, body: bytes, stamp: Stamp) -> bytes:
    """POST /: what TEI's root serves for this model (see the module docstring)."""
    try:
        peek = msgspec.json.decode(body, type=_Peek)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return await tei_embed(ctx, body, stamp)  # its parse says what is wrong
    info = await ctx.models.get(peek.model).info()
    if info.num_labels:  # TEI: a reranker (one label) reranks, a classifier predicts
        return await (tei_rerank if info.num_labels == 1 else tei_predict)(ctx, body, stamp)
    if bytes(peek.inputs).startswith(b"{"):
        return await tei_similarity(ctx, body, stamp)
    if info.pooling == "splade":
        return await tei_embed_sparse(ctx, body, stamp)
    return await tei_embed(ctx, body, stamp)


async def tei_health():
    """TEI's public health routes (GET / and /ping): the process is up, as /health."""
    return {"status": "ok"}


async def tei_info(ctx: Context) -> dict:
    """GET /info's reply (`_info` of the default model), its errors in TEI's shape."""
    try:
        return await _info(ctx.models.default, ctx)
    except APIError as e:
        raise TEIError(e) from None


# TEI's POST routes: (path, handler, body schema for OpenAPI, route name where not the handler's)
_POSTS = (("/embed", tei_embed, TEIEmbedRequest, None),
          ("/embed_sparse", tei_embed_sparse, TEIEmbedRequest, None),
          ("/rerank", tei_rerank, TEIRerankRequest, None),
          ("/predict", tei_predict, TEIPredictRequest, None),
          ("/similarity", tei_similarity, TEISimilarityRequest, None),
          ("/tokenize", tei_tokenize, TEITokenizeRequest, None),
          ("/decode", tei_decode, TEIDecodeRequest, None),
          ("/", tei_root, TEIEmbedRequest, None),
          ("/invocations", tei_root, TEIEmbedRequest, "tei_invocations"))  # SageMaker's path


def routes(ctx: Context) -> Routes:
    """The handlers above bound to `ctx`, with TEI's errors (`_tei`)."""
    out = Routes()
    for path, handler, body_model, name in _POSTS:
        out.post(path, _tei(ctx, handler), body_model, name=name)
    out.router.get("/ping", name="tei_ping")(tei_health)
    out.router.get("/", name="tei_health")(tei_health)

    # a closure, not a partial: FastAPI takes an endpoint's parameters from its signature and its
    # OpenAPI description from its docstring (a partial's __doc__ is functools.partial's own)
    @out.router.get("/info", name="tei_info")
    async def info():
        """TEI's GET /info for the default model: its name, dtype, kind, limits."""
        return await tei_info(ctx)

    return out


async def _info(model: ServedModel, ctx: Context) -> dict:
    info = await model.info()
    if info.num_labels:
        id2label = _labels(str(model.path / "config.json"), info.num_labels)
        labels = {"id2label": id2label, "label2id": {v: int(k) for k, v in id2label.items()}}
        kind = {"reranker" if info.num_labels == 1 else "classifier": labels}
    else:
        kind = {"embedding": {"pooling": TEI_POOLING.get(info.pooling, info.pooling)}}
    return {"model_id": model.name, "model_sha": model.ref.revision or None,  # a Hub id's commit
            "model_dtype": info.dtype, "served_model_name": model.name,
            "model_type": kind, "max_concurrent_requests": None, "max_input_length": info.max_seq_len,
            "max_batch_tokens": info.max_batch_tokens, "max_batch_requests": None,
            "max_client_batch_size": ctx.cfg.max_inputs, "auto_truncate": True, "tokenization_workers": None,
            "version": _version(), "sha": None, "docker_label": None}


@functools.cache
def _version() -> str:
    try:
        return importlib.metadata.version("trellis")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
