"""vLLM's `POST /v1/score` (1:N and N:N) and Cohere's `POST /v2/rerank` through a real Tulip + Ivy:
a cross-encoder's pair scores against sentence-transformers' `CrossEncoder.predict`, the default
bi-encoder's against the cosine of `SentenceTransformer.encode`; /v2/rerank against /v1/rerank;
`max_tokens_per_doc`; the 400s (`weights` on a cross-encoder); API keys, metrics and the OpenAPI document for both routes."""


import httpx
import numpy as np
import pytest
from torch import nn

from tests.checkpoints import save_cross_encoder
from tests.conftest import Proc, free_port, http_status, metric
from tests.sentences import SENTENCES

KEY = "k-score"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUERY = "What is the capital of France?"
DOCS = SENTENCES[:6]
LEFT, RIGHT = SENTENCES[6:11], SENTENCES[11:16]  # N:N pairs


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two Tulip + Ivy pairs started together: the BERT cross-encoder (its Ivy with an API key) and
    the default bi-encoder. Yields (cross-encoder URL, its path, bi-encoder URL)."""
    tmp = tmp_path_factory.mktemp("score")
    path, _ = save_cross_encoder("bert", tmp / "ce", max_length=64)
    ports = [free_port() for _ in range(4)]
    procs = [
        Proc(["-m", "tulip", "--model", str(path), "--port", str(ports[0]), "--device", "cpu"], tmp),
        Proc(["-m", "tulip", "--model", "default", "--port", str(ports[1]), "--device", "cpu"], tmp),
        Proc(["-m", "ivy", "--model", str(path), "--port", str(ports[2]), "--tulip", f"127.0.0.1:{ports[0]}",
              "--served-model-name", "tiny-reranker"], tmp, env={"IVY_API_KEYS": KEY, "IVY_MAX_CHUNK_TOKENS": "128"}),
        Proc(["-m", "ivy", "--port", str(ports[3]), "--tulip", f"127.0.0.1:{ports[1]}"], tmp),
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports[2:]]
    try:
        for proc, url in zip(procs[2:], urls):
            proc.wait_for(lambda u=url: http_status(u + "/ready") == 200)  # /ready: open without a key
        yield urls[0], path, urls[1]
    finally:
        for p in reversed(procs):
            p.stop()
    for p in procs:
        assert "Traceback" not in p.output()


@pytest.fixture(scope="module")
def ce(servers):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(servers[1]), device="cpu")


def post(url, body, headers=AUTH):
    r = httpx.post(url, json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def scores(reply):
    assert [d["index"] for d in reply["data"]] == list(range(len(reply["data"])))
    assert all(d["object"] == "score" for d in reply["data"])
    return np.array([d["score"] for d in reply["data"]])


def pair_tokens(ce, pairs):
    return sum(len(ce.tokenizer(a, b)["input_ids"]) for a, b in pairs)


def test_cross_encoder_scores_1_to_n_and_n_to_n(servers, ce):
    url = servers[0] + "/v1/score"
    one = post(url, {"model": "tiny-reranker", "text_1": QUERY, "text_2": DOCS})
    assert one["id"].startswith("score-") and one["object"] == "list" and one["model"] == "tiny-reranker"
    assert isinstance(one["created"], int)
    ref = ce.predict([(QUERY, d) for d in DOCS])
    np.testing.assert_allclose(scores(one), ref, atol=1e-4)
    assert ref.std() > 0.01  # the documents score apart: a wrong pairing would show
    n = pair_tokens(ce, [(QUERY, d) for d in DOCS])
    assert one["usage"] == {"prompt_tokens": n, "total_tokens": n}
    listed = post(url, {"text_1": [QUERY], "text_2": DOCS})  # a one-item text_1 is 1:N too
    np.testing.assert_allclose(scores(listed), scores(one), atol=1e-6)
    single = post(url, {"text_1": QUERY, "text_2": DOCS[2]})
    np.testing.assert_allclose(scores(single), ref[2:3], atol=1e-4)

    pairwise = post(url, {"text_1": LEFT, "text_2": RIGHT})
    np.testing.assert_allclose(scores(pairwise), ce.predict(list(zip(LEFT, RIGHT))), atol=1e-4)
    assert pairwise["usage"]["prompt_tokens"] == pair_tokens(ce, zip(LEFT, RIGHT))
    raw = post(url, {"text_1": LEFT, "text_2": RIGHT, "raw_scores": True})
    np.testing.assert_allclose(scores(raw), ce.predict(list(zip(LEFT, RIGHT)), activation_fn=nn.Identity()), atol=1e-4)

    long = " ".join(SENTENCES)  # cut to the maximum, longest side first, as CrossEncoder cuts it
    cut = post(url, {"text_1": QUERY, "text_2": [long, DOCS[0]], "truncate": True})
    np.testing.assert_allclose(scores(cut), ce.predict([(QUERY, long), (QUERY, DOCS[0])]), atol=1e-4)


def test_bi_encoder_scores_are_cosines(servers, st_model):
    url = servers[2] + "/v1/score"
    one = post(url, {"text_1": QUERY, "text_2": DOCS}, {})
    q, d = st_model.encode([QUERY]), st_model.encode(DOCS)
    ref = (d @ q[0]) / np.linalg.norm(d, axis=1) / np.linalg.norm(q[0])
    np.testing.assert_allclose(scores(one), ref, atol=1e-4)
    n = sum(len(st_model.tokenizer(t)["input_ids"]) for t in [QUERY, *DOCS])
    assert one["usage"] == {"prompt_tokens": n, "total_tokens": n} and one["model"] == "all-MiniLM-L6-v2"

    pairwise = post(url, {"text_1": LEFT, "text_2": RIGHT}, {})
    a, b = st_model.encode(LEFT), st_model.encode(RIGHT)
    ref = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    np.testing.assert_allclose(scores(pairwise), ref, atol=1e-4)
    assert np.ptp(ref) > 0.05


@pytest.mark.parametrize("which", [0, 2])  # the cross-encoder, the bi-encoder
def test_v2_rerank_is_v1_rerank(servers, which):
    base = servers[which]
    body = {"query": QUERY, "documents": DOCS, "top_n": 4, "return_documents": True}
    v1, v2 = post(base + "/v1/rerank", body), post(base + "/v2/rerank", body)
    assert v1["id"].startswith("rerank-") and v2["id"].startswith("rerank-") and v1["id"] != v2["id"]
    assert {k: v for k, v in v1.items() if k != "id"} == {k: v for k, v in v2.items() if k != "id"}
    assert len(v2["results"]) == 4 and v2["results"][0]["document"] == {"text": DOCS[v2["results"][0]["index"]]}
    assert v2["meta"] == {"tokens": {"input_tokens": v2["usage"]["prompt_tokens"], "output_tokens": 0}}
    # the scores are the /v1/score ones, in order
    s = scores(post(base + "/v1/score", {"text_1": QUERY, "text_2": DOCS}))
    assert [r["index"] for r in v2["results"]] == np.argsort(-s, kind="stable")[:4].tolist()
    np.testing.assert_allclose([r["relevance_score"] for r in v2["results"]], np.sort(s)[::-1][:4], atol=1e-6)


def test_max_tokens_per_doc_cuts_each_document(servers, ce):
    """Each document is cut after its first N tokens (tokenized alone) before it is paired: the
    scores are CrossEncoder's on the cut texts, and each pair counts min(N, tokens) document tokens."""
    url, n = servers[0] + "/v2/rerank", 5
    docs = SENTENCES[:8]
    enc = [ce.tokenizer(d, add_special_tokens=False, return_offsets_mapping=True) for d in docs]
    lengths = [len(e["input_ids"]) for e in enc]
    assert min(lengths) < n < max(lengths) and sum(x > n for x in lengths) >= 3  # some are cut, some not
    got = post(url, {"query": QUERY, "documents": docs, "max_tokens_per_doc": n, "return_documents": True})
    cut = [d[: e["offset_mapping"][n - 1][1]] if len(e["input_ids"]) > n else d for d, e in zip(docs, enc)]
    ref = ce.predict([(QUERY, c) for c in cut])
    by_index = {r["index"]: r["relevance_score"] for r in got["results"]}
    np.testing.assert_allclose([by_index[i] for i in range(len(docs))], ref, atol=1e-4)
    assert all(r["document"]["text"] == docs[r["index"]] for r in got["results"])  # echoed whole
    q = len(ce.tokenizer(QUERY, add_special_tokens=False)["input_ids"])
    assert got["usage"]["prompt_tokens"] == sum(q + min(n, x) + 3 for x in lengths)  # [CLS] q [SEP] d[:n] [SEP]
    assert not np.allclose(ref, ce.predict([(QUERY, d) for d in docs]), atol=1e-3)  # the cut mattered


@pytest.mark.parametrize("which,path,body,fragment,param", [
    (0, "/v1/score", {"text_1": LEFT[:3], "text_2": RIGHT[:2]}, "'text_1' has 3 texts and 'text_2' has 2", "text_1"),
    (2, "/v1/score", {"text_1": LEFT[:2], "text_2": RIGHT[0]}, "'text_1' has 2 texts and 'text_2' has 1", "text_1"),
    (0, "/v1/score", {"text_1": [], "text_2": DOCS}, "'text_1' must not be empty", "text_1"),
    (2, "/v1/score", {"text_1": QUERY, "text_2": []}, "'text_2' must not be empty", "text_2"),
    (0, "/v1/score", {"text_1": "", "text_2": DOCS}, "'text_1' is an empty string", "text_1"),
    (2, "/v1/score", {"text_1": QUERY, "text_2": ["a", ""]}, "text_2 item 1 is an empty string", "text_2"),
    (0, "/v1/score", {"text_1": LEFT[:2], "text_2": ["a", ""]}, "text_2 item 1 is an empty string", "text_2"),
    (0, "/v1/score", {"text_2": DOCS}, "'text_1' is required", "text_1"),
    (2, "/v1/score", {"text_1": 3, "text_2": DOCS}, "invalid value for 'text_1'", "text_1"),
    (2, "/v1/score", {"text_1": QUERY, "text_2": [1, 2]}, "invalid value for 'text_2[0]'", "text_2"),
    (2, "/v1/score", {"text_1": QUERY, "text_2": DOCS, "raw_scores": True}, "'raw_scores' applies to cross-encoders",
     "raw_scores"),
    (0, "/v1/score", {"text_1": QUERY, "text_2": [" ".join(SENTENCES)]}, "text_2 item 0 with text_1 has", "text_2"),
    (0, "/v1/score", {"text_1": LEFT[:2], "text_2": [DOCS[0], " ".join(SENTENCES)]}, "pair 1 (text_1, text_2) has",
     "text_2"),
    (2, "/v1/score", {"text_1": QUERY, "text_2": ["a", "word " * 300]}, "text_2 item 1 has 302 tokens", "text_2"),
    (2, "/v1/score", {"text_1": "word " * 300, "text_2": "a"}, "text_1 has 302 tokens", "text_1"),
    (0, "/v2/rerank", {"query": QUERY, "documents": DOCS, "max_tokens_per_doc": 0}, "max_tokens_per_doc must be",
     "max_tokens_per_doc"),
    (2, "/v2/rerank", {"query": QUERY, "documents": []}, "'documents' must not be empty", "documents"),
    (0, "/v1/score", {"text_1": QUERY, "text_2": DOCS, "weights": {"dense": 1}}, "is a cross-encoder", "weights"),
    (0, "/v2/rerank", {"query": QUERY, "documents": DOCS, "weights": [1, 0, 0]}, "is a cross-encoder", "weights"),
    (2, "/v1/rerank", {"query": QUERY, "documents": DOCS, "weights": {"dense": -1}}, "weights.dense must be",
     "weights"),
])
def test_errors(servers, which, path, body, fragment, param):
    r = httpx.post(servers[which] + path, json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["param"] == param, err


def test_keys_metrics_and_openapi(servers):
    url = servers[0]
    for path, body in (("/v1/score", {"text_1": QUERY, "text_2": DOCS}),
                       ("/v2/rerank", {"query": QUERY, "documents": DOCS})):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(url + path, json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        post(url + path, body)
    text = httpx.get(url + "/metrics").text
    for route in ("/v1/score", "/v2/rerank"):
        assert metric(text, "ivy_requests_total", route=route, status="200", model="tiny-reranker") >= 1
        assert metric(text, "ivy_requests_total", route=route, status="401", model="") >= 1
    paths = httpx.get(url + "/openapi.json").json()["paths"]
    score = paths["/v1/score"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"text_1", "text_2", "truncate", "raw_scores", "weights"} <= set(score["properties"])
    assert set(score["properties"]["weights"]["anyOf"][0]["properties"]) == {"dense", "sparse", "colbert"}
    assert set(score["required"]) == {"text_1", "text_2"}
    rerank = paths["/v2/rerank"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"query", "documents", "top_n", "max_tokens_per_doc", "weights"} <= set(rerank["properties"])
    assert "$ref" not in str(score) + str(rerank)  # every schema inline
