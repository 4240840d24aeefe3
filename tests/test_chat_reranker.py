"""Decoder rerankers as sentence-transformers 6 publishes them: Qwen3-Reranker's layout (Qwen3ForCausalLM,
a LogitScore module on the "yes" / "no" logits, the LM head tied to the embeddings or its own) and its
Qwen3ForSequenceClassification conversion (and Llama's; Qwen2's causal LM, as mxbai-rerank-v2 is built), each with the chat template that renders a (query, document)
pair. Ivy's rendering and tokenization (`ivy.chat`: the instruction as a system message, truncation with
the template's closing tokens restored) against `CrossEncoder.preprocess`, ROSE's scores against
`CrossEncoder.predict`, how the directory is read, and a real Tulip + Ivy serving /v1/rerank,
/v1/score and TEI's /rerank."""

import asyncio
import json
import shutil

import httpx
import numpy as np
import pytest
from torch import nn

from rose.batch import Batch
from rose.engine import Engine, EngineConfig
from tests.checkpoints_decoders import RERANKER_TEMPLATE, save_chat_reranker
from tests.conftest import local_stack
from tests.test_cross_encoder import assert_preset_scores_repeat
from tests.sentences import SENTENCES
from trellis.modeldir import ModelSpec

MAX_LEN = 256
QUERY = "What is the capital of France?"
# unicode, a special-token string inside a caller's text, and one over the maximum (cut, its end restored)
DOCS = SENTENCES[:6] + ["Paris é 中文 🙂 naïve", "a <|im_end|> inside", " ".join(SENTENCES)]
PAIRS = [(QUERY, d) for d in DOCS] + [(SENTENCES[i], SENTENCES[-1 - i]) for i in range(3)]
KINDS = {"logit-tied": ("logit", True, "qwen3"), "logit-own-head": ("logit", False, "qwen3"),
         "seq-cls": ("seq-cls", True, "qwen3"), "llama-seq-cls": ("seq-cls", True, "llama"),
         "qwen2-logit": ("logit", True, "qwen2")}


@pytest.fixture(scope="module", params=list(KINDS))
def reranker(request, tmp_path_factory):
    """(kind, path, CrossEncoder, ROSE engine in float32)."""
    kind, tied, family = KINDS[request.param]
    path, ce = save_chat_reranker(tmp_path_factory.mktemp(request.param) / "r", kind, tied, max_length=MAX_LEN,
                                  family=family)
    return request.param, path, ce, Engine(EngineConfig(model=str(path), device="cpu", dtype="float32"))


def ivy_pairs(path, pairs, truncate=True, instruction=None):
    """Ivy's tokenization of the pairs, as /v1/rerank sends them."""
    from ivy.tokenizer import TextTokenizer

    spec = ModelSpec.read(path)
    tok = TextTokenizer(path, spec.max_seq_len, 1 << 20, chat_template=spec.chat_template,
                        message_format=spec.message_format)
    seqs, starts = asyncio.run(tok.encode_pairs([q for q, _ in pairs], [d for _, d in pairs], truncate,
                                                instruction=instruction))
    assert not any(starts)  # one segment: a decoder reads the pair as one text
    return [s.tolist() for s in seqs]


def reference_ids(ce, pairs, instruction=None):
    f = ce.preprocess(pairs, prompt=instruction)
    return [[i for i, m in zip(r, a) if m] for r, a in zip(f["input_ids"].tolist(), f["attention_mask"].tolist())]


@pytest.mark.parametrize("instruction", [None, "Find the sentence that names a city"])
def test_pairs_tokenized_as_sentence_transformers(reranker, instruction):
    """The rendered, tokenized pairs are CrossEncoder's own, with or without an instruction (its
    `prompt`: the system message); the long one cut to the maximum still ends in the template's end."""
    _, path, ce, _ = reranker
    got = ivy_pairs(path, PAIRS, instruction=instruction)
    assert got == reference_ids(ce, PAIRS, instruction)
    lengths = list(map(len, got))
    assert max(lengths) == MAX_LEN and min(lengths) < MAX_LEN - 20  # one is cut, the others are whole
    from tokenizers import Tokenizer

    end = Tokenizer.from_file(str(path / "tokenizer.json")).encode(  # Jinja drops the template's last newline
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n", add_special_tokens=False).ids
    assert len(end) > 20 and all(s[-len(end):] == end for s in got)
    assert ce.tokenizer.convert_tokens_to_ids("<|im_end|>") in got[DOCS.index("a <|im_end|> inside")][:-12]


def test_scores_match_cross_encoder(reranker):
    kind, path, ce, engine = reranker
    assert (engine.num_labels, engine.activation, engine.embedding_dim) == (1, "Sigmoid", 0)
    for instruction in (None, "Find the sentence that names a city"):
        seqs = ivy_pairs(path, PAIRS, instruction=instruction)
        logits = engine.step(Batch.from_sequences(seqs)).synchronize().numpy()
        raw = ce.predict(PAIRS, prompt=instruction, activation_fn=nn.Identity())
        np.testing.assert_allclose(logits[:, 0], raw, atol=2e-4)
        np.testing.assert_allclose(engine.activate(logits)[:, 0], ce.predict(PAIRS, prompt=instruction), atol=1e-4)
        assert np.ptp(raw) > 0.01  # the pairs score apart: a wrong token, row or head would show
    one = np.concatenate([engine.step(Batch.from_sequences([s])).synchronize().numpy() for s in seqs[:3]])
    np.testing.assert_allclose(one, logits[:3], atol=1e-5)  # batch invariance


def test_directory_read_as_published(reranker):
    kind, path, ce, _ = reranker
    spec = ModelSpec.read(path)
    assert spec.chat_template == RERANKER_TEMPLATE and spec.message_format == "flat"
    if KINDS[kind][0] == "logit":
        modules = json.loads((path / "modules.json").read_text())
        assert modules[1]["type"].endswith("LogitScore")
        assert spec.logit_tokens == tuple(ce.tokenizer.convert_tokens_to_ids(t) for t in ("yes", "no"))
    else:
        assert spec.logit_tokens == () and spec.config["architectures"][0].endswith("ForSequenceClassification")


def test_layout_rules(tmp_path):
    """A modules.json without the Transformer module's modality_config was saved text-only (pairs use the
    tokenizer's pair template); nothing may follow LogitScore; LogitScore needs a causal LM and ids in
    its vocabulary; a chat template that drops the query or the document is refused."""
    from ivy.chat import ChatPairs

    path, _ = save_chat_reranker(tmp_path / "r", "logit", max_length=MAX_LEN)
    st = json.loads((path / "sentence_bert_config.json").read_text())
    (path / "sentence_bert_config.json").write_text(json.dumps({"transformer_task": "text-generation"}))
    assert ModelSpec.read(path).chat_template == ""
    (path / "sentence_bert_config.json").write_text(json.dumps(st))

    modules = json.loads((path / "modules.json").read_text())
    (path / "modules.json").write_text(json.dumps(modules + [
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    with pytest.raises(ValueError, match="after LogitScore"):
        ModelSpec.read(path)
    (path / "modules.json").write_text(json.dumps(modules))

    score = path / "1_LogitScore" / "config.json"
    good = json.loads(score.read_text())
    score.write_text(json.dumps({**good, "true_token_id": 10 ** 6}))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Engine(EngineConfig(model=str(path), device="cpu"))
    score.write_text(json.dumps({**good, "true_token_id": "yes"}))
    with pytest.raises(ValueError, match="integer true_token_id"):
        ModelSpec.read(path)
    score.write_text(json.dumps(good))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3Model"]}))
    with pytest.raises(ValueError, match="causal LM"):
        Engine(EngineConfig(model=str(path), device="cpu"))

    # a chat template on an embedding model's directory is not a pair's (Ivy never renders it)
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3Model"]}))
    shutil.rmtree(path / "1_LogitScore")
    (path / "modules.json").unlink()
    assert ModelSpec.read(path).chat_template == "" and (path / "chat_template.jinja").is_file()

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'user' %}{{ m.content }}{% endif %}" \
             "<|im_end|>\n{% endfor %}"
    with pytest.raises(ValueError, match="does not render"):
        ChatPairs(chatml, "flat", tok, MAX_LEN, {})
    with pytest.raises(ValueError, match="cannot render"):
        ChatPairs("{{ raise_exception('no pairs here') }}", "flat", tok, MAX_LEN, {})
    refusing = ChatPairs("{% if 'bad' in messages[1].content %}{{ raise_exception('refused') }}{% endif %}"
                         + RERANKER_TEMPLATE, "flat", tok, MAX_LEN, {"eos_token": "<|im_end|>"})
    with pytest.raises(ValueError, match="refused"):
        refusing.encode([("q", "a bad document")], True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """deploy.local serving the LogitScore reranker (tied head) and its sequence-classification form (with
    a default prompt)."""
    from sentence_transformers import CrossEncoder

    tmp = tmp_path_factory.mktemp("served-chat")
    logit, ce_logit = save_chat_reranker(tmp / "logit", "logit", max_length=MAX_LEN)
    seqcls, _ = save_chat_reranker(tmp / "seqcls", "seq-cls", max_length=MAX_LEN, seed=1)
    # a default prompt (config_sentence_transformers.json): what predict() uses where none is sent
    st = seqcls / "config_sentence_transformers.json"
    st.write_text(json.dumps({**json.loads(st.read_text()), "prompts": {"city": "Find the sentence naming a city"},
                              "default_prompt_name": "city"}))
    ce_seqcls = CrossEncoder(str(seqcls), device="cpu")
    assert ce_seqcls.default_prompt_name == "city"
    with local_stack(str(logit), tmp, "--served-model-name", "qwen3-reranker",
                     "--add-model", f"qwen3-reranker-seq-cls={seqcls}") as (url, _):
        yield url, {"qwen3-reranker": (logit, ce_logit), "qwen3-reranker-seq-cls": (seqcls, ce_seqcls)}


@pytest.mark.parametrize("name", ["qwen3-reranker", "qwen3-reranker-seq-cls"])
def test_rerank_score_and_tei_routes(served, name):
    url, models = served
    path, ce = models[name]
    task = "Find the sentence that names a city"
    ref = ce.predict([(QUERY, d) for d in DOCS], prompt=task)
    body = {"model": name, "query": QUERY, "documents": DOCS, "truncate": True, "instruction": task}
    r = httpx.post(url + "/v1/rerank", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()["results"]
    got = [x["relevance_score"] for x in out]
    assert got == sorted(got, reverse=True) and sorted(x["index"] for x in out) == list(range(len(DOCS)))
    np.testing.assert_allclose([x["relevance_score"] for x in sorted(out, key=lambda x: x["index"])], ref, atol=1e-4)
    seqs = ivy_pairs(path, [(QUERY, d) for d in DOCS], instruction=task)
    assert r.json()["usage"]["prompt_tokens"] == sum(map(len, seqs))

    # without an instruction, the template's default; /v1/score (1:N) and TEI's /rerank give the same scores
    plain = ce.predict([(QUERY, d) for d in DOCS])
    s = httpx.post(url + "/v1/score", json={"model": name, "text_1": QUERY, "text_2": DOCS, "truncate": True},
                   timeout=60)
    assert s.status_code == 200, s.text
    np.testing.assert_allclose([x["score"] for x in s.json()["data"]], plain, atol=1e-4)
    t = httpx.post(url + "/rerank", json={"model": name, "query": QUERY, "texts": DOCS}, timeout=60)
    assert t.status_code == 200, t.text
    np.testing.assert_allclose([x["score"] for x in sorted(t.json(), key=lambda x: x["index"])], plain, atol=1e-4)

    # TEI's /predict scores pairs as /rerank does, and refuses a single text (the template renders pairs)
    pr = httpx.post(url + "/predict", json={"model": name, "inputs": [[QUERY, DOCS[0]], [QUERY, DOCS[1]]],
                                            "raw_scores": True}, timeout=60)
    assert pr.status_code == 200, pr.text
    raw = ce.predict([(QUERY, d) for d in DOCS[:2]], activation_fn=nn.Identity())
    np.testing.assert_allclose([x[0]["score"] for x in pr.json()], raw, atol=2e-4)
    one = httpx.post(url + "/predict", json={"model": name, "inputs": [[QUERY, DOCS[0]], ["alone"]]}, timeout=60)
    assert one.status_code == 422 and "input 1 is a single text" in one.json()["error"]

    # a pair over the maximum without truncate is a 400 naming it
    long = httpx.post(url + "/v1/rerank", json={"model": name, "query": QUERY, "documents": DOCS}, timeout=60)
    assert long.status_code == 400 and f"document {len(DOCS) - 1} with the query has" in long.text


def test_reranker_preset(tmp_path, monkeypatch):
    """qwen3-reranker-0.6b's preset: Qwen3-0.6B's causal LM in sentence-transformers 6's layout (LogitScore,
    the chat template), read as the published directory is; Ivy renders its pairs (the stand-in's chat
    tokens special), and its random weights run (a copy at small widths: the full one is 600M parameters)
    with the LogitScore rows taken from the random tied embeddings: the same scores from two engines,
    apart across pairs."""
    from ivy.chat import ChatPairs, special_tokens
    from tokenizers import Tokenizer
    from trellis.modelref import resolve_model_path
    from presets import PRESETS

    monkeypatch.setenv("TRELLIS_CACHE", str(tmp_path / "cache"))
    path = resolve_model_path("preset:qwen3-reranker-0.6b")
    spec = ModelSpec.read(path)
    assert spec.config["architectures"] == ["Qwen3ForCausalLM"] and spec.message_format == "flat"
    assert len(spec.logit_tokens) == 2 and spec.chat_template and spec.max_seq_len == 32768
    pairs = ChatPairs(spec.chat_template, spec.message_format, Tokenizer.from_file(str(path / "tokenizer.json")),
                      spec.max_seq_len, special_tokens(path))
    seqs = pairs.encode([(QUERY, d) for d in DOCS[:4]], True)
    assert all(s[0] == 2 and list(s).count(3) == 2 for s in seqs)  # <|im_start|> first, two <|im_end|>

    small = tmp_path / "small"
    shutil.copytree(path, small)
    config = PRESETS["qwen3-reranker-0.6b"]["config"]
    (small / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                                   "intermediate_size": 128}))
    assert_preset_scores_repeat(small, [s.tolist() for s in seqs], None, max_seq_len=32768)


def test_default_prompt_name(tmp_path):
    """config_sentence_transformers.json's default_prompt_name: the prompt an input gets when the request
    names none (Templates.prefix), and a name that is not one of the prompts refused at load."""
    from ivy.templates import Templates

    t = Templates({"query": "q: ", "city": "Find a city: "}, None, "city")
    assert (t.prefix(None, None), t.prefix("query", None), t.prefix(None, None, "query")) == ("Find a city: ", "q: ", "q: ")
    assert Templates({"query": "q: "}, None).prefix(None, None) == ""
    path, _ = save_chat_reranker(tmp_path / "r", "seq-cls", max_length=MAX_LEN)
    st = path / "config_sentence_transformers.json"
    st.write_text(json.dumps({**json.loads(st.read_text()), "prompts": {}, "default_prompt_name": "web"}))
    with pytest.raises(ValueError, match="default_prompt_name 'web' is not one of its prompts"):
        ModelSpec.read(path)
