"""Ivy's own access log, for `--log-format json` with `--access-log`: one record per HTTP request on
the `ivy.access` logger with the fields method, path, status, duration_ms, request_id and model
(uvicorn's access line has neither the request id, the model nor the duration). It wraps
`ivy.front.Front` from outside and is installed only then; in text mode the server's own access log
keeps its format. `JsonFormatter`: trellis.logs' with the request id of the request being handled on
every line logged while it is.
"""

from __future__ import annotations

import logging
import time

from ivy.front import CALL, REQUEST_ID, StatusWatch
from trellis import logs

log = logging.getLogger("ivy.access")


class JsonFormatter(logs.JsonFormatter):
    def fields(self) -> dict:
        rid = REQUEST_ID.get()
        return {"request_id": rid} if rid else {}


class AccessLog:
    """ASGI: `app` (Front), and one `ivy.access` record per HTTP request once it is answered (499: the
    client left before a reply was sent)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        watch = StatusWatch(send)
        try:
            await self.app(scope, receive, watch)
        finally:  # Front set the request id and the model in this task's context
            call = CALL.get()
            status = watch.status or 499
            ms = round((time.perf_counter() - t0) * 1e3, 3)
            log.info("%s %s %d %.3f ms", scope["method"], scope["path"], status, ms,
                     extra={"method": scope["method"], "path": scope["path"], "status": status, "duration_ms": ms,
                            "request_id": REQUEST_ID.get(), "model": call.model if call is not None else ""})
