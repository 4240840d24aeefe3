"""Ivy's outermost ASGI layer: API keys, body limits and request counts for every route, and the
hot POST routes (/v1/embeddings, /v1/rerank, /v2/rerank, /v1/score, /v1/tokenize, and
text-embeddings-inference's POST routes, ivy/routes/tei.py) answered from the raw body before
FastAPI's middleware stack, router and Request objects (their FastAPI routes stay registered, so
OpenAPI and /docs describe them, and they run the same handler). Everything else goes to FastAPI.

A fast handler takes (body bytes, stamp) and returns the JSON bytes of a 200, or raises APIError;
the response goes out as one start and one body message. With IVY_STAGES=PATH set, every fast
request's stage durations (stamp(name) marks the end of a stage) are kept and written to PATH as
JSON lines (microseconds) when the worker shuts down: `benchmarks.gateway --stages` reads them.

Every request has an id: the caller's `x-request-id` header where it is 1 to 128 printable ASCII
characters, else a fresh one (32 hex digits). It is echoed in every reply's `x-request-id` header
(errors included), held in `REQUEST_ID` while the request is handled (the handlers send it to
Tulip as the EmbedRequest's request_id) and named in Ivy's log lines about the request.

Request counts are labelled with the route (the path template of the app's route that serves the
path, "other" for none), the status and the model the request was routed to ("" where it names
none or an unknown one): `CALL` holds the request's `Call` while it is handled, and routing a
request to a model (`ivy.served.Models.get`) sets its `model`.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import logging
import os
import re
import time
from typing import Awaitable, Callable, Iterable

import orjson
from starlette.routing import compile_path

from ivy.errors import RETRY_AFTER, APIError, error_body

log = logging.getLogger("ivy")

Stamp = Callable[[str], None]
Handler = Callable[[bytes, Stamp], Awaitable[bytes]]
JSON_HEADERS = [(b"content-type", b"application/json")]
OPEN_PATHS = frozenset(("/health", "/ready", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json",
                        "/ping"))  # and GET / (TEI's health routes; POST / needs a key): `Front.authorized`
MAX_STAGE_RECORDS = 200_000
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
_GOOD_ID = re.compile(rb"[\x20-\x7e]{1,128}")


class Call:
    """What the metrics say of the request being handled (the model it was routed to), its
    disconnect watch (`watch_disconnect`), its ASGI headers (a route reads one it needs, as
    `X-Trellis-Priority`, when it needs it: ivy.routes.common) and the API key it authenticated
    with (`api_key`: one of --api-keys, set by `Front.authorized`; None without --api-keys or on
    an open path). The Batch API's files and batches belong to that key (ivy.batches.service)."""

    __slots__ = ("model", "receive", "watcher", "gone", "headers", "api_key")

    def __init__(self, headers=()):
        self.headers = headers
        self.api_key: str | None = None
        self.model = ""
        self.receive = None  # the request's ASGI receive, while a watch may still be started
        self.watcher: asyncio.Future | None = None
        self.gone = False  # the client disconnected: the handler was cancelled

    def stop_watch(self) -> None:
        self.receive = None
        if self.watcher is not None:
            self.watcher.cancel()


CALL: contextvars.ContextVar[Call | None] = contextvars.ContextVar("call", default=None)


def request_id(headers) -> str:
    """The caller's x-request-id if it is 1..128 printable ASCII characters, else a fresh one."""
    for k, v in headers:
        if k == b"x-request-id":
            if _GOOD_ID.fullmatch(v):
                return v.decode()
            break
    return os.urandom(16).hex()


def _no_stamp(name: str) -> None:
    pass


class Stages:
    """Per-request stage durations (IVY_STAGES), kept in memory and written at shutdown."""

    def __init__(self, path: str):
        self.path = path
        self.records: list[dict] = []

    def start(self) -> tuple[dict, Stamp]:
        rec: dict = {}
        last = [time.perf_counter()]

        def stamp(name: str) -> None:
            now = time.perf_counter()
            rec[name] = rec.get(name, 0.0) + (now - last[0]) * 1e6
            last[0] = now

        return rec, stamp

    def keep(self, rec: dict) -> None:
        if len(self.records) < MAX_STAGE_RECORDS:
            rec["total"] = sum(rec.values())
            self.records.append({k: round(v, 2) for k, v in rec.items()})

    def write(self) -> None:
        with open(self.path, "ab") as f:  # one write: workers appending at shutdown do not interleave lines
            f.write(b"".join(orjson.dumps(r) + b"\n" for r in self.records))
        self.records = []


# Bodies above this size are handled while watching for the client to disconnect: its handler is
# then cancelled, which cancels its Tulip requests (Tulip drops their queued work). Smaller requests
# usually finish in about a step and skip the watch (a task per request), unless their
# work is large whatever their bytes (16,000 commas are 16,000 tokens, chunked into 32 windows):
# a handler that is about to send more than WATCH_TOKENS tokens to Tulip starts the watch itself
# (`watch_disconnect`, called by ivy.routes.common.tulip_call).
WATCH_BYTES = 16 << 10
WATCH_TOKENS = 1024


def watch_disconnect() -> bool:
    """From inside a fast handler whose work is large: from now on, the client's disconnect cancels
    the handler (Front answers nothing and counts a 499). Nothing where the request is already
    watched (a large body) or is not served by Front. True where it started a watch: the caller
    yields once (`await asyncio.sleep(0)`) before its work, so a client already gone (it left while
    its text was tokenized) cancels it before anything is sent."""
    call = CALL.get()
    if call is None or call.receive is None or call.watcher is not None:
        return False
    task, receive = asyncio.current_task(), call.receive

    async def watch():
        while (await receive())["type"] != "http.disconnect":
            pass
        call.gone = True
        task.cancel()

    call.watcher = asyncio.ensure_future(watch())
    return True


class Front:
    """See the module docstring. `inner`: the FastAPI app's own ASGI entry. `routes`: the app's
    route path templates (`/v1/models/{model_id:path}`), the request counts' route labels.
    `counter`: a prometheus Counter labelled (route, status, model)."""

    def __init__(self, inner, fast: dict[str, Handler], routes: Iterable[str], max_body: int, counter,
                 api_keys: tuple[str, ...] = ()):
        self.inner, self.fast, self.max_body, self.counter = inner, fast, max_body, counter
        self.body_limits: dict[str, int] = {}  # a path's own body limit where not max_body's (ivy.batches' uploads)
        routes = set(routes)
        self.routes = {r for r in routes if "{" not in r}
        self.templates = [compile_path(r)[:2] for r in sorted(routes - self.routes)]  # (regex, "/v1/models/{model_id}")
        self.bearers = [(f"Bearer {k}".encode(), k) for k in api_keys]
        self._children: dict[tuple[str, int, str], object] = {}
        stages = os.environ.get("IVY_STAGES")
        self.stages = Stages(stages) if stages else None

    def route(self, path: str) -> str:
        """The label of the route serving `path`: its template, or "other"."""
        if path in self.routes:
            return path
        return next((label for regex, label in self.templates if regex.match(path)), "other")

    def count(self, route: str, status: int, model: str = "") -> None:
        key = (route, status, model)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = self.counter.labels(route, str(status), model)
        c.inc()

    def authorized(self, scope, call: Call | None = None) -> bool:
        """With API keys set, every path but the probes', the metrics' and the API documents' needs one;
        the one it has is `call.api_key` (the only place Ivy reads the Authorization header)."""
        path = scope["path"]
        if not self.bearers or path in OPEN_PATHS or (path == "/" and scope["method"] in ("GET", "HEAD")):
            return True
        got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, key = got.partition(b" ")
        got = b"Bearer " + key.strip() if scheme.lower() == b"bearer" else got  # the scheme is case-insensitive
        for bearer, key in self.bearers:
            if hmac.compare_digest(got, bearer):
                if call is not None:
                    call.api_key = key
                return True
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            if scope["type"] == "lifespan" and self.stages is not None:
                return await self.inner(scope, receive, self._writing_stages_on_shutdown(send))
            return await self.inner(scope, receive, send)
        path = scope["path"]
        route = self.route(path)
        rid = request_id(scope["headers"])
        REQUEST_ID.set(rid)  # this request's task's own context
        call = Call(scope["headers"])
        CALL.set(call)
        if not self.authorized(scope, call):
            return await self.reply(send, route, 401, error_body(
                401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'", None, "invalid_api_key"), rid)
        limit = self.body_limits.get(path, self.max_body) if self.body_limits else self.max_body
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > limit:
                return await self.reply(send, route, 413, self.too_large(int(v), limit), rid)
        handler = self.fast.get(path) if scope["method"] == "POST" else None
        if handler is None:
            async def counting_send(message):
                if message["type"] == "http.response.start":
                    self.count(route, message["status"], call.model)
                    message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())]}
                await send(message)

            return await self.inner(scope, receive, counting_send)
        rec, stamp = self.stages.start() if self.stages is not None else (None, _no_stamp)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:  # a body without Content-Length, or one longer than it said
                return await self.reply(send, route, 413, self.too_large(size), rid)
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        stamp("receive")
        try:
            call.receive = receive  # the handler may start a watch (watch_disconnect)
            if len(body) > WATCH_BYTES:  # big enough to be worth cancelling if its caller leaves: watched from now
                watch_disconnect()
            try:
                status, payload = 200, await handler(body, stamp)
            except asyncio.CancelledError:
                if not call.gone:
                    raise
                asyncio.current_task().uncancel()
                self.count(route, 499, call.model)  # the client closed the connection: its work is dropped
                log.info("request %s: the client disconnected; its work was dropped", rid)
                return
            finally:
                call.stop_watch()
        except APIError as e:
            status, payload = e.status, e.body()
            if status >= 500:  # the server's side failed (no replica, a deadline): worth a line
                log.warning("request %s: %s answered %d: %s", rid, path, status, e.message)
        except Exception:
            log.exception("%s failed (request %s)", path, rid)
            status, payload = 500, error_body(500, "internal server error", None, "internal_error")
        await self.reply(send, route, status, payload, rid, call.model)
        if rec is not None:
            stamp("send")
            self.stages.keep(rec)

    def too_large(self, n: int, limit: int | None = None) -> bytes:
        return error_body(413, f"request body of {n} bytes exceeds the limit of {limit or self.max_body} bytes")

    async def reply(self, send, route: str, status: int, payload: bytes, rid: str = "", model: str = "") -> None:
        headers = [*JSON_HEADERS, (b"content-length", str(len(payload)).encode())]
        if rid:
            headers.append((b"x-request-id", rid.encode()))
        if status in RETRY_AFTER:
            headers.append((b"retry-after", RETRY_AFTER[status].encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
        self.count(route, status, model)

    def _writing_stages_on_shutdown(self, send):
        async def wrapped(message):
            if message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                self.stages.write()
            await send(message)

        return wrapped


class StatusWatch:
    """An ASGI `send` that remembers the response's status (0 until one is sent): what the access
    log and the tracing span of a request (`ivy.accesslog`, `ivy.tracing`) record."""

    __slots__ = ("send", "status")

    def __init__(self, send):
        self.send = send
        self.status = 0

    async def __call__(self, message):
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self.send(message)


class RedactQuery(logging.Filter):
    """uvicorn's access log writes a request's whole target; an API key passed as a query parameter
    (e.g. `?api_key=...`, which Ivy does not accept but callers send) would land in the log. This
    keeps the parameter names and replaces every value."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            path, _, query = args[2].partition("?")
            names = (part.partition("=")[0] for part in query.split("&") if part)
            record.args = (*args[:2], path + "?" + "&".join(f"{n}=<redacted>" for n in names), *args[3:])
        return True
