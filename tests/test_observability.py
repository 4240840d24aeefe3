"""Tracing and JSON logs against real processes on loopback: a Tulip and an Ivy started with
--otlp-endpoint (the `tracing` extra) exporting to an OTLP/gRPC collector run in this test
(opentelemetry-proto's TraceService), and with --log-format json; one /v1/embeddings request's
spans on both sides in one trace (the caller's), with their parent links; Tulip's queue and step
spans; the trace context on a unary call's metadata; without --otlp-endpoint no tracing module is
loaded; with it but without the packages, a start-up error naming the extra."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from concurrent import futures

import grpc
import httpx
import pytest

from tests.conftest import ROOT, Proc, free_port, http_status

trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
KINDS = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT"}


def value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Collector(trace_service.TraceServiceServicer):
    """An OTLP/gRPC trace collector keeping every span it is sent, as dicts."""

    def __init__(self):
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                resource = {a.key: value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({
                            "service": resource.get("service.name"), "resource": resource, "name": s.name,
                            "trace": s.trace_id.hex(), "id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                            "kind": KINDS.get(s.kind, s.kind), "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano, "status": s.status.code,
                            "attributes": {a.key: value(a.value) for a in s.attributes},
                            "events": [(e.name, {a.key: value(a.value) for a in e.attributes}) for e in s.events]})
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str, until, timeout: float = 15.0) -> list[dict]:
        """The spans of `trace_id` once `until(spans)` holds (they come in batches, from two processes)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = [s for s in self.spans if s["trace"] == trace_id]
            if until(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service.add_TraceServiceServicer_to_server(c, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield c, f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture(scope="module")
def stack(collector, tmp_path_factory):
    """A traced Tulip and a traced Ivy, both logging JSON; (Ivy's URL, Tulip's target, the Procs)."""
    tmp = tmp_path_factory.mktemp("observability")
    env = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # export every 50 ms, not 5 s
    tulip_port, port = free_port(), free_port()
    tulip = Proc(["-m", "tulip", "--port", str(tulip_port), "--device", "cpu", "--otlp-endpoint", collector[1],
                  "--log-format", "json"], tmp, env)
    ivy = Proc(["-m", "ivy", "--port", str(port), "--tulip", f"127.0.0.1:{tulip_port}", "--max-chunk-tokens", "64",
                "--access-log", "--log-format", "json"], tmp, {**env, "IVY_OTLP_ENDPOINT": collector[1]})
    url = f"http://127.0.0.1:{port}"
    try:
        tulip.wait_for(lambda: "TULIP_READY" in tulip.output())
        ivy.wait_for(lambda: http_status(url + "/ready") == 200)
        yield url, f"127.0.0.1:{tulip_port}", ivy, tulip
    finally:
        ivy.stop()
        tulip.stop()


def by_name(spans: list[dict], name: str, service: str) -> list[dict]:
    return [s for s in spans if s["name"] == name and s["service"] == service]


def test_one_request_is_one_trace_across_ivy_and_tulip(stack, collector):
    url = stack[0]
    r = httpx.post(url + "/v1/embeddings", json={"input": ["the quick brown fox", "jumps over the lazy dog"]},
                   headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01", "x-request-id": "traced-1"})
    assert r.status_code == 200, r.text
    tokens = r.json()["usage"]["prompt_tokens"]
    spans = collector[0].trace(CALLER_TRACE, lambda s: len(s) >= 6)
    http, = by_name(spans, "POST /v1/embeddings", "ivy")
    tokenize, = by_name(spans, "tokenize", "ivy")
    call, = by_name(spans, "tulip.Embed", "ivy")
    served, = by_name(spans, "tulip.Embed", "tulip")
    queue, = by_name(spans, "queue", "tulip")
    step, = by_name(spans, "step", "tulip")
    assert len(spans) == 6, [(s["service"], s["name"]) for s in spans]
    # the caller's trace, joined: every span in it, each with its parent
    assert http["parent"] == CALLER_SPAN and http["kind"] == "SERVER"
    assert tokenize["parent"] == call["parent"] == http["id"]
    assert served["parent"] == call["id"] and served["kind"] == "SERVER" and call["kind"] == "CLIENT"
    assert queue["parent"] == step["parent"] == served["id"]
    a = http["attributes"]
    assert a["http.route"] == "/v1/embeddings" and a["http.response.status_code"] == 200
    assert a["trellis.request_id"] == "traced-1" and a["trellis.model"] == r.json()["model"]
    assert tokenize["attributes"]["trellis.tokens"] == tokens and tokenize["attributes"]["trellis.sequences"] == 2
    assert call["attributes"]["trellis.request_id"] == "traced-1" and call["attributes"]["trellis.tokens"] == tokens
    assert call["events"] == [("replica", {"trellis.replica": stack[1]})]
    s = served["attributes"]
    assert s["trellis.request_id"].startswith("traced-1#") and s["rpc.method"] == "EmbedStream"  # the stream's tag
    assert s["tulip.tokens"] == tokens and s["tulip.sequences"] == 2 and s["rpc.grpc.status_code"] == "OK"
    assert served["resource"]["service.instance.id"] == stack[1]
    assert step["attributes"]["tulip.steps"] == 1 and step["attributes"]["tulip.step.tokens"] >= tokens
    # the times nest: Ivy's call around Tulip's request; queued, then the step, inside it
    assert http["start"] <= tokenize["start"] <= tokenize["end"] <= call["start"] <= served["start"]
    assert served["start"] <= queue["start"] <= queue["end"] == step["start"] <= step["end"] <= served["end"]
    assert served["end"] <= call["end"] <= http["end"]


def test_each_chunk_is_a_tulip_call_of_its_own(stack, collector):
    """Ivy runs with --max-chunk-tokens 64: twelve ~14-token inputs go as several chunks, each with
    its span, its request id ("-k") and Tulip's span under it; a request with no traceparent starts
    a trace of its own."""
    texts = [f"sentence number {i} says something about chunked requests and spans" for i in range(12)]
    r = httpx.post(stack[0] + "/v1/embeddings", json={"input": texts}, headers={"x-request-id": "chunked"})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 15
    while not (roots := [s for s in collector[0].spans if s["attributes"].get("trellis.request_id") == "chunked"
                         and s["kind"] == "SERVER"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    http, = roots
    assert http["parent"] == "" and http["trace"] != CALLER_TRACE
    spans = collector[0].trace(http["trace"], lambda s: (n := len(by_name(s, "tulip.Embed", "ivy"))) > 1
                               and len(by_name(s, "tulip.Embed", "tulip")) == n and len(by_name(s, "step", "tulip")) == n)
    calls = by_name(spans, "tulip.Embed", "ivy")
    assert len(calls) >= 3 and all(c["parent"] == http["id"] for c in calls)
    assert sorted(c["attributes"]["trellis.request_id"] for c in calls) == [f"chunked-{k}" for k in range(len(calls))]
    assert sum(c["attributes"]["trellis.tokens"] for c in calls) == r.json()["usage"]["prompt_tokens"]
    served = {s["parent"]: s for s in by_name(spans, "tulip.Embed", "tulip")}
    for c in calls:
        assert served[c["id"]]["attributes"]["trellis.request_id"].startswith(c["attributes"]["trellis.request_id"] + "#")


def test_errors_and_fastapi_routes_are_spans_too(stack, collector):
    r = httpx.post(stack[0] + "/v1/embeddings", json={"input": ""},
                   headers={"traceparent": f"00-{'1' * 32}-{'2' * 16}-01", "x-request-id": "bad-1"})
    assert r.status_code == 400
    r = httpx.get(stack[0] + "/v1/models/nope", headers={"traceparent": f"00-{'3' * 32}-{'4' * 16}-01"})
    assert r.status_code == 404
    bad, = collector[0].trace("1" * 32, lambda s: len(s) >= 1)
    assert bad["attributes"]["http.response.status_code"] == 400 and bad["attributes"]["trellis.request_id"] == "bad-1"
    assert bad["status"] == 0  # a client's error is not the server's (OTel: unset)
    got, = collector[0].trace("3" * 32, lambda s: len(s) >= 1)
    assert got["name"] == "GET /v1/models/{model_id}" and got["attributes"]["http.response.status_code"] == 404


def test_unary_calls_carry_the_context_in_metadata(stack, collector):
    """TulipClient's unary transport sends EmbedOptions.traceparent as the `traceparent` metadata key."""
    from trellis.client import EmbedOptions, TulipClient

    trace_id, span_id = "5" * 32, "6" * 16

    async def main():
        async with TulipClient(stack[1], transport="unary") as c:
            return await c.call([[101, 7592, 102]], EmbedOptions(request_id="unary-1",
                                                                 traceparent=f"00-{trace_id}-{span_id}-01"))

    assert asyncio.run(main()).vectors.shape == (1, 384)
    spans = collector[0].trace(trace_id, lambda s: len(s) >= 3)
    served, = by_name(spans, "tulip.Embed", "tulip")
    assert served["parent"] == span_id and served["attributes"]["rpc.method"] == "Embed"
    assert served["attributes"]["trellis.request_id"] == "unary-1"
    assert {s["name"] for s in spans if s["parent"] == served["id"]} == {"queue", "step"}


def test_logs_are_json_lines(stack):
    """Every line Ivy writes is a JSON object; its access lines carry method, path, status,
    duration_ms, request_id and model. Tulip's too, but its TULIP_READY line (a protocol line)."""
    url, _, ivy, tulip = stack
    r = httpx.post(url + "/v1/embeddings", json={"input": "logged"}, headers={"x-request-id": "log-1"})
    assert r.status_code == 200
    assert httpx.post(url + "/v1/embeddings", json={"input": ""}, headers={"x-request-id": "log-2"}).status_code == 400
    deadline = time.monotonic() + 5
    while "log-2" not in ivy.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [json.loads(line) for line in ivy.output().splitlines()]  # every line parses
    assert all({"time", "level", "logger", "message"} <= set(x) for x in lines)
    assert any(x["logger"] == "uvicorn.error" and "startup complete" in x["message"] for x in lines)
    access = {x["request_id"]: x for x in lines if x["logger"] == "ivy.access"}
    ok, bad = access["log-1"], access["log-2"]
    assert (ok["method"], ok["path"], ok["status"], bad["status"]) == ("POST", "/v1/embeddings", 200, 400)
    assert ok["model"] == bad["model"] == r.json()["model"] and 0 < ok["duration_ms"] < 10_000
    assert ok["level"] == "INFO" and ok["time"].endswith("Z")
    other = [line for line in tulip.output().splitlines() if not line.startswith("TULIP_READY")]
    assert other and all(json.loads(line)["logger"] for line in other)


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_without_an_endpoint_no_tracing_module_is_loaded():
    """Ivy's app and Tulip's servicer path without --otlp-endpoint: neither tracing module nor the
    OpenTelemetry SDK is imported (FastAPI imports the OpenTelemetry API itself), and the engine
    loop's and the tokenizers' code is the untraced one."""
    p = _run("""
import sys
from ivy.app import create_app
from ivy.config import IvyConfig
from tulip.config import TulipConfig
import tulip.server
app = create_app(IvyConfig(tulip=("127.0.0.1:1",)))
assert app.entry is app.front, app.entry
assert TulipConfig().otlp_endpoint == ""
loaded = sorted(m for m in sys.modules if m in ("ivy.tracing", "tulip.tracing") or m.startswith("opentelemetry.sdk"))
print("LOADED", loaded)
""")
    assert p.returncode == 0, p.stderr
    assert "LOADED []" in p.stdout


@pytest.mark.parametrize("main", ["ivy", "tulip"])
def test_an_endpoint_without_the_packages_is_a_start_up_error(main):
    p = _run(f"""
import sys
sys.modules["opentelemetry.sdk"] = None  # as if opentelemetry-sdk were not installed
from {main}.__main__ import main
sys.exit(main(["--tulip", "127.0.0.1:1", "--otlp-endpoint", "127.0.0.1:4317"] if "{main}" == "ivy"
              else ["--otlp-endpoint", "127.0.0.1:4317"]))
""")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "--otlp-endpoint needs OpenTelemetry" in p.stderr and "pip install 'trellis[tracing]'" in p.stderr
