"""The whole path with real processes: deploy.local -> Ivy (HTTP) -> Tulip (gRPC) -> ROSE,
driven by the official openai client, checked against sentence-transformers."""

import re
import signal
import socket

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import Proc, free_port, http_status, metric
from tests.sentences import SENTENCES

MODEL = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    port = free_port()
    # Two replicas and a small chunk budget so that batched requests are split across both.
    proc = Proc(["-m", "deploy.local", "--model", "default", "--replicas", "2", "--port", str(port),
                 "--device", "cpu"], tmp_path_factory.mktemp("stack"), env={"IVY_MAX_CHUNK_TOKENS": "256"})
    proc.wait_for(lambda: "Trellis is ready" in proc.output(), timeout=180)
    url = f"http://127.0.0.1:{port}"
    yield url, proc
    if proc.p.poll() is None:
        proc.stop(signal.SIGINT)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack[0] + "/v1", api_key="unused", max_retries=0)


def cosines(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_health_ready_models(stack, client):
    url, _ = stack
    assert http_status(url + "/health") == 200
    assert http_status(url + "/ready") == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_parity_with_sentence_transformers(client, st_model):
    ref = st_model.encode(SENTENCES, batch_size=64)
    batched = client.embeddings.create(model=MODEL, input=SENTENCES)
    assert [d.index for d in batched.data] == list(range(len(SENTENCES)))
    got = np.array([d.embedding for d in batched.data])
    assert got.shape == (len(SENTENCES), 384)
    assert cosines(got, ref).min() >= 0.9999
    singles = np.array([client.embeddings.create(model=MODEL, input=s).data[0].embedding for s in SENTENCES[:20]])
    assert cosines(singles, ref[:20]).min() >= 0.9999


def test_base64_and_float_agree_and_usage(client, st_model):
    texts = SENTENCES[:7]
    f = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    # With no encoding_format the official client asks for base64 and decodes it as float32 itself.
    d = client.embeddings.create(model=MODEL, input=texts)
    b = client.embeddings.create(model=MODEL, input=texts, encoding_format="base64")
    ff = np.array([x.embedding for x in f.data])
    np.testing.assert_allclose(ff, np.array([x.embedding for x in d.data]), atol=1e-7)
    import base64

    bb = np.array([np.frombuffer(base64.b64decode(x.embedding), dtype="<f4") for x in b.data])
    np.testing.assert_allclose(ff, bb, atol=1e-7)
    n_tokens = sum(len(st_model.tokenizer(t)["input_ids"]) for t in texts)
    assert f.usage.prompt_tokens == f.usage.total_tokens == n_tokens
    assert f.model == MODEL and f.object == "list"


def test_raw_base64_is_float32_little_endian(stack):
    import base64

    r = httpx.post(stack[0] + "/v1/embeddings", json={"input": "hi", "model": MODEL, "encoding_format": "base64"})
    v = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert v.shape == (384,) and abs(np.linalg.norm(v) - 1) < 1e-5


def test_token_inputs_and_dimensions(client, st_model):
    ids = [st_model.tokenizer(t)["input_ids"] for t in SENTENCES[:3]]
    by_text = client.embeddings.create(model=MODEL, input=SENTENCES[:3])
    by_ids = client.embeddings.create(model=MODEL, input=ids)
    one = client.embeddings.create(model=MODEL, input=ids[0])
    np.testing.assert_allclose([d.embedding for d in by_ids.data], [d.embedding for d in by_text.data], atol=1e-6)
    np.testing.assert_allclose(one.data[0].embedding, by_text.data[0].embedding, atol=1e-6)
    short = client.embeddings.create(model=MODEL, input=SENTENCES[:3], dimensions=64)
    s = np.array([d.embedding for d in short.data])
    full = np.array([d.embedding for d in by_text.data])[:, :64]
    assert s.shape == (3, 64)
    np.testing.assert_allclose(s, full / np.linalg.norm(full, axis=1, keepdims=True), atol=1e-5)


def test_truncate_extension(client):
    long = "word " * 400
    r = client.embeddings.create(model=MODEL, input=long, extra_body={"truncate": True})
    assert r.usage.prompt_tokens == 256


@pytest.mark.parametrize("kwargs, status, fragment", [
    (dict(input=[]), 400, "must not be empty"),
    (dict(input=""), 400, "empty string"),
    (dict(input=[[]]), 400, "empty token array"),
    (dict(input="hi", model="no-such-model"), 404, "does not exist"),
    (dict(input="word " * 300), 400, "302 tokens, more than this model's maximum of 256"),
    (dict(input=[[101, 50000]]), 400, "outside the vocabulary"),
    (dict(input="hi", dimensions=0), 400, "dimensions must be between 1 and 384"),
    (dict(input="hi", dimensions=385), 400, "dimensions must be between 1 and 384"),
])
def test_openai_client_errors(client, kwargs, status, fragment):
    kwargs.setdefault("model", MODEL)
    with pytest.raises(openai.APIStatusError) as e:
        client.embeddings.create(**kwargs)
    assert e.value.status_code == status
    err = e.value.body
    assert fragment in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, fragment", [
    ({"input": [1, "a"]}, "'input' must be"),
    ({"input": 3.5}, "'input' must be"),
    ({"input": [[1.5]]}, "'input' must be"),
    ({"input": True}, "'input' must be"),
    ({"model": MODEL}, "'input' is required"),
    ({"input": "x", "encoding_format": "int"}, "encoding_format"),
    ({"input": "x", "dimensions": "8"}, "dimensions"),
    ({"input": "x", "truncate": "perhaps"}, "truncate"),
    ({"input": [[101, 2**40]]}, "outside the vocabulary"),
    ({"input": [101, -(2**40)]}, "outside the vocabulary"),
    ({"input": [101, 2**70]}, "outside the vocabulary"),
    ({"input": [2**63]}, "outside the vocabulary"),  # issue #17 fault 1: 2^63..2^64-1 gave a 500
    ([1, 2], "JSON object"),
])
def test_wrong_types_are_400_not_500(stack, body, fragment):
    r = httpx.post(stack[0] + "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


def test_malformed_and_oversized_bodies(stack):
    url = stack[0] + "/v1/embeddings"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url, content=b"x" * (33 << 20))
    assert r.status_code == 413
    r = httpx.post(url, content=iter([b"x" * (1 << 20)] * 33))  # chunked: no Content-Length to refuse it by
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
    r = httpx.post(url, json={"input": "still fine", "model": MODEL})
    assert r.status_code == 200


def test_rerank_orders_documents_by_cosine_as_sentence_transformers(stack, st_model):
    url = stack[0] + "/v1/rerank"
    query, docs = SENTENCES[0], SENTENCES[1:9]
    r = httpx.post(url, json={"query": query, "documents": docs, "return_documents": True, "model": MODEL}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    ref = st_model.encode([query, *docs], normalize_embeddings=True)
    got = {x["index"]: x["relevance_score"] for x in body["results"]}
    assert sorted(got) == list(range(len(docs)))
    np.testing.assert_allclose([got[i] for i in range(len(docs))], ref[1:] @ ref[0], atol=1e-4)
    scores = [x["relevance_score"] for x in body["results"]]
    assert scores == sorted(scores, reverse=True)
    assert all(x["document"]["text"] == docs[x["index"]] for x in body["results"])
    assert body["usage"]["prompt_tokens"] == sum(len(st_model.tokenizer(t)["input_ids"]) for t in [query, *docs])
    top = httpx.post(url, json={"query": query, "documents": docs, "top_n": 2}, timeout=60).json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in body["results"][:2]] and "document" not in top[0]


@pytest.mark.parametrize("body, status, fragment", [
    ({"query": "q", "documents": []}, 400, "'documents' must not be empty"),
    ({"query": "q", "documents": ["a"], "top_n": 0}, 400, "top_n must be at least 1"),
    ({"query": "", "documents": ["a"]}, 400, "'query' is an empty string"),
    ({"query": "q", "documents": ["a", ""]}, 400, "document 1 is an empty string"),
    ({"query": "q", "documents": ["a"], "model": "nope"}, 404, "does not exist"),
    ({"query": "q"}, 400, "'documents' is required"),
    ({"query": "q", "documents": "a"}, 400, "invalid value for 'documents'"),
    ({"query": "q", "documents": ["a", "word " * 300]}, 400, "document 1 has 302 tokens, more than this model's maximum of 256"),
    ({"query": "word " * 300, "documents": ["a"]}, 400, "query has 302 tokens"),
    ({"query": "q", "documents": ["word " * 300]}, 400, "document 0 has 302 tokens"),
])
def test_rerank_errors(stack, body, status, fragment):
    r = httpx.post(stack[0] + "/v1/rerank", json=body)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]
    assert r.json()["error"]["param"] in ("query", "documents", "top_n", "model")


def test_tokenize_shows_what_the_model_sees(stack, st_model):
    url = stack[0] + "/v1/tokenize"
    long = " ".join(["word"] * 400)
    body = httpx.post(url, json={"input": [SENTENCES[0], long]}).json()
    assert body["data"][0]["tokens"] == st_model.tokenizer(SENTENCES[0])["input_ids"]
    assert body["data"][1]["count"] == len(st_model.tokenizer(long)["input_ids"]) > body["max_model_len"]
    cut = httpx.post(url, json={"input": long, "truncate": True}).json()["data"][0]
    assert cut["count"] == body["max_model_len"]
    r = httpx.post(url, json={"input": []})
    assert r.status_code == 400 and "'input' must not be empty" in r.json()["error"]["message"]
    r = httpx.post(url, json={"input": [101, 102]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "'input' must be a string or an array of strings"


def test_metrics_count_requests(stack):
    text = httpx.get(stack[0] + "/metrics").text
    # labelled with the model a request was routed to; "" where it was refused before (the body did not parse)
    assert metric(text, "ivy_requests_total", route="/v1/embeddings", status="200", model="all-MiniLM-L6-v2") >= 1
    assert metric(text, "ivy_requests_total", route="/v1/embeddings", status="400") >= 1
    assert metric(text, "ivy_prompt_tokens_total", model="all-MiniLM-L6-v2") >= 1
    # the native tokenizer's own counts: words remembered and found again, texts handed to tokenizers
    assert metric(text, "ivy_tokenizer_words_total", model="all-MiniLM-L6-v2", outcome="hits") >= 1
    assert metric(text, "ivy_tokenizer_words_total", model="all-MiniLM-L6-v2", outcome="misses") >= 1
    assert metric(text, "ivy_tokenizer_fallback_texts_total", model="all-MiniLM-L6-v2") >= 0


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_sigint_stops_everything(stack):
    url, proc = stack
    tulips = [int(p) for p in re.findall(r"TULIP_READY 127\.0\.0\.1:(\d+)", proc.output())]
    assert len(tulips) == 2
    assert proc.stop(signal.SIGINT) == 0
    ivy_port = int(url.rsplit(":", 1)[1])
    assert not any(_port_open(p) for p in [ivy_port, *tulips])
