"""What every route module shares: the `Context` routes are built from, the `Routes` a module
hands the app (a FastAPI router and the hot POST handlers `ivy.front.Front` answers itself),
the request checks and error mapping more than one route uses, and a request's priority class
(`request_priority`: its body's `priority` field, else its `X-Trellis-Priority` header, else online)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
from fastapi import APIRouter, Request
from starlette.responses import Response

from ivy import errors
from ivy.config import IvyConfig
from ivy.errors import APIError
from ivy.front import CALL, REQUEST_ID, WATCH_TOKENS, Handler, Stamp, _no_stamp, watch_disconnect
from ivy.metrics import Metrics
from ivy.schemas import schema
from ivy.served import Models
from trellis import options as request_options
from trellis.client import EmbedOptions
from trellis.tulip.v1 import tulip_pb2

# A request's scheduling class by name (the body's `priority`, the X-Trellis-Priority header): Tulip serves
# queued online work first at every step and gives batch work the token budget online work leaves
PRIORITIES = {"online": tulip_pb2.PRIORITY_ONLINE, "batch": tulip_pb2.PRIORITY_BATCH}
PRIORITY_HEADER = b"x-trellis-priority"  # (ASGI header names are lower case)


def request_priority(body: str | None = None) -> int:
    """The request's tulip_pb2.PRIORITY_*: its body's `priority` field where it has one (the schema has
    checked it), else its X-Trellis-Priority header (online or batch, any case), else online. A header
    with another value is a 400 naming it."""
    if body is not None:
        return PRIORITIES[body]
    call = CALL.get()
    for k, v in call.headers if call is not None else ():
        if k == PRIORITY_HEADER:
            p = PRIORITIES.get(v.decode("latin-1").strip().lower())
            if p is None:
                raise APIError(400, f"X-Trellis-Priority must be 'online' or 'batch', not "
                               f"{v.decode('latin-1')[:64]!r}", "X-Trellis-Priority")
            return p
    return tulip_pb2.PRIORITY_ONLINE


@dataclass
class Context:
    """What a route module needs: the settings, the served models, the metrics."""

    cfg: IvyConfig
    models: Models
    metrics: Metrics

    def options(self, base: request_options.Options | None = None, priority: str | None = None,
                kind: type[EmbedOptions] = EmbedOptions, **fields) -> EmbedOptions:
        """The request's EmbedOptions (or its subclass `kind`, e.g. ImageOptions): the options of `base`
        (verified ones, `verify`) with `fields`, its request id, its deadline (--request-timeout-s from
        now: every chunk and retry must be answered by then) and its priority class (`request_priority`;
        `priority`: the body's field)."""
        if base is not None:
            fields = {**{name: getattr(base, name) for name in request_options.NAMES}, **fields}
        return kind(**fields, request_id=REQUEST_ID.get(),
                            deadline=time.monotonic() + self.cfg.request_timeout_s,
                            priority=request_priority(priority))

    async def embedding_model(self, name: str | None, rerank_path: str):
        """(the served model `name`, its Info) for an embeddings route, with room for the request; a
        cross-encoder is a 400 pointing at `rerank_path`."""
        model = self.models.get(name)
        model.check_room()
        info = await model.info()
        if info.num_labels:
            raise APIError(400, f"'{model.name}' is a cross-encoder: it scores query-document pairs and returns no "
                           f"embeddings; use POST {rerank_path}", "model", "model_not_embedding")
        return model, info

    def check_count(self, n: int, param: str) -> None:
        if n > self.cfg.max_inputs:
            raise APIError(400, f"'{param}' has {n} items; at most {self.cfg.max_inputs} are accepted per request",
                           param)

    def input_list(self, inp) -> list:
        """A request's 'input' as a non-empty list of at most max_inputs items."""
        inp = [inp] if isinstance(inp, str) else inp
        if not inp:
            raise APIError(400, "'input' must not be empty", "input")
        self.check_count(len(inp), "input")
        return inp


@dataclass
class Routes:
    """A route module's routes: `router` for FastAPI (OpenAPI, /docs and the plain ASGI path),
    `fast` {path: handler(body, stamp) -> JSON bytes} for Front's hot path."""

    router: APIRouter = field(default_factory=APIRouter)
    fast: dict[str, Handler] = field(default_factory=dict)

    def post(self, path: str, handler: Handler, body_model, name: str | None = None) -> None:
        """A hot POST route: answered by Front from the raw body, and registered with FastAPI (its
        OpenAPI body from `body_model`) to run the same handler where Front is not in front."""
        async def route(request: Request):
            return Response(await handler(await request.body(), _no_stamp), media_type="application/json")

        self.router.post(path, name=name or handler.__name__, openapi_extra={"requestBody": {
            "required": True, "content": {"application/json": {"schema": schema(body_model)}}}})(route)
        self.fast[path] = handler


def verify(options: request_options.Options, info) -> request_options.Options:
    """`trellis.options.verify` before any tokenizing: an option the model cannot honour is a 400 naming
    the HTTP field (`OptionError.param`), with the message Tulip would give."""
    try:
        request_options.verify(options, info)
    except request_options.OptionError as e:
        raise APIError(400, e.message, e.param) from None
    return options


async def tulip_call(balancer, seqs: list, opts: EmbedOptions, stamp: Stamp | None = None):
    """`balancer.embed`'s result for `seqs`, a Tulip's gRPC error as the caller's APIError. Work of
    more than WATCH_TOKENS tokens is cancelled if its client disconnects, whatever its body's size."""
    if sum(map(len, seqs)) > WATCH_TOKENS and watch_disconnect():
        await asyncio.sleep(0)  # the watch's first look: a client already gone sends nothing to Tulip
    try:
        return await balancer.embed(seqs, opts, stamp)
    except grpc.aio.AioRpcError as e:
        raise errors.from_grpc(e) from None
