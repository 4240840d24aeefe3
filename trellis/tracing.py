"""What Ivy's and Tulip's tracing share (`ivy.tracing`, `tulip.tracing`): the check that the optional
`tracing` extra is installed, the tracer provider exporting to an OTLP/gRPC collector, and the W3C
`traceparent` a span hands to the next process.

OpenTelemetry is imported only by these functions, and they are called only with `--otlp-endpoint`
set: without it no OpenTelemetry SDK module is loaded and no request makes a tracing call.

The SDK's own environment variables apply: OTEL_SERVICE_NAME (default "ivy" / "tulip"),
OTEL_RESOURCE_ATTRIBUTES, OTEL_BSP_SCHEDULE_DELAY (ms between exports, default 5000) and the other
OTEL_BSP_* batch settings, OTEL_EXPORTER_OTLP_TRACES_HEADERS / _CERTIFICATE, OTEL_TRACES_SAMPLER.
"""

from __future__ import annotations

import os

PACKAGES = ("opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-grpc")
INSTALL = "pip install 'trellis[tracing]'"


def require(what: str) -> None:
    """A ValueError naming the extra unless the OpenTelemetry SDK and its OTLP/gRPC exporter import."""
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{what} needs OpenTelemetry ({', '.join(PACKAGES)}), which is not installed ({e}); "
                         f"install the tracing extra: {INSTALL}") from None


def provider(service: str, endpoint: str, **attributes: str):
    """A TracerProvider of its own (the global one, which FastAPI's built-in telemetry would use, is
    left alone) batching spans to the OTLP/gRPC collector at `endpoint`: HOST:PORT or http://HOST:PORT
    in plaintext, https://HOST:PORT over TLS. `attributes`: more resource attributes."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or service, **attributes})
    p = TracerProvider(resource=resource)
    p.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return p


def traceparent(span) -> str:
    """The W3C traceparent naming `span` as the parent ("" for a span that is not recorded)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def parent(value: str):
    """The OpenTelemetry context a W3C traceparent names (an empty one for a missing or bad value:
    the span then starts a trace of its own)."""
    from opentelemetry.context import Context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": value}) if value else Context()
