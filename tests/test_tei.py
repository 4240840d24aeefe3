"""Hugging Face text-embeddings-inference's API on Ivy (`ivy/routes/tei.py`), real processes
(deploy.local: the default all-MiniLM-L6-v2 and five tiny random models, each with its own Tulip):
/embed against sentence-transformers (normalize, Matryoshka dimensions, prompt_name, truncation
both ways, token ids), /embed_sparse against SPLADE's SparseEncoder, /rerank and /predict against
CrossEncoder, /similarity against the cosine of encode(), /tokenize and /decode against the model's
tokenizer, GET /info, POST / dispatching as TEI's root does, TEI's error shape and statuses, and
`huggingface_hub.InferenceClient` as the client."""

import httpx
import numpy as np
import pytest

from tests.checkpoints import save_cross_encoder
from tests.checkpoints_encoders import save_distilbert, save_nomic_bert, save_splade
from tests.conftest import local_stack
from tests.sentences import SENTENCES

TEXTS = SENTENCES[:5]
QUERY = "What is the capital of France?"
LONG = " ".join(SENTENCES) * 3  # over every model's maximum here
LABELS = {0: "contradiction", 1: "entailment", 2: "neutral"}


@pytest.fixture(scope="module")
def tei(tmp_path_factory):
    """Yields (Ivy URL, {name: reference}) for the default model and tiny-nomic (prompts, normalised),
    tiny-distil (mean pooling, not normalised), tiny-splade, tiny-reranker (a BERT cross-encoder) and
    tiny-classifier (one with three labels)."""
    tmp = tmp_path_factory.mktemp("tei")
    refs = {"tiny-nomic": save_nomic_bert(tmp / "nomic"), "tiny-distil": save_distilbert(tmp / "distil"),
            "tiny-splade": save_splade(tmp / "splade")}
    ce_path, _ = save_cross_encoder("bert", tmp / "ce", max_length=64)
    cls_path, _ = save_cross_encoder("bert", tmp / "cls", num_labels=3, seed=1, id2label=LABELS,
                                     label2id={v: k for k, v in LABELS.items()})
    args = [a for name in refs for a in ("--add-model", f"{name}={tmp / name.removeprefix('tiny-')}")]
    with local_stack("default", tmp, *args, "--add-model", f"tiny-reranker={ce_path}",
                     "--add-model", f"tiny-classifier={cls_path}") as (url, proc):
        from sentence_transformers import CrossEncoder

        refs["tiny-reranker"] = CrossEncoder(str(ce_path), device="cpu")
        refs["tiny-classifier"] = CrossEncoder(str(cls_path), device="cpu")
        yield url, refs
    assert "Traceback" not in proc.output()


def post(url, body, status=200):
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def close(got, want, tol=1e-4):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=tol)


def same(a, b):
    """Two /predict rows: the same labels in the same order, scores to 1e-5 (batches differ in float32)."""
    assert [r["label"] for r in a] == [r["label"] for r in b]
    close([r["score"] for r in a], [r["score"] for r in b], 1e-5)


def unit(v):
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def test_embed_against_sentence_transformers(tei, st_model):
    url, refs = tei
    want = st_model.encode(TEXTS)
    close(post(url + "/embed", {"inputs": TEXTS}), want)
    close(post(url + "/embed", {"inputs": TEXTS[0]}), want[:1])  # one text: still a list of one vector
    close(post(url + "/embed", {"inputs": TEXTS, "dimensions": 128}), unit(want[:, :128]))
    distil = refs["tiny-distil"].encode(TEXTS)  # mean pooling, no Normalize
    assert abs(np.linalg.norm(distil, axis=1) - 1).min() > 0.01  # not unit vectors: normalize can show
    close(post(url + "/embed", {"model": "tiny-distil", "inputs": TEXTS}), unit(distil))
    close(post(url + "/embed", {"model": "tiny-distil", "inputs": TEXTS, "normalize": False}), distil)
    close(post(url + "/embed", {"model": "tiny-distil", "inputs": TEXTS, "normalize": False, "dimensions": 16}),
          distil[:, :16])
    err = post(url + "/embed", {"inputs": TEXTS, "normalize": False}, 422)  # MiniLM's pipeline normalises
    assert err["error_type"] == "Validation" and "normalize" in err["error"]


def test_embed_prompt_name_truncation_and_token_ids(tei, st_model):
    url, refs = tei
    nomic = refs["tiny-nomic"]
    got = post(url + "/embed", {"model": "tiny-nomic", "inputs": TEXTS, "prompt_name": "query"})
    close(got, nomic.encode(TEXTS, prompt_name="query"))
    assert np.abs(np.asarray(got) - nomic.encode(TEXTS)).max() > 1e-3  # the prompt changed the vectors
    err = post(url + "/embed", {"model": "tiny-nomic", "inputs": TEXTS, "prompt_name": "nope"}, 422)
    assert "'query'" in err["error"] and "'document'" in err["error"]
    # the same extension on the OpenAI-shaped routes
    oa = post(url + "/v1/embeddings", {"model": "tiny-nomic", "input": TEXTS, "prompt_name": "query"})
    close([d["embedding"] for d in oa["data"]], got, 1e-6)
    tok = post(url + "/v1/tokenize", {"model": "tiny-nomic", "input": TEXTS[0], "prompt_name": "query"})
    assert tok["data"][0]["tokens"] == nomic.tokenizer("search_query: " + TEXTS[0])["input_ids"]
    err = post(url + "/v1/embeddings", {"model": "tiny-nomic", "input": TEXTS, "prompt_name": "query",
                                        "input_type": "query"}, 400)
    assert err["error"]["param"] == "prompt_name"
    err = post(url + "/embed", {"inputs": LONG, "truncate": False}, 422)  # over the maximum: TEI's 422
    assert err["error_type"] == "Validation" and "maximum" in err["error"]
    for direction, mode in (("right", True), ("Left", "start")):
        tei_v = post(url + "/embed", {"inputs": LONG, "truncate": True, "truncation_direction": direction})
        oa = post(url + "/v1/embeddings", {"input": LONG, "truncate": mode})["data"][0]["embedding"]
        close(tei_v, [oa], 1e-6)
    close(post(url + "/embed", {"inputs": LONG}), st_model.encode([LONG]))  # TEI's default: cut, ST keeps the start
    ids = st_model.tokenizer(TEXTS[1])["input_ids"]
    close(post(url + "/embed", {"inputs": ids}), st_model.encode(TEXTS[1:2]))  # token ids: one sequence
    close(post(url + "/embed", {"inputs": [ids, ids]}), st_model.encode(TEXTS[1:2])[[0, 0]])


def test_embed_sparse_against_splade(tei):
    url, refs = tei
    got = post(url + "/embed_sparse", {"model": "tiny-splade", "inputs": TEXTS})
    want = refs["tiny-splade"].encode(TEXTS, convert_to_tensor=True).to_dense().numpy()
    assert len(got) == len(TEXTS)
    for row, ref in zip(got, want):
        idx = [e["index"] for e in row]
        assert idx == sorted(idx) and idx == np.nonzero(ref)[0].tolist() and len(idx) > 10
        close([e["value"] for e in row], ref[idx])
    assert post(url + "/", {"model": "tiny-splade", "inputs": TEXTS[0]}) == got[:1]  # TEI's root for SPLADE
    err = post(url + "/embed_sparse", {"inputs": TEXTS}, 422)  # MiniLM has no sparse output
    assert err["error_type"] == "Validation" and "/embed" in err["error"]


def test_rerank_against_cross_encoder(tei):
    url, refs = tei
    ce = refs["tiny-reranker"]
    want = ce.predict([(QUERY, d) for d in TEXTS])
    assert want.std() > 0.01
    got = post(url + "/rerank", {"model": "tiny-reranker", "query": QUERY, "texts": TEXTS, "return_text": True})
    assert [r["index"] for r in got] == np.argsort(-want, kind="stable").tolist()
    close([r["score"] for r in got], want[[r["index"] for r in got]])
    assert all(r["text"] == TEXTS[r["index"]] for r in got)
    raw = post(url + "/rerank", {"model": "tiny-reranker", "query": QUERY, "texts": TEXTS, "raw_scores": True})
    logits = ce.predict([(QUERY, d) for d in TEXTS], activation_fn=lambda x: x)
    close(sorted(r["score"] for r in raw), sorted(logits))
    assert "text" not in raw[0]
    assert post(url + "/", {"model": "tiny-reranker", "query": QUERY, "texts": TEXTS}) == \
        [{k: v for k, v in r.items() if k != "text"} for r in got]  # TEI's root for a reranker
    err = post(url + "/rerank", {"model": "tiny-reranker", "query": QUERY, "texts": []}, 400)
    assert err == {"error": "'texts' must not be empty", "error_type": "Empty"}


def test_predict_against_cross_encoder(tei):
    """/predict as TEI scores: softmax over a classifier's labels, the sigmoid of a reranker's one,
    labels by the model's id2label, best first; a text, a pair, or a batch of both."""
    url, refs = tei
    cls = refs["tiny-classifier"]
    pairs = [[QUERY, d] for d in TEXTS]
    logits = cls.predict(pairs, activation_fn=lambda x: x)
    want = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    assert want.std() > 0.01
    got = post(url + "/predict", {"model": "tiny-classifier", "inputs": pairs})
    assert len(got) == len(pairs)
    for row, p in zip(got, want):
        assert [r["label"] for r in row] == [LABELS[j] for j in np.argsort(-p, kind="stable")]
        close([r["score"] for r in row], np.sort(p)[::-1])
    one = post(url + "/predict", {"model": "tiny-classifier", "inputs": pairs[0]})  # one pair: one list
    same(one, got[0])
    raw = post(url + "/predict", {"model": "tiny-classifier", "inputs": pairs[0], "raw_scores": True})
    close(sorted(r["score"] for r in raw), sorted(logits[0]))
    import torch

    with torch.no_grad():  # one text, no pair: the classifier's logits on the tokenizer's single template
        single = cls.model(**cls.tokenizer([TEXTS[3]], return_tensors="pt")).logits.numpy()
    batch = post(url + "/predict", {"model": "tiny-classifier", "inputs": [[TEXTS[3]], pairs[1]]})
    close(sorted(r["score"] for r in batch[0]), sorted(np.exp(single[0]) / np.exp(single[0]).sum()))
    same(batch[1], got[1])
    for a, b in zip(post(url + "/", {"model": "tiny-classifier", "inputs": pairs}), got):  # TEI's root for it
        same(a, b)
    rer = post(url + "/predict", {"model": "tiny-reranker", "inputs": pairs[2]})
    close([rer[0]["score"]], refs["tiny-reranker"].predict([pairs[2]]))
    assert rer[0]["label"] == "LABEL_0"
    assert post(url + "/predict", {"inputs": "x"}, 422)["error_type"] == "Validation"  # MiniLM embeds
    assert post(url + "/predict", {"model": "tiny-classifier", "inputs": ["a", "b", "c"]}, 422)
    n = httpx.get(url + "/info").json()["max_client_batch_size"]  # the input limit holds here too
    assert "at most" in post(url + "/predict", {"model": "tiny-classifier", "inputs": [["a"]] * (n + 1)}, 422)["error"]


def test_tokenize_and_decode(tei, st_model):
    """/tokenize: ids as the model's tokenizer gives them, each token's text at its byte offsets (a
    non-ASCII text too), special tokens without offsets, prompts by name; /decode back to text."""
    url, refs = tei
    texts = ["Paris is the capital of France.", "Zürich ist größer als Genève, naïvement"]
    got = post(url + "/tokenize", {"inputs": texts})
    for text, toks in zip(texts, got):
        assert [t["id"] for t in toks] == st_model.tokenizer(text)["input_ids"]
        assert toks[0] == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
        body = [t for t in toks if not t["special"]]
        assert len(body) == len(toks) - 2
        raw = text.encode()
        for t in body:
            assert raw[t["start"]:t["stop"]].decode() == t["text"]
        assert body[-1]["stop"] == len(raw)
    assert "ö" in "".join(t["text"] for t in got[1])  # offsets in bytes landed on whole characters
    one = post(url + "/tokenize", {"inputs": texts[0], "add_special_tokens": False})
    assert [t["id"] for t in one[0]] == st_model.tokenizer(texts[0], add_special_tokens=False)["input_ids"]
    nomic = post(url + "/tokenize", {"model": "tiny-nomic", "inputs": texts[0], "prompt_name": "query"})
    assert [t["id"] for t in nomic[0]] == refs["tiny-nomic"].tokenizer("search_query: " + texts[0])["input_ids"]
    ids = [[t["id"] for t in toks] for toks in got]
    assert post(url + "/decode", {"ids": ids}) == [st_model.tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    assert post(url + "/decode", {"ids": ids[0], "skip_special_tokens": False})[0].startswith("[CLS] paris")
    assert post(url + "/decode", {"ids": [10 ** 6]}, 422)["error_type"] == "Validation"
    assert post(url + "/decode", {"ids": []}, 400)["error_type"] == "Empty"
    assert post(url + "/decode", {"ids": [[101], []]}, 400)["error_type"] == "Empty"
    assert post(url + "/decode", {"ids": [101, [102]]}, 422)["error_type"] == "Validation"  # not a mix
    assert post(url + "/tokenize", {"inputs": ["a", ""]}, 400)["error_type"] == "Empty"


def test_similarity_info_and_errors(tei, st_model):
    url, _ = tei
    body = {"inputs": {"source_sentence": QUERY, "sentences": TEXTS}}
    v = st_model.encode([QUERY, *TEXTS])
    want = unit(v[1:]) @ unit(v[0])
    close(post(url + "/similarity", body), want)
    close(post(url + "/", body), want)  # the Hub's sentence-similarity payload at the root
    info = httpx.get(url + "/info").json()
    assert info["model_id"] == "all-MiniLM-L6-v2" and info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["auto_truncate"] is True  # every TEI route cuts a long input unless told not to:
    close(post(url + "/similarity", {"inputs": {"source_sentence": LONG, "sentences": TEXTS}}),
          unit(v[1:]) @ unit(st_model.encode([LONG])[0]))
    long_pair = {"model": "tiny-reranker", "query": QUERY, "texts": [LONG, TEXTS[0]]}
    assert len(post(url + "/rerank", long_pair)) == 2
    assert post(url + "/rerank", {**long_pair, "truncate": False}, 422)["error_type"] == "Validation"
    assert len(post(url + "/predict", {"model": "tiny-reranker", "inputs": [QUERY, LONG]})) == 1
    assert info["max_input_length"] == 256 and info["model_dtype"] == "float32" and info["max_client_batch_size"] > 0
    assert post(url + "/embed", {"inputs": []}, 400) == {"error": "'inputs' must not be empty", "error_type": "Empty"}
    assert post(url + "/embed", {"inputs": 5}, 422)["error_type"] == "Validation"
    assert post(url + "/embed", {"inputs": "x", "model": "nope"}, 404)["error_type"] == "Validation"
    assert "error_type" in post(url + "/embed", {"text": "x"}, 422)
    n = info["max_client_batch_size"]  # /rerank: the query is one of them
    err = post(url + "/rerank", {"model": "tiny-reranker", "query": QUERY, "texts": ["a"] * n}, 422)
    assert f"at most {n - 1}" in err["error"]
    assert httpx.get(url + "/").status_code == 200 and httpx.get(url + "/ping").status_code == 200  # TEI's health
    close(post(url + "/invocations", {"inputs": TEXTS}), st_model.encode(TEXTS))  # SageMaker's path: the root
    spec = httpx.get(url + "/openapi.json").json()
    for path in ("/embed", "/embed_sparse", "/rerank", "/predict", "/similarity", "/tokenize", "/decode", "/"):
        assert "requestBody" in spec["paths"][path]["post"], path
    assert spec["paths"]["/embed"]["post"]["requestBody"]["content"]["application/json"]["schema"][
        "properties"]["normalize"] == {"type": "boolean", "default": True}


def test_huggingface_hub_inference_client(tei, st_model, monkeypatch):
    """huggingface_hub's InferenceClient pointed at Ivy, as at a TEI deployment. The tests run with the
    Hub offline (conftest), which blocks every request of huggingface_hub's: let this client's reach
    the loopback Ivy (a URL as `model` makes it ask nothing of the Hub)."""
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    url, _ = tei
    client = InferenceClient(model=url, token="unused")
    close(client.feature_extraction(TEXTS), st_model.encode(TEXTS))
    close(client.feature_extraction(TEXTS[0], normalize=True, truncate=True, truncation_direction="left"),
          st_model.encode(TEXTS[:1]))
    v = st_model.encode([QUERY, *TEXTS])
    close(client.sentence_similarity(QUERY, other_sentences=TEXTS), unit(v[1:]) @ unit(v[0]))
    close(InferenceClient(model=url + "/embed", token="unused").feature_extraction(TEXTS), st_model.encode(TEXTS))
