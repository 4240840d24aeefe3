"""POST /v1/tokenize: the token ids a model sees for each input (its prompt applied), by `model`."""

from __future__ import annotations

import orjson

from ivy import errors
from ivy.errors import APIError
from ivy.front import Stamp
from ivy.routes.common import Context, Routes
from ivy.schemas import TokenizeRequest


def routes(ctx: Context) -> Routes:
    out = Routes()

    async def tokenize(body: bytes, stamp: Stamp) -> bytes:
        req = errors.parse_body(TokenizeRequest, body)
        model = ctx.models.get(req.model)
        inp = ctx.input_list(req.input)
        texts = model.templates.apply(inp, req.input_type, req.instruction, req.prompt_name)
        seqs = await model.tokenizer.encode(texts, req.truncate, check_length=False)
        reply = orjson.dumps({"object": "list", "model": model.name, "max_model_len": model.tokenizer.max_len,
                              "data": [{"index": i, "tokens": s, "count": len(s)} for i, s in enumerate(seqs)]},
                             option=orjson.OPT_SERIALIZE_NUMPY)
        if len(reply) > ctx.cfg.max_reply_mb << 20:  # ids as JSON: under 8 bytes a token (--max-request-tokens)
            raise APIError(413, f"the reply would be larger than {ctx.cfg.max_reply_mb} MiB (this server's "
                           "--max-reply-mb); send fewer or shorter inputs", None, "reply_too_large")
        return reply

    out.post("/v1/tokenize", tokenize, TokenizeRequest)
    return out
