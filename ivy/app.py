"""Ivy's FastAPI application: the OpenAI-compatible HTTP API in front of Tulip, for one or more
models (`ivy.served`), each routed by the request's `model` field.

The routes live in `ivy/routes/`, one module per group (embeddings; rerank, /v2/rerank and score;
tokenize; text-embeddings-inference's routes; models, health, ready, metrics); `ivy.front.Front`
sits in front of them all (API keys, body limits, request ids, request counts labelled by the
routes' own path templates, the hot POST routes from the raw body).
"""

from __future__ import annotations

import functools
import gc
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ivy import errors, images
from ivy.accesslog import AccessLog
from ivy.batches import BatchService
from ivy.batches import routes as batch_routes
from ivy.config import IvyConfig
from ivy.front import Front
from ivy.metrics import Metrics
from ivy.routes import cohere, embeddings, scores, service, tei, tokens
from ivy.routes.common import Context
from ivy.served import Models

__all__ = ["IvyAPI", "Metrics", "create_app", "create_app_from_env"]

ROUTE_MODULES = (embeddings, cohere, scores, tokens, tei, service)


class IvyAPI(FastAPI):
    """FastAPI with `front` (ivy.front.Front) in front of its middleware stack; `entry` is what the
    server calls: `front`, inside the tracing and access-log layers where those are on."""

    front: Front | None = None
    entry = None

    async def __call__(self, scope, receive, send):
        if self.entry is None:
            return await super().__call__(scope, receive, send)
        await self.entry(scope, receive, send)


def create_app(cfg: IvyConfig) -> FastAPI:
    models = Models(cfg)
    metrics = Metrics()
    metrics.watch_tokenizers(models)
    tracing = None
    if cfg.otlp_endpoint:  # imported only then: without it no OpenTelemetry SDK module is loaded
        from ivy.tracing import Tracing

        tracing = Tracing(cfg.otlp_endpoint)

    @asynccontextmanager
    async def lifespan(app):
        models.start()  # gRPC channels must be made on the server's event loop
        batches.start()  # the batch runner (with --batch-dir), on the same loop
        images.warm(m.path for m in models.all)  # the resampler's C built now, not at the first image
        if tracing is not None:
            tracing.instrument(models)
        gc.collect()
        gc.freeze()  # start-up objects live for the whole process: keep them out of collections
        yield
        await batches.close()
        await models.close()
        if tracing is not None:
            tracing.shutdown()

    app = IvyAPI(title="Trellis Ivy", version="0.1.0", lifespan=lifespan)
    app.state.models = models
    errors.install(app)
    ctx = Context(cfg, models, metrics)
    fast, paths = {}, [r.path for r in app.routes if hasattr(r, "path")]  # /docs, /openapi.json
    for module in ROUTE_MODULES:
        r = module.routes(ctx)
        app.include_router(r.router)
        fast.update(r.fast)
        paths += [route.path for route in r.router.routes]
    batches = BatchService(ctx, fast)  # /v1/files, /v1/batches: a job's lines run through `fast`'s handlers
    r = batch_routes.routes(batches)
    app.include_router(r.router)
    paths += [route.path for route in r.router.routes]
    app.front = app.entry = Front(functools.partial(FastAPI.__call__, app), fast, paths, cfg.max_request_mb << 20,
                                  metrics.requests, cfg.api_keys)
    app.front.body_limits = batches.body_limits()
    if tracing is not None:
        app.entry = tracing.asgi(app.entry, app.front.route)
    if cfg.access_log and cfg.log_format == "json":
        app.entry = AccessLog(app.entry)
    app.state.route_paths = paths
    return app


def create_app_from_env() -> FastAPI:
    """The server's factory for multi-worker runs: the config travels in IVY_CONFIG_JSON."""
    return create_app(IvyConfig.from_json(os.environ["IVY_CONFIG_JSON"]))
