"""Tulip's OpenTelemetry spans, with `--otlp-endpoint` (the `tracing` extra; trellis.tracing). This
module is imported only then; without it no request makes a tracing call (the engine loop tests one
flag per step, the servicer and the loop `is not None` per request, as for tulip.stages).

Each queued request gets a `RequestTrace` (`Request.trace`): the engine loop tells it when its
first step was launched and when its last step completed, and ends it once it is answered, failed
or cancelled. Its spans are then made in one go, with the times recorded:

- "tulip.Embed" (SERVER): receipt (after validation) to the answer, a child of the caller's span
  when the request carries a W3C traceparent (the stream message's `traceparent` field, or a unary
  call's `traceparent` metadata); trellis.request_id, tulip.sequences, tulip.tokens, the gRPC status.
- "queue" (INTERNAL, its child): queued until its first step was launched (or it ended queued).
- "step" (INTERNAL, its child): that launch until its last step completed. A step is shared by the
  requests batched in it: the span is this request's view of it, with the step's own figures as
  attributes (tulip.steps it took part in, tulip.step.sequences / tulip.step.tokens of the first).
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from trellis import tracing

__all__ = ["CANCELLED", "RequestTrace", "Tracing"]

CANCELLED = "CANCELLED"  # `RequestTrace.end`'s status for a request whose caller left
_CODES = {OverflowError: "RESOURCE_EXHAUSTED", TimeoutError: "DEADLINE_EXCEEDED"}  # tulip.server.RpcFailure.of


class Tracing:
    def __init__(self, endpoint: str, served_model: str, address: str):
        self.provider = tracing.provider("tulip", endpoint, **{"service.instance.id": address,
                                                                 "trellis.model": served_model})
        self.tracer = self.provider.get_tracer("tulip")

    def start(self, req, request, context=None) -> None:
        """Trace queued Request `req` from the EmbedRequest `request` (`context`: a unary call's)."""
        caller = request.traceparent
        if not caller and context is not None:
            caller = next((v for k, v in context.invocation_metadata() or () if k == "traceparent"), "")
        req.trace = RequestTrace(self, req, caller, request.request_id, "EmbedStream" if context is None else "Embed")

    def shutdown(self) -> None:
        """Export what is still batched."""
        self.provider.shutdown()

    @staticmethod
    def launched(step) -> None:
        """The engine loop launched `step` (tulip.loop._Step): its traced requests' first launch."""
        for r, _ in step.slots:
            t = r.trace
            if t is not None and not t.launched:
                t.launched, t.step_sequences, t.step_tokens = step.launched, len(step.slots), step.tokens

    @staticmethod
    def completed(step, now: float) -> None:
        """`step` completed at `now` (monotonic): its traced requests' latest step."""
        for r, _ in step.slots:
            t = r.trace
            if t is not None and t.completed != now:  # several sequences of one request in the step: once
                t.completed, t.steps = now, t.steps + 1


class RequestTrace:
    __slots__ = ("tracing", "req", "caller", "request_id", "method", "received", "launched", "completed", "steps",
                 "step_sequences", "step_tokens", "ended")

    def __init__(self, tracing_: Tracing, req, caller: str, request_id: str, method: str):
        self.tracing, self.req, self.caller, self.request_id, self.method = tracing_, req, caller, request_id, method
        self.received = time.monotonic()
        self.launched = self.completed = 0.0
        self.steps = self.step_sequences = self.step_tokens = 0
        self.ended = False

    def end(self, error: Exception | str | None = None) -> None:
        """The request was answered (`error` None), failed, or cancelled (CANCELLED): make its spans."""
        if self.ended:
            return
        self.ended = True
        now = time.monotonic()
        # monotonic -> wall-clock nanoseconds, read now: an offset fixed at start-up drifts as the
        # wall clock is slewed (2 ms seen on a test machine), and spans must line up with Ivy's
        epoch = time.time_ns() - time.monotonic_ns()
        tracer, req = self.tracing.tracer, self.req

        def ns(t: float) -> int:
            return int(t * 1e9) + epoch

        code = "OK" if error is None else error if isinstance(error, str) else _CODES.get(type(error), "INTERNAL")
        span = tracer.start_span("tulip.Embed", context=tracing.parent(self.caller), kind=SpanKind.SERVER,
                                 start_time=ns(self.received), attributes={
                                     "rpc.system": "grpc", "rpc.service": "trellis.tulip.v1.Tulip",
                                     "rpc.method": self.method, "rpc.grpc.status_code": code,
                                     "trellis.request_id": self.request_id, "tulip.sequences": len(req.lengths),
                                     "tulip.tokens": req.num_tokens})
        inside = trace.set_span_in_context(span)
        if req.queued_at:
            queue = tracer.start_span("queue", context=inside, start_time=ns(req.queued_at))
            queue.end(end_time=ns(self.launched or now))
        if self.launched:
            step = tracer.start_span("step", context=inside, start_time=ns(self.launched), attributes={
                "tulip.steps": self.steps, "tulip.step.sequences": self.step_sequences,
                "tulip.step.tokens": self.step_tokens})
            step.end(end_time=ns(self.completed or now))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, f"{code}: {error}" if not isinstance(error, str) else code))
        span.end(end_time=ns(now))
        self.req = None  # the request's arrays are not kept alive by its trace
