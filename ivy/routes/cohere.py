"""Cohere's POST /v2/embed: `texts`, `images` (data URIs) or `inputs` (content parts; one part each: a
text or an image, as a CLIP / SigLIP model embeds them), `input_type` (the model's prompts), `truncate`,
`output_dimension`, and every `embedding_types` asked in one reply: float, int8 / uint8 (where the model
has an int8 quantizer: its round(tanh(x) * 127), uint8 that plus 128), binary / ubinary (the sign bits
x >= 0 packed most significant bit first: ubinary as bytes, binary as those bytes minus 128, as
sentence-transformers' quantize_embeddings writes them), all from one float32 request to Tulip."""

from __future__ import annotations

import uuid
from typing import Literal, Union

import msgspec
import numpy as np
import orjson

from ivy import errors
from ivy.errors import APIError
from ivy.front import Stamp
from ivy.routes.common import Context, Routes, verify
from ivy.routes.embeddings import embed
from ivy.routes.images import embed_mixed
from ivy.schemas import Body, EmbeddingRequest
from trellis.options import Options
from trellis.postprocess import dense, encode
from trellis.tulip.v1 import tulip_pb2

EMBEDDING_TYPES = ("float", "int8", "uint8", "binary", "ubinary")
# input_type -> (EmbeddingRequest.input_type, or the prompt_name used where the model has a prompt of that name)
INPUT_TYPES = {"search_query": ("query", None), "search_document": ("document", None),
               "classification": (None, "classification"), "clustering": (None, "clustering"), "image": (None, None)}
TRUNCATE = {"NONE": False, "END": "end", "START": "start"}


class ImageURL(msgspec.Struct):
    url: str


class Content(msgspec.Struct):
    """A content part: {"type": "text", "text": ...} or {"type": "image_url", "image_url": {"url": ...}}."""

    type: Literal["text", "image_url"]
    text: Union[str, None] = None
    image_url: Union[ImageURL, None] = None


class CohereInput(msgspec.Struct):
    content: list[Content]


class CohereEmbedRequest(Body):
    """POST /v2/embed, as Cohere's API v2 takes it: one of `texts`, `images` (data URIs; base64 and allowed
    http(s) URLs too) or `inputs` (each one content part, a text or an image_url); `model` (absent: the
    default model); `input_type` search_query / search_document (the model's query / document prompts),
    classification / clustering (its prompt of that name, where it has one), image; `embedding_types` (default
    ["float"]); `output_dimension` (Matryoshka, as /v1/embeddings' dimensions); `truncate` NONE (a longer text
    is a 400) / END (the default: keep its first tokens) / START (its last)."""

    model: Union[str, None] = None
    texts: Union[list[str], None] = None
    images: Union[list[str], None] = None
    inputs: Union[list[CohereInput], None] = None
    input_type: Union[Literal["search_document", "search_query", "classification", "clustering", "image"], None] = None
    embedding_types: Union[list[Literal["float", "int8", "uint8", "binary", "ubinary"]], None] = None
    output_dimension: Union[int, None] = None
    truncate: Literal["NONE", "START", "END"] = "END"


def _items(req: CohereEmbedRequest) -> tuple[str, list[tuple[int, str]], list[tuple[int, str]], int]:
    """(the field the inputs came in, texts, images as (index, value), how many)."""
    given = [(name, v) for name, v in (("texts", req.texts), ("images", req.images), ("inputs", req.inputs))
             if v is not None]
    if len(given) != 1:
        raise APIError(400, "send one of 'texts', 'images' and 'inputs'", given[1][0] if given else "texts")
    name, values = given[0]
    if not values:
        raise APIError(400, f"'{name}' must not be empty", name)
    if name == "texts":
        return name, list(enumerate(values)), [], len(values)
    if name == "images":
        return name, [], list(enumerate(values)), len(values)
    texts, images = [], []
    for i, inp in enumerate(values):
        if len(inp.content) != 1:
            raise APIError(400, f"inputs[{i}] has {len(inp.content)} content parts; this server embeds one text or "
                           "one image per input (a CLIP / SigLIP model embeds them apart, it does not fuse them)",
                           "inputs")
        part = inp.content[0]
        value = part.text if part.type == "text" else part.image_url.url if part.image_url else None
        if value is None:
            raise APIError(400, f"inputs[{i}]: a {part.type} part needs its '{part.type}' field", "inputs")
        (texts if part.type == "text" else images).append((i, value))
    return name, texts, images, len(values)


def by_type(vectors: np.ndarray, types: list[str], dims: int | None) -> dict[str, np.ndarray]:
    """Float32 rows as each of Cohere's embedding types (see the module docstring), cut to `dims` as
    /v1/embeddings cuts them (float: re-normalised; the codes: of the full vector's first values)."""
    out = {}
    for t in types:
        if t == "float":
            out[t] = dense(vectors, Options(dimensions=dims))
        elif t in ("int8", "uint8"):
            v = dense(vectors, Options(dimensions=dims, encoding=tulip_pb2.ENCODING_INT8))
            codes = np.frombuffer(encode(v, tulip_pb2.ENCODING_INT8), np.int8).reshape(v.shape)
            out[t] = codes if t == "int8" else (codes.astype(np.int16) + 128).astype(np.uint8)
        else:
            v = dense(vectors, Options(dimensions=dims, encoding=tulip_pb2.ENCODING_BINARY))
            bits = np.packbits(v >= 0, axis=1)
            out[t] = bits if t == "ubinary" else (bits.astype(np.int16) - 128).astype(np.int8)
    return out


def routes(ctx: Context) -> Routes:
    out = Routes()

    async def embed_v2(body: bytes, stamp: Stamp) -> bytes:
        req = errors.parse_body(CohereEmbedRequest, body)
        name, texts, images, n = _items(req)
        ctx.check_count(n, name)
        types = list(dict.fromkeys(req.embedding_types or ["float"]))
        model, info = await ctx.embedding_model(req.model, "/v2/rerank")
        if {"int8", "uint8"} & set(types) and tulip_pb2.ENCODING_INT8 not in info.encodings:
            raise APIError(400, f"embedding_types int8 and uint8 are the model's int8 quantizer's codes; "
                           f"'{model.name}' has none (it offers float, binary, ubinary)", "embedding_types")
        try:
            verify(Options(dimensions=req.output_dimension), info)
        except APIError as e:
            e.param, e.message = "output_dimension", e.message.replace("dimensions", "output_dimension")
            raise
        input_type, prompt_name = INPUT_TYPES[req.input_type] if req.input_type else (None, None)
        if prompt_name is not None and prompt_name not in model.templates.prompts():
            prompt_name = None  # a model without that prompt embeds the text as it is
        text_req = EmbeddingRequest(input=[], model=req.model, truncate=TRUNCATE[req.truncate],
                                    input_type=input_type, prompt_name=prompt_name)
        mixed = await embed_mixed(ctx, model, info, n, texts, images, text_req, embed, Options(), name, stamp)
        rows = by_type(mixed.result.vectors, types, req.output_dimension)
        reply = {"id": str(uuid.uuid4()), "embeddings": rows, "texts": [t for _, t in texts],
                 "meta": {"api_version": {"version": "2"},
                          "billed_units": {"input_tokens": mixed.text_tokens, "images": len(images)}},
                 "response_type": "embeddings_by_type"}
        if images:
            reply["images"] = [{"width": m.width, "height": m.height, "format": m.format, "bit_depth": m.bit_depth}
                               for m in mixed.images]
        return orjson.dumps(reply, option=orjson.OPT_SERIALIZE_NUMPY)

    out.post("/v2/embed", embed_v2, CohereEmbedRequest)
    return out
