"""BGE-M3's three outputs in one call (dense + sparse lexical weights + ColBERT vectors) through
the whole stack, against an independent reference written here from the formulas, on a small
random XLM-RoBERTa saved by transformers with random sparse/colbert heads; the score routes'
hybrid `weights` (FlagEmbedding's dense / lexical-match / max-sim mix) against those formulas over
the same server's /v1/embeddings outputs, and their 400s."""

import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from presets import stand_in_tokenizer
from tests.checkpoints import save_checkpoint
from tests.conftest import local_stack

SPECIALS = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}


@pytest.fixture(scope="module")
def m3(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-bge-m3")
    _, hf = save_checkpoint("xlm-roberta", d)
    stand_in_tokenizer(SPECIALS, ("<s>", "</s>"), d / "tokenizer.json")
    g = torch.Generator().manual_seed(1)
    sparse = {"weight": torch.randn(1, 64, generator=g) * 0.3, "bias": torch.tensor([0.05])}
    colbert = {"weight": torch.randn(48, 64, generator=g) * 0.2, "bias": torch.randn(48, generator=g) * 0.1}
    torch.save(sparse, d / "sparse_linear.pt")
    torch.save(colbert, d / "colbert_linear.pt")
    with local_stack(d, tmp_path_factory.mktemp("m3-stack")) as (url, _):
        yield url, d.name, hf, sparse, colbert


def reference(hf, sparse, colbert, seq):
    """Dense CLS, lexical weights and ColBERT vectors of one sequence, from the formulas."""
    with torch.no_grad():
        h = hf(input_ids=torch.tensor([seq])).last_hidden_state[0]
    w = torch.relu(h @ sparse["weight"].T + sparse["bias"]).squeeze(-1)
    lex = {}
    for tok, weight in zip(seq, w.tolist()):
        if tok in SPECIALS.values():
            continue
        if weight > lex.get(tok, 0):
            lex[tok] = weight
    col = F.normalize(h[1:] @ colbert["weight"].T + colbert["bias"], dim=-1)
    return h[0], lex, col


def lexical_match(a: dict, b: dict) -> float:
    return sum(w * b[t] for t, w in a.items() if t in b)


def maxsim(q: torch.Tensor, d: torch.Tensor) -> float:
    return (q @ d.T).max(dim=1).values.mean().item()


SEQS = [[0, 10, 11, 10, 12, 2], [0, 12, 13, 14, 12, 15, 16, 2], [0, 2], [0, 20] + list(range(30, 90)) + [2]]


def test_dense_sparse_colbert_in_one_call(m3):
    url, name, hf, sparse, colbert = m3
    r = httpx.post(url + "/v1/embeddings", timeout=60, json={
        "model": name, "input": SEQS, "return_sparse": True, "return_colbert": True})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    refs = [reference(hf, sparse, colbert, s) for s in SEQS]
    ours_lex, ours_col = [], []
    for item, seq, (dense, lex, col) in zip(data, SEQS, refs):
        assert np.abs(np.array(item["embedding"]) - dense.numpy()).max() < 1e-4
        got = {int(k): v for k, v in item["sparse_embedding"].items()}
        assert list(got) == list(lex)  # same ids, first-occurrence order
        assert max((abs(got[t] - lex[t]) for t in lex), default=0) < 1e-4
        c = torch.tensor(item["colbert_embedding"])
        assert c.shape == (len(seq) - 1, 48) and (c - col).abs().max().item() < 1e-4
        ours_lex.append(got)
        ours_col.append(c)
    for i in range(len(SEQS)):
        for j in range(len(SEQS)):
            assert lexical_match(ours_lex[i], ours_lex[j]) == pytest.approx(lexical_match(refs[i][1], refs[j][1]), abs=1e-4)
            assert maxsim(ours_col[i], ours_col[j]) == pytest.approx(maxsim(refs[i][2], refs[j][2]), abs=1e-4)


def test_text_input_sparse_tokens_and_base64_colbert(m3):
    url, name, *_ = m3
    r = httpx.post(url + "/v1/embeddings", timeout=60, json={
        "model": name, "input": ["abca"], "return_sparse": True, "return_colbert": True, "encoding_format": "base64"})
    item = r.json()["data"][0]
    assert sorted(item["sparse_tokens"].values()) == sorted(set(item["sparse_tokens"].values()))
    assert set(item["sparse_tokens"].values()) <= {"a", "b", "c"}
    vecs = np.frombuffer(base64.b64decode(item["colbert_embedding"]), dtype="<f4").reshape(-1, 48)
    assert vecs.shape == (5, 48)  # <s> a b c a </s>: every token after the first
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)


def test_models_without_heads_refuse_extras(stack_default):
    r = httpx.post(stack_default + "/v1/embeddings", json={"input": "hi", "return_colbert": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_colbert"


# BGE-M3's hybrid score on the score routes (`weights`), against FlagEmbedding's formulas over the
# same server's /v1/embeddings outputs. Byte-level tokens: texts sharing letters share token ids;
# "2026 / 42" shares none with the query.
QUERY = "tulip bulbs"
DOCS = ["tulips are spring bulbs", "a gRPC server", "2026 / 42", "bulbous tulip fields in spring", "ivy"]
LEFT, RIGHT = ["tulip", "ivy leaves", "rose"], ["a tulip bulb", "evergreen ivy", "1234"]  # N:N pairs


def outputs(url, name, texts):
    """Per text: (unit dense vector, {token id: weight}, unit ColBERT vectors) from /v1/embeddings."""
    r = httpx.post(url + "/v1/embeddings", timeout=60, json={
        "model": name, "input": texts, "return_sparse": True, "return_colbert": True})
    assert r.status_code == 200, r.text
    out = []
    for item in r.json()["data"]:
        v = np.array(item["embedding"], dtype=np.float64)
        c = np.array(item["colbert_embedding"], dtype=np.float64)
        out.append((v / np.linalg.norm(v), {int(k): w for k, w in item["sparse_embedding"].items()},
                    c / np.linalg.norm(c, axis=1, keepdims=True)))
    return out


def mode_scores(q, d):
    """FlagEmbedding's three scores of a (query, document) pair: dense dot, lexical match, max-sim."""
    return np.array([float(q[0] @ d[0]), lexical_match(q[1], d[1]), float((q[2] @ d[2].T).max(1).mean())])


def hybrid(modes, w):
    return modes @ np.asarray(w, dtype=np.float64) / sum(w)


def score(url, body):
    r = httpx.post(url + "/v1/score", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return np.array([d["score"] for d in r.json()["data"]])


def rerank(url, path, body):
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert [x["relevance_score"] for x in res] == sorted((x["relevance_score"] for x in res), reverse=True)
    return np.array([s for _, s in sorted((x["index"], x["relevance_score"]) for x in res)])


WEIGHTS = [(0.4, 0.2, 0.4), (1.0, 0.3, 1.0), (1, 0, 2)]


def test_hybrid_scores_against_the_embeddings(m3):
    url, name, *_ = m3
    q, *docs = outputs(url, name, [QUERY, *DOCS])
    modes = np.array([mode_scores(q, d) for d in docs])  # [documents, (dense, sparse, colbert)]
    assert modes[2, 1] == 0 and (modes[[0, 3], 1] > 0).all()  # no shared token; shared ones with weight
    for a in range(3):  # the three modes rank the documents apart: a mixed-up mode would show
        for b in range(a + 1, 3):
            assert np.abs(modes[:, a] - modes[:, b]).max() > 0.02
    cosine = score(url, {"model": name, "text_1": QUERY, "text_2": DOCS})  # no weights: unchanged
    np.testing.assert_allclose(cosine, modes[:, 0], atol=1e-5)
    for w in WEIGHTS:
        ref = hybrid(modes, w)
        body = {"model": name, "text_1": QUERY, "text_2": DOCS, "weights": dict(zip(("dense", "sparse", "colbert"), w))}
        np.testing.assert_allclose(score(url, body), ref, atol=1e-5)
        np.testing.assert_allclose(score(url, {**body, "weights": list(w)}), ref, atol=1e-5)  # FlagEmbedding's list
        for path in ("/v1/rerank", "/v2/rerank"):
            got = rerank(url, path, {"model": name, "query": QUERY, "documents": DOCS, "weights": body["weights"]})
            np.testing.assert_allclose(got, ref, atol=1e-5)
    for i, mode in enumerate(("dense", "sparse", "colbert")):  # one mode alone is that mode's score
        np.testing.assert_allclose(score(url, {"model": name, "text_1": [QUERY], "text_2": DOCS,
                                               "weights": {mode: 0.7}}), modes[:, i], atol=1e-5)
    top = httpx.post(url + "/v1/rerank", timeout=60, json={
        "model": name, "query": QUERY, "documents": DOCS, "top_n": 2, "weights": {"sparse": 1}}).json()["results"]
    assert [x["index"] for x in top] == list(np.argsort(-modes[:, 1], kind="stable")[:2])


def test_hybrid_scores_n_to_n(m3):
    url, name, *_ = m3
    outs = outputs(url, name, LEFT + RIGHT)
    modes = np.array([mode_scores(outs[i], outs[len(LEFT) + i]) for i in range(len(LEFT))])
    assert modes[2, 1] == 0 and (modes[:2, 1] > 0).all()
    for w in WEIGHTS:
        got = score(url, {"model": name, "text_1": LEFT, "text_2": RIGHT, "weights": list(w)})
        np.testing.assert_allclose(got, hybrid(modes, w), atol=1e-5)
    for i, mode in enumerate(("dense", "sparse", "colbert")):
        got = score(url, {"model": name, "text_1": LEFT, "text_2": RIGHT, "weights": {mode: 3}})
        np.testing.assert_allclose(got, modes[:, i], atol=1e-5)


@pytest.mark.parametrize("weights,fragment", [
    ({"dense": 1, "lexical": 1}, "unknown field `lexical`"),
    ({"dense": 1, "sparse": -0.5}, "weights.sparse must be a finite number >= 0, got -0.5"),
    ({"dense": 0, "sparse": 0, "colbert": 0}, "'weights' are all zero"),
    ({}, "'weights' are all zero"),
    ([0.4, 0.6], "3 numbers, got 2"),
    ({"dense": "1"}, "invalid value for 'weights.dense'"),
    ({"colbert": True}, "invalid value for 'weights.colbert'"),
    ("dense", "invalid value for 'weights'"),
])
def test_hybrid_weight_errors(m3, weights, fragment):
    url, name, *_ = m3
    for path, body in (("/v1/score", {"text_1": QUERY, "text_2": DOCS}), ("/v1/rerank", {"query": QUERY, "documents": DOCS})):
        r = httpx.post(url + path, json={"model": name, **body, "weights": weights}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert fragment in err["message"] and err["param"] == "weights", err
    r = httpx.post(url + "/v1/score", timeout=30, content=b'{"text_1": "a", "text_2": ["b"], "weights": {"dense": 1e999}}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "weights", r.text


def test_hybrid_weights_need_the_heads(stack_default):
    for weights, missing in (({"sparse": 1}, "sparse"), ({"dense": 1, "colbert": 0.5}, "colbert"),
                             ([1, 1, 1], "sparse and colbert")):
        for path, body in (("/v1/score", {"text_1": "a", "text_2": ["b"]}), ("/v2/rerank", {"query": "a", "documents": ["b"]})):
            r = httpx.post(stack_default + path, json={**body, "weights": weights}, timeout=30)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert f"give {missing} a weight" in err["message"] and err["param"] == "weights", err
    # dense alone needs no head: the cosine, as without weights
    body = {"text_1": "what is a tulip", "text_2": ["a spring flower", "a gRPC server"]}
    plain, dense = (httpx.post(stack_default + "/v1/score", json=b, timeout=30).json()["data"]
                    for b in (body, {**body, "weights": {"dense": 2}}))
    assert [d["score"] for d in dense] == pytest.approx([d["score"] for d in plain], abs=1e-9)
