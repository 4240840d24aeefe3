"""Image inputs on the embedding routes: `/v1/embeddings`' items in Jina's shape (`{"text": ...}`,
`{"image": ...}`, mixed in one request) and Cohere's `/v2/embed` images. Texts go through
`ivy.routes.embeddings.embed` as any text request (token ids, one Tulip request), images as uint8
pixels (`ivy.images`; a second Tulip request, `ImageOptions`); the rows come back in input order."""

from __future__ import annotations

import functools
import re
import time
import uuid
from dataclasses import dataclass, field
from dataclasses import replace as dc_replace

import msgspec
import numpy as np
import orjson

from ivy import imagefetch
from ivy.errors import APIError, input_kind_error
from ivy.front import Stamp, _no_stamp
from ivy.images import Limits, Meta, Preprocessor, all_or_none, load_all, preprocessor
from ivy.routes.common import Context, tulip_call, verify
from ivy.schemas import EmbeddingRequest, InputItem
from ivy.served import ServedModel
from trellis.client import EmbedOptions, EmbedResult
from trellis.options import ENCODING_FORMATS, Options
from trellis.tulip.v1 import tulip_pb2


@dataclass(frozen=True)
class ImageOptions(EmbedOptions):
    """An image request's EmbedOptions: its pixels (uint8 [images, side, side, 3]) travel in the message's
    `pixels` / `images` instead of token ids. The balancer chunks it as any request (its "sequences" are
    placeholders as long as an image's patch tokens, `placeholders`), so `part` cuts the pixels too; the client
    sends a chunk's pixels from the request's array (`message`), as trellis.client's own image calls do."""

    pixels: np.ndarray | None = field(default=None, compare=False)

    def part(self, a: int, b: int, k: int) -> "ImageOptions":
        return dc_replace(super().part(a, b, k), pixels=self.pixels[a:b])

    def request(self, seqs) -> tulip_pb2.EmbedRequest:
        return self.image_request(self.pixels)  # the options, request id and priority as any request's

    def message(self, seqs) -> tuple[tulip_pb2.EmbedRequest, np.ndarray]:
        """The message without its pixels, and the pixels (C-contiguous: a chunk is a slice of the request's
        array along its first axis): the stream sends them from this array, not copied into the message
        (the unary transport copies them in)."""
        return self.image_head(self.pixels)


def placeholders(n: int, tokens: int) -> list[np.ndarray]:
    """n zero-cost stand-ins of `tokens` entries each: what the balancer counts an image as."""
    return [_placeholder(tokens)] * n


@functools.lru_cache(maxsize=8)
def _placeholder(tokens: int) -> np.ndarray:
    """One image's stand-in (read-only: a broadcast view), made once per token count, not per request."""
    return np.broadcast_to(np.zeros(1, np.int32), (tokens,))


def image_preprocessor(model: ServedModel, info: tulip_pb2.InfoReply) -> Preprocessor:
    """The model's preprocessing, or the error that says why it takes no images."""
    if not info.image_size:
        raise APIError(400, f"model '{model.name}' does not take images (it has no image tower)", "input",
                       "model_not_image")
    try:
        prep = preprocessor(model.path)
    except ValueError as e:
        raise APIError(503, f"model '{model.name}' is misconfigured: {e}", "model", "model_mismatch") from None
    if prep is None or prep.side != info.image_size:
        raise APIError(503, f"model '{model.name}' is misconfigured: its Tulips take {info.image_size}-pixel "
                       f"images, its directory {model.path} " + (f"makes {prep.side}" if prep else
                                                                 "has no preprocessor_config.json"),
                       "model", "model_mismatch")
    return prep


async def embed_images(ctx: Context, model: ServedModel, info: tulip_pb2.InfoReply, sources: list[str],
                       labels: list[str], options: Options, priority: str | None = None,
                       stamp: Stamp = _no_stamp) -> tuple[EmbedResult, int, list[Meta]]:
    """Images (data URIs, base64 or allowed URLs) embedded as `options` (verified) ask: Tulip's result, the
    images' patch tokens, and what each image was. `labels` name each input in errors."""
    prep = image_preprocessor(model, info)
    cfg = ctx.cfg
    if len(sources) > cfg.max_images:
        raise APIError(400, f"the request has {len(sources)} images; at most {cfg.max_images} are accepted per "
                       "request (--max-images)", "input")
    limits = Limits(cfg.max_image_mb << 20, cfg.max_image_pixels)

    def fetch(url: str, label: str):
        return imagefetch.fetch(url, label, cfg.image_urls, limits.max_bytes, cfg.image_url_timeout_s)

    pixels, metas = await load_all(sources, labels, limits, prep, fetch)
    stamp("decode_images")
    opts = ctx.options(options, priority, ImageOptions, pixels=pixels)
    result = await tulip_call(model.balancer, placeholders(len(sources), prep.tokens), opts, stamp)
    stamp("grpc")
    tokens = len(sources) * prep.tokens
    ctx.metrics.tokens.labels(model.name).inc(tokens)
    return result, tokens, metas


def has_items(inp) -> bool:
    """Whether /v1/embeddings' `input` holds Jina's {"text"} / {"image"} items."""
    return type(inp) is list and any(type(x) is InputItem for x in inp)


_INPUT_INDEX = re.compile(r"\binput (\d+)\b")


@dataclass
class Mixed:
    """What `embed_mixed` returns: the rows in input order, the texts' tokens, the images' patch tokens and
    what each image was."""

    result: EmbedResult
    text_tokens: int = 0
    image_tokens: int = 0
    images: list[Meta] = field(default_factory=list)


async def embed_mixed(ctx: Context, model: ServedModel, info: tulip_pb2.InfoReply, n: int,
                      texts: list[tuple[int, str]], images: list[tuple[int, str]], text_req: EmbeddingRequest,
                      embed, options: Options, name: str = "input", stamp: Stamp = _no_stamp) -> Mixed:
    """`n` inputs, `texts` and `images` as (input index, text or image source): the texts as one text request
    (`text_req` with them as its input, through `embed`: ivy.routes.embeddings'), the images as one image
    request, both at once; a failure of either cancels the other. Errors name an input as `name`[i]."""
    async def text_part():
        sub = msgspec.structs.replace(text_req, input=[t for _, t in texts])
        try:
            _, _, result, tokens = await embed(ctx, sub, stamp)
        except APIError as e:  # its messages number the texts among themselves: name them as the request does
            e.message = _INPUT_INDEX.sub(lambda m: f"{name}[{texts[int(m.group(1))][0]}]", e.message, count=1)
            e.param = name if e.param == "input" else e.param
            raise
        return Mixed(result, text_tokens=tokens)

    async def image_part():
        labels = [f"{name}[{i}]" for i, _ in images]
        try:
            result, tokens, metas = await embed_images(ctx, model, info, [s for _, s in images], labels, options,
                                                       getattr(text_req, "priority", None), stamp)
        except APIError as e:
            e.param = name if e.param == "input" else e.param
            raise
        return Mixed(result, image_tokens=tokens, images=metas)

    parts = [(idx, make) for idx, make in ((texts, text_part), (images, image_part)) if idx]
    outs = await all_or_none([make() for _, make in parts])
    if len(outs) == 1:
        return outs[0]
    rows = [o.result.vectors for o in outs]
    vectors = np.empty((n, rows[0].shape[1]), rows[0].dtype)
    for (idx, _), v in zip(parts, rows):
        vectors[[i for i, _ in idx]] = v
    return Mixed(EmbedResult(vectors), sum(o.text_tokens for o in outs), sum(o.image_tokens for o in outs),
                 [m for o in outs for m in o.images])


async def embed_items(ctx: Context, req: EmbeddingRequest, embed, stamp: Stamp = _no_stamp):
    """/v1/embeddings with Jina's items (strings count as text items): `embed_mixed`; returns what `embed`
    returns, rows in input order, the texts' and images' tokens together."""
    model = ctx.models.get(req.model)
    model.check_room()
    info = await model.info()
    inp = ctx.input_list(req.input)
    texts, images = [], []  # (input index, text or image source)
    for i, x in enumerate(inp):
        if type(x) is str:
            texts.append((i, x))
        elif type(x) is InputItem:
            if (x.text is None) == (x.image is None):
                raise APIError(400, f"input[{i}]: an item holds one of 'text' or 'image'", "input")
            (texts if x.text is not None else images).append((i, x.text if x.text is not None else x.image))
        else:
            raise input_kind_error(EmbeddingRequest.input_kinds)
    if images and (req.return_sparse or req.return_colbert):
        raise APIError(400, "return_sparse and return_colbert apply to texts; this request has images",
                       "return_sparse" if req.return_sparse else "return_colbert")
    options = verify(Options(dimensions=req.dimensions, encoding=ENCODING_FORMATS[req.encoding_format]), info)
    stamp("checks")
    out = await embed_mixed(ctx, model, info, len(inp), texts, images, req, embed, options, "input", stamp)
    return model, info, out.result, out.text_tokens + out.image_tokens


async def image_scores(ctx: Context, req, embed, stamp: Stamp = _no_stamp) -> bytes:
    """vLLM's /v1/score with Jina's items in text_2 (`ScoreRequest`): the cosine of each text_2 item's embedding
    (a text with the model's document prompt, or an image) to text_1's (one text for all: 1:N; one per item:
    N:N, with the query prompt), as the text-only route scores a bi-encoder's texts. `embed`: the texts' route
    (ivy.routes.embeddings.embed, which imports this module: passed in, not imported)."""
    model = ctx.models.get(req.model)
    model.check_room()
    info = await model.info()
    if req.weights is not None or req.raw_scores:
        raise APIError(400, "'weights' and 'raw_scores' score texts; this request has images",
                       "weights" if req.weights is not None else "raw_scores")
    t1 = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    t2 = req.text_2
    if not t1 or any(not t for t in t1):
        raise APIError(400, "'text_1' must hold non-empty texts", "text_1")
    if len(t1) not in (1, len(t2)):
        raise APIError(400, f"'text_1' has {len(t1)} texts and 'text_2' has {len(t2)}: send one text_1 to score "
                       "against every text_2 (1:N), or as many as text_2 to score pairwise (N:N)", "text_1")
    ctx.check_count(len(t1) + len(t2), "text_2")
    texts, images = [], []
    for i, x in enumerate(t2):
        if type(x) is InputItem and (x.text is None) == (x.image is None):
            raise APIError(400, f"text_2[{i}]: an item holds one of 'text' or 'image'", "text_2")
        if type(x) is str or x.text is not None:
            texts.append((i, x if type(x) is str else x.text))
        else:
            images.append((i, x.image))
    options = Options()
    q_req = EmbeddingRequest(input=[], model=req.model, truncate=req.truncate, input_type="query",
                             priority=req.priority)
    d_req = msgspec.structs.replace(q_req, input_type="document")
    q, d = await all_or_none([
        embed_mixed(ctx, model, info, len(t1), list(enumerate(t1)), [], q_req, embed, options, "text_1", stamp),
        embed_mixed(ctx, model, info, len(t2), texts, images, d_req, embed, options, "text_2", stamp)])
    unit = [v.astype(np.float64) / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
            for v in (q.result.vectors, d.result.vectors)]
    scores = (unit[1] * unit[0]).sum(1)  # one text_1 row broadcasts over text_2
    tokens = q.text_tokens + d.text_tokens + d.image_tokens
    return orjson.dumps({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": model.name,
                         "data": [{"index": i, "object": "score", "score": float(v)} for i, v in enumerate(scores)],
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
