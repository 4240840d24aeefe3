"""Ivy with no reachable Tulip: alive, not ready, and a clean 503 (never a 500)."""


import time

import httpx
import pytest

from tests.conftest import Proc, free_port, http_status


@pytest.mark.parametrize("server", ["uvicorn", "granian"])
def test_no_tulip_means_503_not_500(tmp_path, server):
    port = free_port()
    proc = Proc(["-m", "ivy", "--port", str(port), "--tulip", f"127.0.0.1:{free_port()}", "--server", server], tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_for(lambda: http_status(url + "/health") == 200, timeout=60)
        assert http_status(url + "/ready") == 0  # urllib raises on 503
        r = httpx.get(url + "/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        r = httpx.post(url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
        assert r.status_code == 503, r.text
        assert "no inference server" in r.json()["error"]["message"]
    finally:
        # the server (uvicorn or Granian) shuts down gracefully; Ivy then exits 0.
        assert proc.stop() == 0
    assert "Traceback" not in proc.output()


@pytest.mark.parametrize("server", ["uvicorn", "granian"])
def test_multiple_workers(tulip_server, tmp_path, server):
    """--workers 2 runs the server's process manager with the app factory (config through IVY_CONFIG_JSON),
    under each server."""
    target, _ = tulip_server
    port = free_port()
    proc = Proc(["-m", "ivy", "--port", str(port), "--tulip", target, "--workers", "2", "--server", server], tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_for(lambda: http_status(url + "/ready") == 200, timeout=90)
        for _ in range(6):
            r = httpx.post(url + "/v1/embeddings", json={"input": ["a", "b"]}, timeout=30)
            assert r.status_code == 200 and len(r.json()["data"]) == 2
        r = httpx.post(url + "/v1/embeddings", json={"input": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    finally:
        assert proc.stop() == 0
    assert "Traceback" not in proc.output()


def test_request_timeout_is_a_504_and_the_server_carries_on(tulip_server, tmp_path):
    """A request that cannot finish within Ivy's --request-timeout-s gets an OpenAI-shaped 504; its
    queued chunks are dropped in Tulip (by their stream deadlines, or by the cancel message Ivy sends
    when it gives up: whichever reaches them first) and later requests are served."""
    target, tulip = tulip_server

    def expired():  # chunks Tulip dropped: by their deadline, or by Ivy's cancel if that came first
        text = httpx.get(tulip.metrics_url, timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(('tulip_requests_total{status="DEADLINE_EXCEEDED"}',
                                       'tulip_requests_total{status="CANCELLED"}')))

    before = expired()
    port = free_port()
    proc = Proc(["-m", "ivy", "--port", str(port), "--tulip", target, "--request-timeout-s", "0.1",
                 "--max-chunk-tokens", "512"], tmp_path)
    url = f"http://127.0.0.1:{port}"
    big = ["search engines rank documents by relevance " * 40] * 30  # ~15k tokens (under the test Tulip's queue
    # limit), 30 chunks: far more than 0.1 s on a CPU
    try:
        proc.wait_for(lambda: http_status(url + "/ready") == 200, timeout=90)
        r = httpx.post(url + "/v1/embeddings", json={"input": big, "truncate": True}, timeout=60)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "deadline_exceeded"
        proc.wait_for(lambda: expired() > before, timeout=30)  # Tulip dropped the chunks still queued
        for _ in range(40):  # the step running when the deadline passed finishes; nothing else of it runs
            r = httpx.post(url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
            if r.status_code == 200:
                break
        assert r.status_code == 200 and len(r.json()["data"]) == 1
    finally:
        proc.stop()
    assert "Traceback" not in proc.output()


def test_api_keys(tulip_server, tmp_path):
    """With --api-keys, every route needs one of them as a bearer token (the openai client's api_key);
    probes, metrics and the API documents stay open."""
    import openai

    target, _ = tulip_server
    port = free_port()
    proc = Proc(["-m", "ivy", "--port", str(port), "--tulip", target, "--api-keys", "k-one", "--api-keys", "k-two"],
                tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_for(lambda: http_status(url + "/ready") == 200, timeout=90)
        assert http_status(url + "/health") == 200 and http_status(url + "/metrics") == 200
        for key in ("k-one", "k-two"):
            r = openai.OpenAI(base_url=url + "/v1", api_key=key).embeddings.create(model="all-MiniLM-L6-v2", input="hi")
            assert len(r.data[0].embedding) == 384
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=url + "/v1", api_key="k-three").embeddings.create(model="all-MiniLM-L6-v2",
                                                                                   input="hi")
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        r = httpx.get(url + "/v1/models")  # no key at all
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
        for path in ("/embed", "/"):  # text-embeddings-inference's routes too
            assert httpx.post(url + path, json={"inputs": "hi"}).status_code == 401
            r = httpx.post(url + path, json={"inputs": "hi"}, headers={"Authorization": "Bearer k-two"})
            assert r.status_code == 200 and len(r.json()[0]) == 384
        assert httpx.get(url + "/info").status_code == 401 and httpx.get(url + "/openapi.json").status_code == 200
        assert httpx.get(url + "/").status_code == 200 and httpx.get(url + "/ping").status_code == 200  # TEI's probes
    finally:
        proc.stop()
    assert "Traceback" not in proc.output()


def test_prompt_length_counts_as_sentence_transformers(tmp_path, model_path):
    """The prompt's tokens as sentence-transformers 6 counts them: encoded alone, less a trailing
    special token. BERT ends with [SEP] (dropped); a BOS-only tokenizer keeps every token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from ivy.tokenizer import TextTokenizer

    bert = TextTokenizer(model_path, 256, 8192)
    assert bert.prompt_length("query: ") == 3  # [CLS] query : ([SEP] dropped)
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "query": 3, ":": 4, "hi": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<unk>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    (tmp_path / "bos").mkdir()
    tok.save(str(tmp_path / "bos" / "tokenizer.json"))
    bos = TextTokenizer(tmp_path / "bos", 64, 8192)
    assert bos.prompt_length("query :") == 3  # <s> query : (nothing trailing to drop)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    tok.save(str(tmp_path / "bos" / "tokenizer.json"))
    assert TextTokenizer(tmp_path / "bos", 64, 8192).prompt_length("query :") == 3  # </s> dropped


def test_workers_started_before_tulip_serve_as_soon_as_ready(tmp_path):
    """Ivy's workers each have their own channels. Started before Tulip, every worker must serve once
    /ready says ready (a request reaching a worker that has not heard from Tulip yet waits for it
    instead of answering 503; the benchmark's first request once met that on an H200)."""
    tulip_port, port = free_port(), free_port()
    ivy = Proc(["-m", "ivy", "--port", str(port), "--tulip", f"127.0.0.1:{tulip_port}", "--workers", "4"], tmp_path)
    url = f"http://127.0.0.1:{port}"
    tulip = None
    try:
        ivy.wait_for(lambda: http_status(url + "/health") == 200, timeout=90)
        time.sleep(6)  # the workers' channels back off while nothing listens (gRPC's default grows past 10 s)
        tulip = Proc(["-m", "tulip", "--port", str(tulip_port), "--device", "cpu"], tmp_path)
        ivy.wait_for(lambda: http_status(url + "/ready") == 200, timeout=120)
        codes = [httpx.post(url + "/v1/embeddings", json={"input": "hi"}, timeout=30).status_code for _ in range(24)]
        assert codes == [200] * 24
    finally:
        if tulip is not None:
            tulip.stop()
        ivy.stop()
    assert "Traceback" not in ivy.output()


@pytest.mark.parametrize("body, message, param", [
    (b'{"input": 3.5}', "'input' must be a string, an array of strings", "input"),
    (b'{"input": [[1.5]]}', "'input' must be", "input"),
    (b'{"model": "m"}', "'input' is required", "input"),
    (b'{"input": "x", "encoding_format": "int"}', "invalid value for 'encoding_format'", "encoding_format"),
    (b'{"input": "x", "dimensions": "8"}', "invalid value for 'dimensions'", "dimensions"),
    (b'{"input": "x", "truncate": 2}', "invalid value for 'truncate': Input should be a valid boolean", "truncate"),
    (b'{"input": "x", "truncate": "middle"}', 'or one of "end", "start", "chunk"', "truncate"),
    (b'{"input": "x", "truncate": [true]}', "invalid value for 'truncate'", "truncate"),
    (b"[1, 2]", "request body must be a JSON object", None),
    (b"{not json", "request body is not valid JSON", None),
    (b"", "request body is not valid JSON", None),
])
def test_body_decoding_errors_name_the_field(body, message, param):
    """One typed pass (msgspec) with the 400s the pydantic models gave: the field named as `param`."""
    from ivy.errors import APIError, parse_body
    from ivy.schemas import EmbeddingRequest

    with pytest.raises(APIError) as e:
        parse_body(EmbeddingRequest, body)
    assert e.value.status == 400 and message in e.value.message and e.value.param == param


def test_body_decoding_takes_lax_booleans_and_ignores_unknown_fields():
    from ivy.errors import parse_body
    from ivy.schemas import EmbeddingRequest, RerankRequest

    for raw, want in (("true", True), ('"yes"', True), ("1", True), ('"off"', False), ("0", False), ("false", False)):
        r = parse_body(EmbeddingRequest, f'{{"input": ["a"], "truncate": {raw}, "extra": {{"x": 1}}}}'.encode())
        assert r.truncate is want and r.input == ["a"] and r.mode == ("end" if want else None)
    for mode in ("end", "start", "chunk"):
        assert parse_body(EmbeddingRequest, f'{{"input": "a", "truncate": "{mode}"}}'.encode()).mode == mode
    r = parse_body(RerankRequest, b'{"query": "q", "documents": ["d"], "return_documents": "t"}')
    assert r.return_documents is True and r.truncate is False and r.top_n is None


def test_openapi_documents_the_raw_body_routes(model_path):
    """The hot routes are answered before FastAPI's stack, but stay in its OpenAPI document with
    their request schemas (the five accepted `input` shapes, booleans as booleans)."""
    from ivy.app import create_app
    from ivy.config import IvyConfig

    doc = create_app(IvyConfig(tulip=("127.0.0.1:1",), model=str(model_path))).openapi()
    for path, required in (("/v1/embeddings", ["input"]), ("/v1/rerank", ["query", "documents"]),
                           ("/v1/tokenize", ["input"])):
        s = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert s["type"] == "object" and s["required"] == required, s
        assert s["properties"]["truncate"] == ({"type": "boolean", "default": False} if path != "/v1/embeddings" else
                                               {"anyOf": [{"type": "boolean"}, {"enum": ["end", "start", "chunk"]}],
                                                "default": False})
    s = doc["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert len(s["properties"]["input"]["anyOf"]) == 5  # the fifth: Jina's {"text"} / {"image"} items
    assert "base64" in s["properties"]["encoding_format"]["enum"]


def test_the_gateway_imports_neither_the_engine_nor_torch():
    """Ivy depends on the shared contracts (trellis/) only: its image carries no torch or CUDA."""
    import subprocess
    import sys

    code = ("import sys, ivy.__main__, ivy.app; from ivy.app import create_app; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'rose', 'triton')); "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_embed_options_split_per_chunk_and_build_the_request():
    """One options object from the route through the balancer to the client: a chunk's options
    carry its own sequences' per-sequence fields and the request id with "-k"."""
    import numpy as np

    from trellis.tulip.v1 import tulip_pb2
    from trellis.client import EmbedOptions

    o = EmbedOptions(32, tulip_pb2.ENCODING_INT8, (tulip_pb2.OUTPUT_SPARSE,), [1, 2, 3], [0, 4, 5], True, "r")
    p = o.part(1, 3, 2)
    assert (p.pool_from, p.segment_starts, p.request_id) == ([2, 3], [4, 5], "r-2")
    assert (p.dimensions, p.encoding, p.outputs, p.raw_scores) == (32, tulip_pb2.ENCODING_INT8, o.outputs, True)
    assert EmbedOptions().part(0, 1, 0).request_id == ""
    req = p.request([[5, 6], [7]])
    assert (list(req.lengths), list(req.pool_from), list(req.segment_starts), req.request_id) == ([2, 1], [2, 3],
                                                                                                   [4, 5], "r-2")
    assert (req.dimensions, req.encoding, list(req.outputs), req.raw_scores) == (32, tulip_pb2.ENCODING_INT8,
                                                                                [tulip_pb2.OUTPUT_SPARSE], True)
    assert req.token_ids == np.array([5, 6, 7], "<i4").tobytes()


def test_one_write_per_loop_turn():
    """ivy.protocol.OneWrite: a response's head and body (two writes in one turn) reach the socket as
    one write, in order; close() sends what is held first; abort() and a closed peer drop it."""
    import asyncio

    from ivy.protocol import OneWrite

    class Recording:  # the transport underneath: what reached it
        def __init__(self):
            self.writes, self.closing = [], False

        def write(self, data):
            assert not self.closing
            self.writes.append(data)

        def is_closing(self):
            return self.closing

        def close(self):
            self.closing = True

        def abort(self):
            self.closing = True

        def get_write_buffer_size(self):
            return 0

        def get_extra_info(self, name):
            return name

    async def run():
        t = Recording()
        w = OneWrite(t, asyncio.get_running_loop())
        w.write(b"HTTP/1.1 200 OK\r\n\r\n")
        w.write(b"{}")
        assert t.writes == [] and w.get_write_buffer_size() == 21
        await asyncio.sleep(0)
        assert t.writes == [b"HTTP/1.1 200 OK\r\n\r\n{}"]
        assert w.get_extra_info("peername") == "peername"  # the rest is the transport's
        w.write(b"a")
        await asyncio.sleep(0)
        w.write(b"b")
        w.close()  # sent before the close
        await asyncio.sleep(0)
        assert t.writes[1:] == [b"a", b"b"] and t.closing
        t2 = Recording()
        w2 = OneWrite(t2, asyncio.get_running_loop())
        w2.write(b"x")
        t2.closing = True  # the peer went away before the turn ended
        await asyncio.sleep(0)
        w2.write(b"y")
        w2.abort()
        await asyncio.sleep(0)
        assert t2.writes == []

    asyncio.run(run())
