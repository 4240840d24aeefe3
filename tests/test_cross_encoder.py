"""Cross-encoders (`BertForSequenceClassification`, `DistilBertForSequenceClassification`,
`ElectraForSequenceClassification`, `DebertaV2ForSequenceClassification`,
`XLMRobertaForSequenceClassification`, `RobertaForSequenceClassification`,
`ModernBertForSequenceClassification` with either `classifier_pooling`): ROSE's scores against
sentence-transformers' `CrossEncoder.predict` (and transformers' logits) on the same tiny random
checkpoints, the second segment's token types, several labels and a saved activation, the graph
path, and a real Tulip + Ivy serving each family's `/v1/rerank` (with its errors)."""

import asyncio
import json
import shutil

import grpc
import httpx
import numpy as np
import pytest
import torch
from torch import nn

from rose.batch import Batch
from rose.engine import Engine, EngineConfig
from tests.checkpoints import save_cross_encoder
from tests.conftest import Proc, free_port, http_status
from tests.sentences import SENTENCES
from trellis.tulip.v1 import tulip_pb2
from trellis.client import TulipClient, pack
from tulip.server import parse_request

MAX_LEN = 64
QUERY = "What is the capital of France?"
DOCS = SENTENCES[:12] + [" ".join(SENTENCES)]  # the last one is cut (truncate) to MAX_LEN with the query
PAIRS = [(QUERY, d) for d in DOCS] + [(SENTENCES[i], SENTENCES[-1 - i]) for i in range(8)]
# fixture param -> save_cross_encoder's family and overrides (ModernBERT: both classifier_pooling modes;
# the mean one with a bias on its head's dense layer, the published default being none)
FAMILIES = {"bert": ("bert", {}), "distilbert": ("distilbert", {}), "electra": ("electra", {}),
            "deberta-v2": ("deberta-v2", {}),
            "xlm-roberta": ("xlm-roberta", {}),
            "roberta": ("roberta", {}),
            "modernbert-cls": ("modernbert", {"classifier_pooling": "cls"}),
            "modernbert-mean": ("modernbert", {"classifier_pooling": "mean", "classifier_bias": True})}


def save_family(param, path, **kw):
    family, overrides = FAMILIES[param]
    return save_cross_encoder(family, path, max_length=MAX_LEN, **overrides, **kw)


def pair_ids(path, pairs, truncate=True):
    """Ivy's tokenization of the pairs (what /v1/rerank sends): ids and second-segment starts."""
    from ivy.tokenizer import TextTokenizer

    tok = TextTokenizer(path, MAX_LEN, 1 << 20, backend="tokenizers")

    async def enc():
        seqs, starts = [], []
        for q, d in pairs:
            s, st = await tok.encode_pairs(q, [d], truncate)
            seqs += s
            starts += st
        return seqs, starts

    return asyncio.run(enc())


@pytest.fixture(scope="module", params=list(FAMILIES))
def cross(request, tmp_path_factory):
    """(family, model dir, CrossEncoder, ROSE engine); family is FAMILIES' key."""
    from sentence_transformers import CrossEncoder

    path, _ = save_family(request.param, tmp_path_factory.mktemp(request.param) / "ce")
    return (request.param, path, CrossEncoder(str(path), device="cpu"),
            Engine(EngineConfig(model=str(path), device="cpu", dtype="float32")))


def scores(engine, seqs, starts):
    return engine.step(Batch.from_sequences(seqs, None, starts)).synchronize().numpy()


def test_tokenized_as_sentence_transformers(cross):
    """Ivy's pairs are the reference tokenizer's `tokenizer(query, document)`, truncated longest-first
    to the maximum as CrossEncoder cuts them, and the segment start is where its token types turn 1."""
    family, path, ce, _ = cross
    seqs, starts = pair_ids(path, PAIRS)
    ref = ce.tokenizer([q for q, _ in PAIRS], [d for _, d in PAIRS], truncation="longest_first",
                       max_length=ce.max_seq_length, return_token_type_ids=True)
    assert ce.max_seq_length == MAX_LEN and max(map(len, seqs)) == MAX_LEN  # one pair is cut
    assert [s.tolist() for s in seqs] == ref["input_ids"]
    assert [t.index(1) if 1 in t else 0 for t in ref["token_type_ids"]] == starts
    if family in ("xlm-roberta", "roberta"):  # XLM-R's template types every token 0
        assert not any(starts)
    else:  # BERT's (the ModernBERT and DistilBERT checkpoints' too, though they do not read them) types the document 1
        assert all(starts)


def test_scores_match_cross_encoder(cross):
    family, path, ce, engine = cross
    assert engine.num_labels == 1 and engine.activation == "Sigmoid" and engine.embedding_dim == 0
    seqs, starts = pair_ids(path, PAIRS)
    logits = scores(engine, seqs, starts)
    assert logits.shape == (len(PAIRS), 1)
    np.testing.assert_allclose(engine.activate(logits)[:, 0], ce.predict(PAIRS), atol=1e-4)
    raw = ce.predict(PAIRS, activation_fn=nn.Identity())
    np.testing.assert_allclose(logits[:, 0], raw, atol=1e-4)
    assert raw.std() > 0.05  # the pairs score apart: a wrong token or type would show
    # batch invariance: one pair at a time gives the same scores
    one = np.concatenate([scores(engine, [s], [st]) for s, st in zip(seqs[:4], starts[:4])])
    np.testing.assert_allclose(one, logits[:4], atol=1e-5)


def test_second_segment_token_types_are_used(cross):
    """BERT and ELECTRA number the document's tokens type 1: dropping the segment starts changes the
    scores (and breaks parity); XLM-R and RoBERTa have one token type and ModernBERT, DistilBERT and
    DeBERTa-v3 none, so they change nothing."""
    family, path, ce, engine = cross
    seqs, starts = pair_ids(path, PAIRS[:6])
    raw = ce.predict(PAIRS[:6], activation_fn=nn.Identity())
    with_types = scores(engine, seqs, starts)[:, 0]
    if family not in ("bert", "electra"):
        for other in ([3] * len(seqs), None):  # any boundary, or none: one token type
            np.testing.assert_allclose(scores(engine, seqs, other)[:, 0], with_types, atol=1e-6)
        np.testing.assert_allclose(with_types, raw, atol=1e-4)
        return
    dropped = scores(engine, seqs, None)[:, 0]
    np.testing.assert_allclose(with_types, raw, atol=1e-4)
    assert np.abs(dropped - raw).min() > 1e-3


def test_graph_runner_pads_segments_like_eager(cross):
    """The CUDA-graph path (CUDA calls faked): segment starts staged and padded to the bucket give the
    eager step's scores, the output is the [N, num_labels] row block."""
    from rose.graphs import GraphConfig, GraphRunner
    from tests.test_graphs import FakeOps

    family, path, _, engine = cross
    seqs, starts = pair_ids(path, PAIRS[:5])
    batch = Batch.from_sequences(seqs, None, starts)
    runner = GraphRunner(lambda *a: _masked(engine, *a), lambda *a: None, engine.num_labels, torch.device("cpu"),
                         GraphConfig(max_tokens=2048, max_seqs=16, ring=3), ops=FakeOps(), segments=True)
    ref = engine.step(batch).synchronize()
    for _ in range(3):  # eager, capture, replay
        got = runner.step(batch).synchronize()
        assert got.shape == (5, 1)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    plain = Batch.from_sequences(seqs)  # no second segments: zeros staged over the earlier starts
    torch.testing.assert_close(runner.step(plain).synchronize(), engine.step(plain).synchronize(), atol=1e-5, rtol=0)


def _masked(engine, *args):
    """The engine's step on a capturable CPU backend: the block-diagonal mask, or for a per-sequence
    score bias (DeBERTa) the padded batch."""
    from rose.layers.attention import PaddedBackend
    from tests.test_graphs import MaskedAttention

    saved, engine.attention = engine.attention, PaddedBackend() if engine.model.sequence_bias else MaskedAttention()
    try:
        return engine._scores(*args)
    finally:
        engine.attention = saved


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_modernbert_head_as_transformers(tmp_path, pooling):
    """ModernBertForSequenceClassification's logits from transformers itself (a padded batch, its
    attention mask: mean pooling over each pair's tokens, special ones included) equal ROSE's; the
    head reads config.json's `classifier_pooling` (the other mode scores otherwise, and as
    transformers does with it); the head's tensors are loaded strictly; an unknown mode is refused."""
    import safetensors.torch
    import transformers

    path, hf = save_family(f"modernbert-{pooling}", tmp_path / "ce", num_labels=2)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    feats = tok([q for q, _ in PAIRS], [d for _, d in PAIRS], truncation="longest_first", max_length=MAX_LEN,
                padding=True, return_tensors="pt")
    assert "token_type_ids" not in feats and (feats["attention_mask"] == 0).any()  # padded rows
    with torch.no_grad():
        ref = hf(**feats).logits.numpy()
    seqs, starts = pair_ids(path, PAIRS)
    engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    assert engine.num_labels == 2 and engine.model.classifier_pooling(engine.spec.config) == pooling
    got = scores(engine, seqs, starts)
    np.testing.assert_allclose(got, ref, atol=1e-4)

    other = {"cls": "mean", "mean": "cls"}[pooling]
    flipped = tmp_path / "flipped"
    shutil.copytree(path, flipped)
    cfg = json.loads((flipped / "config.json").read_text())
    (flipped / "config.json").write_text(json.dumps({**cfg, "classifier_pooling": other}))
    flip = scores(Engine(EngineConfig(model=str(flipped), device="cpu", dtype="float32")), seqs, starts)
    assert np.abs(flip - got).max() > 0.1
    hf.config.classifier_pooling = other
    with torch.no_grad():
        np.testing.assert_allclose(flip, hf(**feats).logits.numpy(), atol=1e-4)

    tensors = safetensors.torch.load_file(str(path / "model.safetensors"))
    assert {k for k in tensors if not k.startswith("model.")} >= {"head.dense.weight", "head.norm.weight",
                                                                   "classifier.weight", "classifier.bias"}
    del tensors["head.norm.weight"]
    safetensors.torch.save_file(tensors, str(flipped / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors for: \['head\.norm\.weight'\]"):
        Engine(EngineConfig(model=str(flipped), device="cpu", dtype="float32"))
    (flipped / "config.json").write_text(json.dumps({**cfg, "classifier_pooling": "max"}))
    with pytest.raises(ValueError, match="unsupported classifier_pooling 'max'"):
        Engine(EngineConfig(model=str(flipped), device="cpu", dtype="float32"))


def test_several_labels_and_a_saved_activation(tmp_path):
    """num_labels 3: the three logits per pair (Identity, CrossEncoder's default for several labels);
    an activation saved by sentence-transformers (config_sentence_transformers.json) is followed."""
    from sentence_transformers import CrossEncoder

    path, _ = save_cross_encoder("bert", tmp_path / "three", num_labels=3, max_length=MAX_LEN, seed=1)
    engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    assert (engine.num_labels, engine.activation) == (3, "Identity")
    seqs, starts = pair_ids(path, PAIRS)
    got = engine.activate(scores(engine, seqs, starts))
    np.testing.assert_allclose(got, CrossEncoder(str(path), device="cpu").predict(PAIRS), atol=1e-4)

    one, _ = save_cross_encoder("xlm-roberta", tmp_path / "one", max_length=MAX_LEN)
    CrossEncoder(str(one), device="cpu", activation_fn=nn.Tanh()).save_pretrained(str(tmp_path / "tanh"))
    assert "Tanh" in json.loads((tmp_path / "tanh" / "config_sentence_transformers.json").read_text())["activation_fn"]
    engine = Engine(EngineConfig(model=str(tmp_path / "tanh"), device="cpu", dtype="float32"))
    assert engine.activation == "Tanh"
    seqs, starts = pair_ids(tmp_path / "tanh", PAIRS)
    ref = CrossEncoder(str(tmp_path / "tanh"), device="cpu").predict(PAIRS)
    np.testing.assert_allclose(engine.activate(scores(engine, seqs, starts))[:, 0], ref, atol=1e-4)


def assert_preset_scores_repeat(small, seqs, starts, max_seq_len: int) -> None:
    """A one-label Sigmoid preset (random weights, a small copy): two engines give the same finite
    scores, apart across pairs."""
    got = []
    for _ in range(2):
        engine = Engine(EngineConfig(model=str(small), device="cpu", dtype="float32"))
        assert (engine.num_labels, engine.activation, engine.spec.max_seq_len) == (1, "Sigmoid", max_seq_len)
        got.append(scores(engine, seqs, starts)[:, 0])
    np.testing.assert_array_equal(got[0], got[1])
    assert np.isfinite(got[0]).all() and np.ptp(got[0]) > 1e-6


def test_reranker_preset_fills_its_head_with_random_weights(tmp_path):
    """bge-reranker-v2-m3's config builds XLM-R large with XLMRobertaForSequenceClassification's head
    (dense 1024 x 1024, out_proj 1 x 1024); as a preset (RANDOM_WEIGHTS) the engine fills every one of
    its parameters with the seeded values: the same scores from two engines, apart across pairs. (A
    copy with the preset's config at small widths: the full one is 560M parameters.)"""
    from rose.models import model_class
    from trellis.modeldir import ModelSpec
    from presets import PRESETS, RANDOM_WEIGHTS

    config = PRESETS["bge-reranker-v2-m3"]["config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    family = model_class(ModelSpec.read(tmp_path))
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in family(config).named_parameters() if k.startswith("classifier.")}
    assert shapes == {"classifier.dense.weight": (1024, 1024), "classifier.dense.bias": (1024,),
                      "classifier.out_proj.weight": (1, 1024), "classifier.out_proj.bias": (1,)}
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "intermediate_size": 128,
                                                   "vocab_size": 1000, "max_position_embeddings": 130}))
    (small / RANDOM_WEIGHTS).write_text("preset test\n")
    seqs = [[0, 5 + i, 17, 2, 2, 40 + 3 * i, 41, 2] for i in range(6)]
    assert_preset_scores_repeat(small, seqs, None, max_seq_len=128)


def test_modernbert_reranker_preset(tmp_path, monkeypatch):
    """gte-reranker-modernbert-base's preset: gte-modernbert-base's shapes with
    ModernBertForSequenceClassification's head (head dense 768 x 768 without bias, its norm, classifier
    1 x 768), mean classifier pooling, a byte-level stand-in tokenizer that pairs as BERT's template
    (Ivy scores pairs with it); its random weights run (a copy at small widths: the full one is 150M
    parameters), the same scores from two engines, apart across pairs."""
    from rose.models import model_class
    from trellis.modeldir import ModelSpec
    from trellis.modelref import resolve_model_path
    from presets import PRESETS

    monkeypatch.setenv("TRELLIS_CACHE", str(tmp_path / "cache"))
    path = resolve_model_path("preset:gte-reranker-modernbert-base")
    spec = ModelSpec.read(path)
    family = model_class(spec)
    assert (family.num_labels(spec.config), family.classifier_pooling(spec.config)) == (1, "mean")
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in family(spec.config).named_parameters()
                  if not k.startswith(("embeddings.", "layers.", "final_norm."))}
    assert shapes == {"head.dense.weight": (768, 768), "head.norm.weight": (768,), "classifier.weight": (1, 768),
                      "classifier.bias": (1,)}
    seqs, starts = pair_ids(path, PAIRS[:6])
    assert all(s[0] == 2 and s[starts[i] - 1] == 3 and s[-1] == 3 for i, s in enumerate(seqs))  # [CLS] q [SEP] d [SEP]

    small = tmp_path / "small"
    shutil.copytree(path, small)
    config = PRESETS["gte-reranker-modernbert-base"]["config"]
    (small / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "intermediate_size": 96,
                                                   "vocab_size": 300, "local_attention": 16}))
    assert_preset_scores_repeat(small, seqs, starts, max_seq_len=8192)


def test_segment_starts_only_for_cross_encoders():
    """An embedding model's Tulip refuses segment_starts and raw_scores (checked before queueing)."""
    info = tulip_pb2.InfoReply(embedding_dim=8, max_seq_len=16, vocab_size=100, outputs=[tulip_pb2.OUTPUT_DENSE],
                               encodings=[tulip_pb2.ENCODING_FLOAT32])
    ids, lengths = pack([[1, 2, 3]])
    for kw, fragment in (({"segment_starts": [1]}, "only a cross-encoder"), ({"raw_scores": True}, "no scores")):
        with pytest.raises(ValueError, match=fragment):
            parse_request(tulip_pb2.EmbedRequest(token_ids=ids, lengths=lengths, **kw), info)


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    """A real Tulip serving one FAMILIES cross-encoder and an Ivy in front of it (a small chunk
    budget: a rerank's pairs go to Tulip in several requests): (Ivy URL, Tulip target, path)."""
    tmp = tmp_path_factory.mktemp("served-" + request.param)
    path, _ = save_family(request.param, tmp / "ce")
    tport, port = free_port(), free_port()
    tulip = Proc(["-m", "tulip", "--model", str(path), "--port", str(tport), "--device", "cpu",
                  "--served-model-name", "tiny-reranker"], tmp)
    ivy = Proc(["-m", "ivy", "--model", str(path), "--port", str(port), "--tulip", f"127.0.0.1:{tport}",
                "--served-model-name", "tiny-reranker"], tmp, env={"IVY_MAX_CHUNK_TOKENS": "128"})  # chunks: pairs split
    try:
        tulip.wait_for(lambda: "TULIP_READY" in tulip.output())
        ivy.wait_for(lambda: http_status(f"http://127.0.0.1:{port}/ready") == 200)
        yield f"http://127.0.0.1:{port}", f"127.0.0.1:{tport}", path
    finally:
        ivy.stop()
        tulip.stop()


def test_rerank_matches_cross_encoder(served):
    from sentence_transformers import CrossEncoder

    url, _, path = served
    ce = CrossEncoder(str(path), device="cpu")
    ref = ce.predict([(QUERY, d) for d in DOCS])
    body = {"model": "tiny-reranker", "query": QUERY, "documents": DOCS, "truncate": True}
    r = httpx.post(url + "/v1/rerank", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [x["index"] for x in out["results"]] == np.argsort(-ref, kind="stable").tolist()
    np.testing.assert_allclose([x["relevance_score"] for x in out["results"]], np.sort(ref)[::-1], atol=1e-4)
    seqs, _ = pair_ids(path, [(QUERY, d) for d in DOCS])
    assert out["usage"]["prompt_tokens"] == sum(map(len, seqs))
    assert out["model"] == "tiny-reranker" and "document" not in out["results"][0]

    # the logits, every one: the sigmoid can squeeze the scores together (XLM-R's sit near 1 here)
    raw = ce.predict([(QUERY, d) for d in DOCS], activation_fn=nn.Identity())
    assert np.ptp(raw) > 0.5  # the documents score apart: a wrong token or score would show
    got = httpx.post(url + "/v1/rerank", json={**body, "raw_scores": True}, timeout=60).json()["results"]
    np.testing.assert_allclose([x["relevance_score"] for x in sorted(got, key=lambda x: x["index"])], raw, atol=1e-4)
    top = httpx.post(url + "/v1/rerank", json={**body, "top_n": 2, "return_documents": True, "raw_scores": True},
                     timeout=60).json()["results"]
    assert [x["index"] for x in top] == np.argsort(-raw, kind="stable")[:2].tolist()
    np.testing.assert_allclose([x["relevance_score"] for x in top], np.sort(raw)[::-1][:2], atol=1e-4)
    assert top[0]["document"] == {"text": DOCS[top[0]["index"]]}


@pytest.mark.parametrize("path,body,fragment", [
    ("/v1/rerank", {"query": QUERY, "documents": DOCS}, "document 12 with the query has"),
    ("/v1/rerank", {"query": QUERY, "documents": []}, "'documents' must not be empty"),
    ("/v1/rerank", {"query": "", "documents": ["d"]}, "'query' is an empty string"),
    ("/v1/rerank", {"query": QUERY, "documents": ["d"], "instruction": "find"}, "'instruction' applies to a bi-encoder"),
    ("/v1/rerank", {"query": QUERY, "documents": ["d"], "top_n": 0}, "top_n must be at least 1"),
    ("/v1/rerank", {"query": QUERY, "documents": "d"}, "documents"),
    ("/v1/embeddings", {"input": "hello"}, "is a cross-encoder"),
])
def test_http_errors(served, path, body, fragment):
    r = httpx.post(served[0] + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


def test_tulip_info_scores_and_bad_segment_starts(served):
    _, target, path = served
    seqs, starts = pair_ids(path, PAIRS[:3])
    engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32"))
    ref = scores(engine, seqs, starts)

    async def main():
        async with TulipClient(target) as c:
            info = await c.info()
            got = await c.score(seqs, starts, raw_scores=True)
            errors = []
            ids, lengths = pack(seqs)
            for kw in ({"segment_starts": [starts[0]]}, {"segment_starts": [len(seqs[0])] + starts[1:]},
                       {"outputs": [tulip_pb2.OUTPUT_DENSE]}, {"dimensions": 4}):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.stub.Embed(tulip_pb2.EmbedRequest(token_ids=ids, lengths=lengths, **kw))
                errors.append((e.value.code(), e.value.details()))
            return info, got, await c.score(seqs, starts), errors

    info, raw, activated, errors = asyncio.run(main())
    assert (info.num_labels, info.activation, info.embedding_dim) == (1, "Sigmoid", 0)
    assert list(info.outputs) == [tulip_pb2.OUTPUT_SCORES]
    np.testing.assert_allclose(raw, ref, atol=1e-5)
    np.testing.assert_allclose(activated, 1 / (1 + np.exp(-ref)), atol=1e-6)
    assert all(code == grpc.StatusCode.INVALID_ARGUMENT for code, _ in errors), errors
    for (_, details), fragment in zip(errors, ("1 entries for 3 sequences", "is not inside sequence 0",
                                              "OUTPUT_DENSE is not supported", "dimensions applies to embeddings")):
        assert fragment in details


def test_deberta_reranker_preset(tmp_path, monkeypatch):
    """mxbai-rerank-base-v1's preset: DeBERTa-v3-base with DebertaV2ForSequenceClassification's head
    (pooler 768 x 768, classifier 1 x 768) and its 512 relative-position embeddings (256 buckets each way);
    its random weights run (a copy at small widths: the full one is 184M parameters), the same scores
    from two engines, apart across pairs."""
    from rose.models import model_class
    from trellis.modeldir import ModelSpec
    from trellis.modelref import resolve_model_path
    from presets import PRESETS

    monkeypatch.setenv("TRELLIS_CACHE", str(tmp_path / "cache"))
    path = resolve_model_path("preset:mxbai-rerank-base-v1")
    spec = ModelSpec.read(path)
    family = model_class(spec)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in family(spec.config).named_parameters()
                  if k.startswith(("pooler.", "classifier.", "encoder.rel"))}
    assert shapes == {"pooler.dense.weight": (768, 768), "pooler.dense.bias": (768,), "classifier.weight": (1, 768),
                      "classifier.bias": (1,), "encoder.rel_embeddings.weight": (512, 768)}
    seqs, starts = pair_ids(path, PAIRS[:6])
    small = tmp_path / "small"
    shutil.copytree(path, small)
    config = PRESETS["mxbai-rerank-base-v1"]["config"]
    (small / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "intermediate_size": 128,
                                                   "pooler_hidden_size": 64, "vocab_size": 300}))
    assert_preset_scores_repeat(small, seqs, starts, max_seq_len=512)
