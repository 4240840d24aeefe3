"""Hugging Face text-embeddings-inference's API on Ivy (`ivy/routes/tei.py`), real processes
(deploy.local: the default all-MiniLM-L6-v2 and four tiny random models, each with its own Tulip):
/embed against sentence-transformers (normalize, Matryoshka dimensions, prompt_name, truncation
both ways, token ids), /embed_sparse against SPLADE's SparseEncoder, /rerank against
CrossEncoder.predict, /similarity against the cosine of encode(), GET /info, POST / dispatching as
TEI's root does, TEI's error shape and statuses, and `huggingface_hub.InferenceClient` as the client."""

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


@pytest.fixture(scope="module")
def tei(tmp_path_factory):
    """Yields (Ivy URL, {name: reference}) for the default model and tiny-nomic (prompts, normalised),
    tiny-distil (mean pooling, not normalised), tiny-splade and tiny-reranker (a BERT cross-encoder)."""
    tmp = tmp_path_factory.mktemp("tei")
    refs = {"tiny-nomic": save_nomic_bert(tmp / "nomic"), "tiny-distil": save_distilbert(tmp / "distil"),
            "tiny-splade": save_splade(tmp / "splade")}
    ce_path, _ = save_cross_encoder("bert", tmp / "ce", max_length=64)
    args = [a for name in refs for a in ("--add-model", f"{name}={tmp / name.removeprefix('tiny-')}")]
    with local_stack("default", tmp, *args, "--add-model", f"tiny-reranker={ce_path}") as (url, proc):
        from sentence_transformers import CrossEncoder

        refs["tiny-reranker"] = CrossEncoder(str(ce_path), device="cpu")
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
    assert err["error_type"] == "validation" and "normalize" in err["error"]


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
    err = post(url + "/embed", {"inputs": LONG}, 422)  # over the maximum, no truncate: TEI's 422
    assert err["error_type"] == "validation" and "maximum" in err["error"]
    for direction, mode in (("right", True), ("Left", "start")):
        tei_v = post(url + "/embed", {"inputs": LONG, "truncate": True, "truncation_direction": direction})
        oa = post(url + "/v1/embeddings", {"input": LONG, "truncate": mode})["data"][0]["embedding"]
        close(tei_v, [oa], 1e-6)
    close(post(url + "/embed", {"inputs": LONG, "truncate": True}), st_model.encode([LONG]))  # ST keeps the start
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
    assert err["error_type"] == "validation" and "/embed" in err["error"]


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
    assert err == {"error": "'texts' must not be empty", "error_type": "empty"}


def test_similarity_info_and_errors(tei, st_model):
    url, _ = tei
    body = {"inputs": {"source_sentence": QUERY, "sentences": TEXTS}}
    v = st_model.encode([QUERY, *TEXTS])
    want = unit(v[1:]) @ unit(v[0])
    close(post(url + "/similarity", body), want)
    close(post(url + "/", body), want)  # the Hub's sentence-similarity payload at the root
    info = httpx.get(url + "/info").json()
    assert info["model_id"] == "all-MiniLM-L6-v2" and info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] == 256 and info["model_dtype"] == "float32" and info["max_client_batch_size"] > 0
    assert post(url + "/embed", {"inputs": []}, 400) == {"error": "'inputs' must not be empty", "error_type": "empty"}
    assert post(url + "/embed", {"inputs": 5}, 422)["error_type"] == "validation"
    assert post(url + "/embed", {"inputs": "x", "model": "nope"}, 404)["error_type"] == "validation"
    assert "error_type" in post(url + "/embed", {"text": "x"}, 422)
    spec = httpx.get(url + "/openapi.json").json()
    for path in ("/embed", "/embed_sparse", "/rerank", "/similarity", "/"):
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
