"""Model extras through the whole stack: quantised outputs (a small random model in pplx-embed-v1's
published layout, with its quantizer module; its float vectors against transformers) and prompt / instruction templating, on a small random
Qwen3 with all-MiniLM's tokenizer."""

import base64
import json
import shutil

import httpx
import numpy as np
import pytest

from ivy.errors import APIError
from ivy.templates import Templates
from tests.checkpoints import save_pplx
from tests.conftest import local_stack

PROMPTS = {"query": "Instruct: Given a question, find passages\nQuery:", "document": ""}


@pytest.fixture(scope="module")
def qwen_stack(tmp_path_factory, model_path):
    d = tmp_path_factory.mktemp("tiny-qwen3")
    _, hf = save_pplx(d, vocab_size=30522)
    hf.config._attn_implementation = "eager"
    shutil.copy(model_path / "tokenizer.json", d / "tokenizer.json")
    (d / "config_sentence_transformers.json").write_text(json.dumps({"prompts": PROMPTS}))
    with local_stack(d, tmp_path_factory.mktemp("qwen-stack")) as (url, _):
        yield url, d.name, d, hf


def post(url, **body):
    return httpx.post(url + "/v1/embeddings", json=body, timeout=60)


def test_int8_and_binary_match_the_float_vectors(qwen_stack):
    url, name, _, _ = qwen_stack
    texts = ["what is a tulip", "Tulips are spring-blooming perennial herbaceous bulbiferous geophytes."]
    f = np.array([d["embedding"] for d in post(url, model=name, input=texts).json()["data"]], dtype=np.float32)
    i8 = [np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.int8)
          for d in post(url, model=name, input=texts, encoding_format="base64_int8").json()["data"]]
    bits = [np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.uint8)
            for d in post(url, model=name, input=texts, encoding_format="base64_binary").json()["data"]]
    assert np.array_equal(np.array(i8), np.rint(np.tanh(f) * 127).astype(np.int8))  # the quantizer's int8
    assert np.array_equal(np.array(bits), np.packbits(f >= 0, axis=1))
    assert bits[0].shape == (64 // 8,)
    short = post(url, model=name, input=texts, encoding_format="base64_binary", dimensions=12).json()["data"]
    assert np.frombuffer(base64.b64decode(short[0]["embedding"]), dtype=np.uint8).shape == (2,)


def test_pplx_layout_served_against_transformers(qwen_stack):
    """pplx-embed-v1's published layout through Ivy and the official openai client: the float vectors
    (text, and token ids) are transformers' bidirectional hidden states mean-pooled (no Normalize);
    base64_int8 / base64_binary are the quantizer's formula on them, for the reference's codes too
    within one step (float32 rounding may cross a .5 boundary)."""
    import openai
    import torch
    from tokenizers import Tokenizer

    from tests.checkpoints import qwen3_reference
    from tests.test_st_pipeline import assert_parity, quantize_int8, quantize_ubinary

    url, name, d, hf = qwen_stack
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    texts = ["what is a tulip", "Tulips are spring-blooming perennial herbaceous bulbiferous geophytes.", "x"]
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.no_padding()  # all-MiniLM's tokenizer.json pads to 128; Ivy sends the tokens alone
    ids = [e.ids for e in tok.encode_batch(texts)]
    ref = torch.stack([qwen3_reference(hf, s, bidirectional=True).mean(0) for s in ids])

    def create(inputs, fmt):
        r = client.embeddings.create(model=name, input=inputs, encoding_format=fmt)
        if fmt == "float":
            return torch.tensor([x.embedding for x in r.data], dtype=torch.float32)
        return np.stack([np.frombuffer(base64.b64decode(x.embedding), dtype=np.int8 if fmt == "base64_int8" else
                                       np.uint8) for x in r.data])

    f = create(texts, "float")
    assert f.shape == (3, 64)
    assert_parity(f, ref, normalized=False)
    assert_parity(create(ids, "float"), ref, normalized=False)  # token ids in: the same vectors
    i8, bits = create(texts, "base64_int8"), create(texts, "base64_binary")
    assert np.array_equal(i8, quantize_int8(f)) and np.array_equal(bits, quantize_ubinary(f))
    assert np.abs(i8.astype(int) - quantize_int8(ref).astype(int)).max() <= 1
    assert bits.shape == (3, 8) and 0.2 < np.unpackbits(bits).mean() < 0.8  # signs both ways


def test_models_without_quantised_outputs_refuse_them(stack_default):
    r = post(stack_default, input="hi", encoding_format="base64_int8")
    assert r.status_code == 400 and "base64_int8" in r.json()["error"]["message"]


def test_input_type_and_instruction_templates(qwen_stack):
    url, name, _, _ = qwen_stack
    q = "what is a tulip"

    def vec(**kw):
        return np.array(post(url, model=name, **kw).json()["data"][0]["embedding"])

    np.testing.assert_allclose(vec(input=q, input_type="query"), vec(input=PROMPTS["query"] + q), atol=1e-6)
    np.testing.assert_allclose(vec(input=q, input_type="document"), vec(input=q), atol=1e-6)
    np.testing.assert_allclose(vec(input=q, instruction="Find recipes"),
                               vec(input="Instruct: Find recipes\nQuery:" + q), atol=1e-6)
    r = post(url, model=name, input=[[101, 102]], input_type="query")
    assert r.status_code == 400 and "text inputs" in r.json()["error"]["message"]
    r = post(url, model=name, input=q, input_type="question")
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_type"


def test_templates_unit(tmp_path):
    t = Templates({"query": "q: ", "passage": "p: "}, tmp_path / "prompts.json")
    assert t.apply(["a"], "query", None) == ["q: a"]
    assert t.apply(["a"], "document", None) == ["p: a"]  # "passage" is an alias of document
    assert t.apply(["a"], None, None) == ["a"]
    with pytest.raises(APIError, match="instruction-tuned"):
        t.apply(["a"], None, "task")
    (tmp_path / "prompts.json").write_text(json.dumps({"query": "Instruct: search\nQuery:"}))
    assert t.apply(["a"], "query", None) == ["Instruct: search\nQuery:a"]  # re-read without restart
    assert t.apply(["a"], None, "find") == ["Instruct: find\nQuery:a"]
    with pytest.raises(APIError, match="documents take none"):
        t.apply(["a"], "document", "find")


@pytest.fixture(scope="module")
def prompt_excluded(tmp_path_factory, model_path):
    """all-MiniLM-L6-v2 with a query prompt and `include_prompt: false` in its pooling config (as
    INSTRUCTOR-style models ship): sentence-transformers then leaves the prompt out of mean pooling."""
    d = tmp_path_factory.mktemp("minilm-prompt-excluded") / "minilm"
    shutil.copytree(model_path, d)
    pooling = json.loads((d / "1_Pooling" / "config.json").read_text())
    (d / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "include_prompt": False}))
    st_cfg = json.loads((d / "config_sentence_transformers.json").read_text())
    st_cfg["prompts"] = {"query": "Represent this question for retrieving passages: "}
    (d / "config_sentence_transformers.json").write_text(json.dumps(st_cfg))
    with local_stack(d, tmp_path_factory.mktemp("prompt-stack")) as (url, _):
        yield url, d


def test_prompt_left_out_of_mean_pooling_matches_sentence_transformers(prompt_excluded):
    from sentence_transformers import SentenceTransformer

    url, d = prompt_excluded
    texts = ["what is a tulip", "how do search engines rank documents by relevance"]
    st = SentenceTransformer(str(d), device="cpu")
    assert st[1].include_prompt is False  # the reference really pools without the prompt
    want_q = st.encode(texts, prompt_name="query", convert_to_numpy=True)
    want_plain = st.encode(texts, convert_to_numpy=True)
    got_q = np.array([x["embedding"] for x in post(url, model=d.name, input=texts, input_type="query").json()["data"]])
    got_plain = np.array([x["embedding"] for x in post(url, model=d.name, input=texts).json()["data"]])
    cos = lambda a, b: (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)  # noqa: E731
    assert cos(got_q, want_q).min() > 0.9999 and cos(got_plain, want_plain).min() > 0.9999
    assert cos(got_q, want_plain).max() < 0.999  # the prompt still changes the vectors (it is attended to)

    # /v1/rerank embeds the query with the query prompt (left out of pooling) and the documents
    # without one, as sentence-transformers would.
    docs = ["tulips are spring flowers", "search engines rank documents", "the cat sat on the mat"]
    q = st.encode([texts[0]], prompt_name="query", normalize_embeddings=True)[0]
    dv = st.encode(docs, normalize_embeddings=True)
    r = httpx.post(url + "/v1/rerank", json={"query": texts[0], "documents": docs}, timeout=60).json()
    np.testing.assert_allclose([x["relevance_score"] for x in sorted(r["results"], key=lambda x: x["index"])],
                               dv @ q, atol=1e-4)
