"""Several models behind one Ivy (issue #16), real processes (deploy.local --add-model): the
default all-MiniLM-L6-v2, a tiny random NomicBERT (its own tokenizer, query / document prompts,
64 dimensions) and a tiny random BERT cross-encoder, each with its own Tulip, routed by `model` on
every route: each model's embeddings against its own reference (sentence-transformers, and the
engine on the ids Ivy's /v1/tokenize gives for it), scores against CrossEncoder.predict,
/v1/models listing all three, an unknown model OpenAI's 404 everywhere, metrics by model; the
official openai client."""

import functools
import json

import httpx
import numpy as np
import openai
import pytest

from tests.checkpoints import save_cross_encoder
from tests.checkpoints_encoders import save_nomic_bert
from tests.conftest import local_stack, metric
from tests.sentences import SENTENCES

DEFAULT = "all-MiniLM-L6-v2"
TEXTS = SENTENCES[:5]
QUERY = "What is the capital of France?"


@pytest.fixture(scope="module")
def several(tmp_path_factory):
    """Yields (Ivy URL, NomicBERT path, its SentenceTransformer, cross-encoder path)."""
    tmp = tmp_path_factory.mktemp("several")
    nomic_path = tmp / "nomic"
    nomic_ref = save_nomic_bert(nomic_path)
    ce_path, _ = save_cross_encoder("bert", tmp / "ce", max_length=64)
    with local_stack("default", tmp, "--add-model", f"tiny-nomic={nomic_path}",
                     "--add-model", f"tiny-reranker={ce_path}") as (url, proc):
        yield url, nomic_path, nomic_ref, ce_path
    assert "Traceback" not in proc.output()


@pytest.fixture(scope="module")
def client(several):
    return openai.OpenAI(base_url=several[0] + "/v1", api_key="unused", max_retries=0)


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def post(url, body, status=200):
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def test_models_lists_every_model(several, client):
    assert [m.id for m in client.models.list().data] == [DEFAULT, "tiny-nomic", "tiny-reranker"]
    assert client.models.retrieve("tiny-reranker").id == "tiny-reranker"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_embeddings_go_to_each_models_own_tulip(several, client, st_model):
    url, _, nomic_ref, _ = several
    default = client.embeddings.create(input=TEXTS, model=DEFAULT)
    assert default.model == DEFAULT and len(default.data[0].embedding) == 384
    assert cosines([d.embedding for d in default.data], st_model.encode(TEXTS)).min() > 0.9999
    nomic = client.embeddings.create(input=TEXTS, model="tiny-nomic")
    assert nomic.model == "tiny-nomic" and len(nomic.data[0].embedding) == 64
    assert cosines([d.embedding for d in nomic.data], nomic_ref.encode(TEXTS)).min() > 0.9999
    # the model's own prompts (Ivy's templates for that model's directory)
    q = client.embeddings.create(input=TEXTS, model="tiny-nomic", extra_body={"input_type": "query"})
    assert cosines([d.embedding for d in q.data], nomic_ref.encode(TEXTS, prompt_name="query")).min() > 0.9999
    # no `model`: the default, as before
    r = post(url + "/v1/embeddings", {"input": TEXTS})
    assert r["model"] == DEFAULT
    np.testing.assert_allclose([d["embedding"] for d in r["data"]], [d.embedding for d in default.data], atol=1e-6)
    assert r["usage"]["prompt_tokens"] == default.usage.prompt_tokens != nomic.usage.prompt_tokens


def test_tokenize_and_the_engine_per_model(several):
    """Each model's tokenizer and maximum length: the ids /v1/tokenize gives for the NomicBERT are its
    tokenizer's, and that model's engine on them is what /v1/embeddings returns for it."""

    from rose.batch import Batch
    from rose.engine import Engine, EngineConfig

    url, nomic_path, nomic_ref, _ = several
    toks = {m: post(url + "/v1/tokenize", {"model": m, "input": TEXTS}) for m in (DEFAULT, "tiny-nomic")}
    assert toks["tiny-nomic"]["model"] == "tiny-nomic"
    ids = [d["tokens"] for d in toks["tiny-nomic"]["data"]]
    assert ids == nomic_ref.tokenizer(TEXTS)["input_ids"]
    assert ids != [d["tokens"] for d in toks[DEFAULT]["data"]]
    assert post(url + "/v1/tokenize", {"model": "tiny-reranker", "input": "x"})["max_model_len"] == 64
    engine = Engine(EngineConfig(model=str(nomic_path), device="cpu", dtype="float32"))
    direct = engine.step(Batch.from_sequences(ids)).synchronize()
    served = post(url + "/v1/embeddings", {"model": "tiny-nomic", "input": ids})["data"]
    assert cosines([d["embedding"] for d in served], direct.numpy()).min() > 0.99999


def test_scores_go_to_the_cross_encoder(several):
    from sentence_transformers import CrossEncoder

    url, _, _, ce_path = several
    want = CrossEncoder(str(ce_path), device="cpu").predict([(QUERY, d) for d in TEXTS])
    for path in ("/v1/rerank", "/v2/rerank"):
        r = post(url + path, {"model": "tiny-reranker", "query": QUERY, "documents": TEXTS})
        assert r["model"] == "tiny-reranker"
        got = {x["index"]: x["relevance_score"] for x in r["results"]}
        np.testing.assert_allclose([got[i] for i in range(len(TEXTS))], want, atol=1e-5)
    r = post(url + "/v1/score", {"model": "tiny-reranker", "text_1": QUERY, "text_2": TEXTS})
    np.testing.assert_allclose([d["score"] for d in r["data"]], want, atol=1e-5)
    # the default bi-encoder scores by cosine; the cross-encoder gives no embeddings
    r = post(url + "/v1/score", {"text_1": QUERY, "text_2": TEXTS})
    assert r["model"] == DEFAULT and not np.allclose([d["score"] for d in r["data"]], want, atol=1e-3)
    e = post(url + "/v1/embeddings", {"model": "tiny-reranker", "input": "hi"}, 400)["error"]
    assert e["code"] == "model_not_embedding" and "tiny-reranker" in e["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/embeddings", {"input": "hi"}),
    ("/v1/rerank", {"query": "q", "documents": ["d"]}),
    ("/v2/rerank", {"query": "q", "documents": ["d"]}),
    ("/v1/score", {"text_1": "q", "text_2": ["d"]}),
    ("/v1/tokenize", {"input": "hi"}),
])
def test_an_unknown_model_is_openais_404(several, path, body):
    e = post(several[0] + path, {**body, "model": "gpt-nope"}, 404)["error"]
    assert e["code"] == "model_not_found" and e["type"] == "invalid_request_error" and e["param"] == "model"
    assert "'gpt-nope'" in e["message"] and "'tiny-nomic'" in e["message"]


def test_openai_client_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(input="hi", model="gpt-nope")
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"


def test_metrics_carry_the_model(several, client):
    url = several[0]
    client.embeddings.create(input="hi", model="tiny-nomic")
    post(url + "/v1/embeddings", {"input": "hi", "model": "gpt-nope"}, 404)
    post(url + "/v1/score", {"model": "tiny-reranker", "text_1": QUERY, "text_2": TEXTS})
    httpx.get(url + "/v1/models/tiny-nomic")
    text = httpx.get(url + "/metrics").text
    requests = functools.partial(metric, text, "ivy_requests_total")
    assert requests(route="/v1/embeddings", status="200", model="tiny-nomic") >= 1
    assert requests(route="/v1/embeddings", status="404", model="") >= 1  # the unknown name is not a label
    assert requests(route="/v1/score", status="200", model="tiny-reranker") >= 1
    assert requests(route="/v1/models/{model_id}", status="200", model="tiny-nomic") >= 1
    assert requests(route="/v1/embeddings", status="200", model="tiny-reranker") == 0
    assert metric(text, "ivy_prompt_tokens_total", model="tiny-reranker") >= len(TEXTS)
    assert metric(text, "ivy_request_seconds_count", model="tiny-nomic") >= 1
    assert "gpt-nope" not in text


def test_ready_waits_for_every_model(tulip_server, tmp_path):
    """/ready is 200 only when each model has a Tulip answering; the one without is named, and the
    other model serves meanwhile. A model whose Tulips serve another vocabulary (a mixed-up
    configuration) is refused, not answered with another model's vectors."""
    import time

    from tests.conftest import Proc, free_port, http_status

    port = free_port()
    models = tmp_path / "models.json"
    save_nomic_bert(tmp_path / "nomic")
    models.write_text(json.dumps({"models": [{"name": "second", "model": "default",
                                              "tulip": [f"127.0.0.1:{free_port()}"]},
                                             {"name": "mixed-up", "model": str(tmp_path / "nomic"),
                                              "tulip": [tulip_server[0]]}]}))
    ivy = Proc(["-m", "ivy", "--port", str(port), "--tulip", tulip_server[0], "--model-config", str(models)], tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        ivy.wait_for(lambda: http_status(url + "/health") == 200, timeout=60)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [DEFAULT, "second", "mixed-up"]
        assert post(url + "/v1/embeddings", {"input": "hi"})["model"] == DEFAULT
        deadline = time.monotonic() + 30
        while True:  # the first model's worker has its Info once it has answered
            r = httpx.get(url + "/ready", timeout=10)
            assert r.status_code == 503, r.text
            if DEFAULT not in r.json()["error"]["message"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.json()["error"]["message"].endswith("for 'second'"), r.text
        e = post(url + "/v1/embeddings", {"input": "hi", "model": "second"}, 503)["error"]
        assert "'second'" in e["message"] and e["code"] == "replica_unavailable"
        e = post(url + "/v1/embeddings", {"input": "hi", "model": "mixed-up"}, 503)["error"]
        assert e["code"] == "model_mismatch" and "vocabulary of 30522" in e["message"], e
    finally:
        assert ivy.stop() == 0


def test_deploy_local_add_model_needs_a_name_and_a_model():
    import subprocess
    import sys

    from tests.conftest import ROOT

    r = subprocess.run([sys.executable, "-m", "deploy.local", "--add-model", "just-a-path"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "'just-a-path' is not NAME=MODEL" in r.stderr, r.stderr
