"""POST /v1/embeddings (OpenAI's shape and Ivy's extensions), routed by `model`; long inputs
(`truncate` false / true / "end" / "start" / "chunk": windows embedded together, token-weighted
mean per input, `trellis.postprocess.pool_windows`). `embed` is the work of every route that embeds
(TEI's too); its options are `trellis.options.Options`, checked by `verify` before tokenizing."""

from __future__ import annotations

import base64
import time
from dataclasses import replace

import orjson

from ivy import errors
from ivy.errors import APIError
from ivy.front import Stamp, _no_stamp
from ivy.routes.common import Context, Routes, tulip_call, verify
from ivy.routes.images import embed_items, has_items
from ivy.schemas import EmbeddingRequest
from trellis.options import ENCODING_FORMATS, OUTPUT_PARAMS, Options
from trellis.postprocess import pool_windows
from trellis.tulip.v1 import tulip_pb2


async def embed(ctx: Context, req: EmbeddingRequest, stamp: Stamp = _no_stamp):
    """An embeddings request's checks, token sequences and Tulip call, whichever route took it:
    (the model, its Info, Tulip's result (chunked windows pooled into one row per input), the
    request's token count)."""
    if has_items(req.input):  # Jina's {"text"} / {"image"} items (ivy/routes/images.py; its texts come back here)
        return await embed_items(ctx, req, embed, stamp)
    model, info = await ctx.embedding_model(req.model, "/v1/rerank")
    stamp("checks")
    options = verify(Options(dimensions=req.dimensions, encoding=ENCODING_FORMATS[req.encoding_format],
                             outputs=tuple(o for o, param in OUTPUT_PARAMS.items() if getattr(req, param))), info)
    chunked = req.mode == "chunk"
    if chunked and (options.outputs or options.encoding != tulip_pb2.ENCODING_FLOAT32):
        raise APIError(400, "truncate \"chunk\" pools float vectors: it takes encoding_format float or base64 "
                       "and no return_sparse / return_colbert", "truncate")
    stamp("checks")  # accumulates with the one above
    seqs, pool_from, windows = await model.sequences(req, ctx.input_list(req.input), info, stamp)
    # chunked windows come back whole: pooled, then Matryoshka-cut here
    opts = ctx.options(options if not chunked else replace(options, dimensions=None), pool_from=pool_from,
                       priority=req.priority)
    result = await tulip_call(model.balancer, seqs, opts, stamp)
    stamp("grpc")
    if chunked:
        result.vectors = pool_windows(result.vectors, [len(s) for s in seqs], windows, info.normalized,
                                      options.dimensions)
    tokens = int(sum(map(len, seqs)))
    ctx.metrics.tokens.labels(model.name).inc(tokens)
    return model, info, result, tokens


def routes(ctx: Context) -> Routes:
    latency = ctx.metrics.latency
    out = Routes()

    async def embeddings(body: bytes, stamp: Stamp) -> bytes:
        t0 = time.perf_counter()
        req = errors.parse_body(EmbeddingRequest, body)
        stamp("decode")
        model, info, result, tokens = await embed(ctx, req, stamp)
        b64 = req.encoding_format != "float"  # rows are already float32 LE, int8 or packed bits
        # float rows go to orjson as numpy views of the reply's bytes (no list, no copy); base64 ones
        # are encoded from those views
        data = [{"object": "embedding", "index": i, "embedding": base64.b64encode(v).decode() if b64 else v}
                for i, v in enumerate(result.vectors)]
        tokenizer = model.tokenizer
        for item, (ids, weights) in zip(data, result.sparse):
            keys = [str(t) for t in ids.tolist()]
            item["sparse_embedding"] = dict(zip(keys, weights.tolist()))
            item["sparse_tokens"] = {k: tokenizer.token(int(k)) for k in keys}
        for item, vecs in zip(data, result.colbert):
            item["colbert_embedding"] = base64.b64encode(vecs.astype("<f4").tobytes()).decode() if b64 else vecs
        reply = orjson.dumps({"object": "list", "data": data, "model": model.name,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                             option=orjson.OPT_SERIALIZE_NUMPY)
        latency.labels(model.name).observe(time.perf_counter() - t0)
        stamp("encode")
        return reply

    out.post("/v1/embeddings", embeddings, EmbeddingRequest)
    return out
