"""GET /v1/models (every served model), /v1/models/{id}, /health (process alive), /ready (every
model's Tulips: one answers its health check), /metrics (Prometheus)."""

from __future__ import annotations

import asyncio

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from ivy import errors
from ivy.routes.common import Context, Routes


def routes(ctx: Context) -> Routes:
    out = Routes()
    models, r = ctx.models, out.router

    @r.get("/health")
    async def health():
        return {"status": "ok"}

    @r.get("/ready")
    async def ready():
        checks = await asyncio.gather(*(m.balancer.ready() for m in models.all))
        waiting = [m.name for m, ok in zip(models.all, checks) if not ok]
        if not waiting:  # a preset's random weights said here too: a deploy check reads this body
            random = [m.name for m in models.all if m.ref.random_weights]
            return {"status": "ready", **({"random_weights": random} if random else {})}
        return errors.error_response(503, "no inference server answers its health check for "
                                     + ", ".join(f"'{n}'" for n in waiting), None, "not_ready")

    @r.get("/metrics")
    async def prometheus():
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @r.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [m.card() for m in models.all]}

    @r.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        return models.get(model_id).card()

    return out
