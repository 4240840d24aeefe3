"""Ivy's OpenTelemetry spans, with `--otlp-endpoint` (the `tracing` extra; trellis.tracing). This
module is imported only then; without it the request path makes no tracing call at all.

- `Tracing.asgi(app, route)`: a SERVER span per HTTP request around `ivy.front.Front`, joined to
  the caller's trace when the request carries a W3C `traceparent` header: named "METHOD ROUTE"
  (the route template), with http.request.method, http.route, url.path,
  http.response.status_code, trellis.request_id and trellis.model; status ERROR for a 5xx.
- `Tracing.instrument(models)`: each served model's tokenizer calls (`TextTokenizer.encode` and
  `encode_pairs`) make an INTERNAL span "tokenize" (sequences, tokens), and each chunk's Tulip call
  (`Balancer._send`, its retries on other replicas included) a CLIENT span "tulip.Embed"
  (sequences, tokens, the chunk's request id, the replicas tried) whose context travels to Tulip
  (`EmbedOptions.traceparent`), so Tulip's spans for the chunk are its children.

Both wrap at start-up (the app's entry, the models' tokenizer and balancer methods on the
instances), so the code they wrap carries no tracing branch.
"""

from __future__ import annotations

import dataclasses
import functools

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from ivy.front import CALL, REQUEST_ID, StatusWatch
from trellis import tracing

__all__ = ["Tracing"]


class Tracing:
    def __init__(self, endpoint: str):
        self.provider = tracing.provider("ivy", endpoint)
        self.tracer = self.provider.get_tracer("ivy")

    def shutdown(self) -> None:
        """Export what is still batched."""
        self.provider.shutdown()

    def asgi(self, app, route):
        """`app` (ASGI) inside a SERVER span per HTTP request; `route(path)`: its route template."""
        tracer = self.tracer

        async def traced(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            method, path = scope["method"], scope["path"]
            template = route(path)
            caller = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"traceparent"), "")
            watch = StatusWatch(send)
            with tracer.start_as_current_span(
                    method if template == "other" else f"{method} {template}", context=tracing.parent(caller),
                    kind=SpanKind.SERVER, attributes={"http.request.method": method, "http.route": template,
                                                      "url.path": path}) as span:
                try:
                    await app(scope, receive, watch)
                finally:  # Front set the request id and the model in this task's context
                    call = CALL.get()
                    status = watch.status
                    span.set_attributes({"http.response.status_code": status or 499,
                                         "trellis.request_id": REQUEST_ID.get(),
                                         "trellis.model": call.model if call is not None else ""})
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))

        return traced

    def instrument(self, models) -> None:
        """Spans for each served model's tokenization and Tulip calls (call once its balancer exists)."""
        for m in models.all:
            tok = m.tokenizer
            tok.encode = self._tokenize(tok.encode)
            tok.encode_pairs = self._tokenize(tok.encode_pairs)
            m.balancer._send = self._tulip_call(m.balancer._send)
            m.balancer.pick = self._picking(m.balancer.pick)

    def _tokenize(self, encode):
        tracer = self.tracer

        @functools.wraps(encode)
        async def traced(*args, **kwargs):
            with tracer.start_as_current_span("tokenize") as span:
                out = await encode(*args, **kwargs)
                seqs = out[0] if isinstance(out, tuple) else out  # encode_pairs: (sequences, segment starts)
                span.set_attributes({"trellis.sequences": len(seqs), "trellis.tokens": sum(map(len, seqs))})
                return out

        return traced

    def _tulip_call(self, send):
        tracer = self.tracer

        @functools.wraps(send)
        async def traced(seqs, opts, stamp=None):
            attributes = {"rpc.system": "grpc", "rpc.service": "trellis.tulip.v1.Tulip", "rpc.method": "Embed",
                          "trellis.request_id": opts.request_id, "trellis.sequences": len(seqs),
                          "trellis.tokens": sum(map(len, seqs))}
            with tracer.start_as_current_span("tulip.Embed", kind=SpanKind.CLIENT, attributes=attributes) as span:
                return await send(seqs, dataclasses.replace(opts, traceparent=tracing.traceparent(span)), stamp)

        return traced

    @staticmethod
    def _picking(pick):
        @functools.wraps(pick)
        def traced(exclude):
            r = pick(exclude)
            if r is not None:  # the chunk's span: each replica tried, the last one the one that answered
                trace.get_current_span().add_event("replica", {"trellis.replica": r.target})
            return r

        return traced
