"""Decoder families (Llama, Mistral, Qwen2, Gemma3 text) on CPU in float32: hidden states and pooled
outputs against transformers on tiny random checkpoints, sliding windows binding, rope scaling,
prompts through sentence-transformers, presets; and one served end-to-end test per family."""

import json
import logging
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from rose.batch import Batch
from rose.engine import Engine, EngineConfig
from rose.layers.attention import AttentionMetadata, SdpaBackend, with_window_support
from tests.checkpoints_decoders import LAYOUTS, reference_hidden, save_decoder, save_embeddinggemma
from tests.conftest import local_stack

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
CASES = {  # id: (model_type, bidirectional, config overrides)
    "llama": ("llama", False, {}),
    "llama-rope-llama3": ("llama", False, {"rope_parameters": LLAMA3_ROPE}),
    "mistral-window": ("mistral", False, {}),
    "qwen2-causal": ("qwen2", False, {}),
    "qwen2-bidirectional": ("qwen2", True, {}),
    "gemma3-bidirectional": ("gemma3_text", True, {}),
    "gemma3-causal": ("gemma3_text", False, {}),
}
G = torch.Generator().manual_seed(0)
SEQS = [[5, 6, 7], [9], list(range(10, 50)), torch.randint(4, 500, (100,), generator=G).tolist(),
        torch.randint(4, 500, (256,), generator=G).tolist()]  # 256: the longest served


def engine_for(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", **kw))


def hidden_states(e: Engine, seqs) -> list[torch.Tensor]:
    b = Batch.from_sequences(seqs)
    meta = AttentionMetadata(b.cu_seqlens, b.max_seqlen, b.seq_lens, e.causal)
    with torch.inference_mode():
        h = e.model(b.input_ids, b.positions, meta, e.attention)
    return list(h.split(list(b.seq_lens)))


def cos_min(a, b) -> float:
    return F.cosine_similarity(a, b, dim=-1).min().item()


@pytest.mark.parametrize("case", list(CASES))
def test_hidden_states_and_pooled_outputs_match_transformers(case, tmp_path):
    model_type, bidirectional, overrides = CASES[case]
    path, hf = save_decoder(model_type, tmp_path, bidirectional=bidirectional, **overrides)
    e = engine_for(path)
    pooling = LAYOUTS[model_type]["pooling"].replace("lasttoken", "last")
    assert (e.spec.model_type, e.spec.pooling, e.spec.normalize, e.causal) == (
        model_type, pooling, True, not bidirectional)
    refs = [reference_hidden(hf, s, bidirectional) for s in SEQS]
    for ours, ref in zip(hidden_states(e, SEQS), refs):
        assert cos_min(ours, ref) >= 0.9999
        assert torch.allclose(ours, ref, atol=1e-4)
    pooled = e.step(Batch.from_sequences(SEQS)).synchronize()
    want = F.normalize(torch.stack([r[-1] if pooling == "last" else r.mean(0) for r in refs]), dim=-1)
    assert cos_min(pooled, want) >= 0.9999
    for i, s in enumerate(SEQS):  # batch invariance
        assert cos_min(e.step(Batch.from_sequences([s])).synchronize()[0], pooled[i]) >= 0.99999
    if model_type in ("mistral", "gemma3_text"):  # the window binds: full attention would differ
        assert e.model.window and e.model.window < len(SEQS[-1])
        hf.config.sliding_window = 10 ** 6
        assert cos_min(reference_hidden(hf, SEQS[-1], bidirectional), refs[-1]) < 0.999


@pytest.mark.parametrize("model_type, bidirectional", [
    ("llama", False), ("mistral", False), ("qwen2", True), ("gemma3_text", True)])
def test_prompts_and_pooling_match_sentence_transformers(model_type, bidirectional, tmp_path):
    """The published layouts read as sentence-transformers reads them: its pooling (last token or
    mean), Normalize, and the query / document prompts of config_sentence_transformers.json put
    before the text as Ivy does (`ivy.templates`)."""
    from sentence_transformers import SentenceTransformer

    from ivy.templates import Templates

    path, _ = save_decoder(model_type, tmp_path, bidirectional=bidirectional)
    e = engine_for(path)
    st = SentenceTransformer(str(path), device="cpu", model_kwargs={"attn_implementation": "eager"})
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    texts = ["what is a tulip", "Tulips are spring-blooming perennial herbaceous bulbiferous geophytes.", "x"]
    prompts = LAYOUTS[model_type]["prompts"]
    templates = Templates(e.spec.prompts, None)
    for input_type in ("query", "document"):
        name = next((k for k in ("query", "web_search_query", "document") if k in prompts and
                     (k == "document") == (input_type == "document")), None)
        want = st.encode(texts, prompt_name=name, convert_to_tensor=True) if name else \
            st.encode(texts, convert_to_tensor=True)
        served = templates.apply(texts, input_type, None)
        assert served == [(prompts[name] if name else "") + t for t in texts]
        got = e.step(Batch.from_sequences([tok.encode(t).ids for t in served])).synchronize()
        assert cos_min(got, want) >= 0.9999


def test_published_gemma3_config_keys_read_the_same(tmp_path):
    """EmbeddingGemma's config.json (transformers 4.5x) names the rotary bases rope_theta /
    rope_local_base_freq and may give sliding_window_pattern instead of layer_types: the same model."""
    path, _ = save_decoder("gemma3_text", tmp_path / "new", bidirectional=True)
    old = tmp_path / "old"
    shutil.copytree(path, old)
    cfg = json.loads((old / "config.json").read_text())
    del cfg["rope_parameters"], cfg["layer_types"]
    cfg.update(rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None, sliding_window_pattern=2)
    (old / "config.json").write_text(json.dumps(cfg))
    a, b = engine_for(path), engine_for(old)
    assert b.model.windows == a.model.windows == (16 // 2 + 1, 0)
    torch.testing.assert_close(b.step(Batch.from_sequences(SEQS)).synchronize(),
                               a.step(Batch.from_sequences(SEQS)).synchronize())


@pytest.mark.parametrize("model_type, edit, message", [
    ("llama", {"rope_parameters": None, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling rope_type 'yarn'"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 8.0},
                                         "sliding_attention": {"rope_type": "default"}}},
     "rope_parameters.full_attention rope_type 'yarn'"),
    ("mistral", {"is_causal": False}, "sliding-window attention with bidirectional"),
    ("qwen2", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, model_type, edit, message):
    path, _ = save_decoder(model_type, tmp_path, st=False)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(ValueError, match=message):
        engine_for(path)


class FullAttentionOnly(SdpaBackend):
    """A backend without a window argument (as flashinfer's or ROSE's Triton kernel)."""

    name = "full-only"
    windowed = False

    def __call__(self, q, k, v, meta):
        return super().__call__(q, k, v, meta.with_window(0))


@pytest.mark.parametrize("causal", [True, False])
def test_window_fallback_serves_windowed_calls_only(causal, caplog):
    from rose.layers.attention import band_mask, select_backend

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(70, 4, 16, generator=g) for _ in range(3))
    with caplog.at_level(logging.WARNING, logger="rose.layers.attention"):
        b = with_window_support(FullAttentionOnly(), lambda n: select_backend(n, torch.device("cpu"), torch.float32))
    assert b.name == "full-only+window:sdpa" and "no sliding window" in caplog.text
    cu = torch.tensor([0, 8, 70], dtype=torch.int32)
    meta = AttentionMetadata(cu, 62, (8, 62), causal, window=9)
    want = torch.cat([  # explicit masked softmax per sequence
        torch.softmax((q[s].transpose(0, 1) @ k[s].transpose(0, 1).transpose(1, 2) / 4).masked_fill(
            ~band_mask(s.stop - s.start, 9, causal, "cpu"), float("-inf")), -1) @ v[s].transpose(0, 1)
        for s in (slice(0, 8), slice(8, 70))], dim=1).transpose(0, 1)
    torch.testing.assert_close(b(q, k, v, meta), want, atol=1e-5, rtol=1e-5)
    short = AttentionMetadata(cu[:2], 8, (8,), causal, window=9)  # never longer than the window: the inner one
    assert b.window_backend is not b.inner and not short.windowed() and meta.windowed()
    assert with_window_support(SdpaBackend(), None).name == "sdpa"  # sdpa honours windows itself


@pytest.mark.parametrize("name, model_type, pooling, window, causal, dim, wrap", [
    ("e5-mistral-7b-instruct", "mistral", "last", 4096, True, 4096, 2),
    ("gte-qwen2-1.5b-instruct", "qwen2", "last", 0, False, 1536, 1),
    ("embeddinggemma-300m", "gemma3_text", "mean", 257, False, 768, 2)])
def test_decoder_presets(tmp_path, monkeypatch, name, model_type, pooling, window, causal, dim, wrap):
    from rose.models import model_class
    from trellis.modeldir import ModelSpec
    from trellis.modelref import resolve_model_path

    monkeypatch.setenv("TRELLIS_CACHE", str(tmp_path))
    path = resolve_model_path(f"preset:{name}")
    read = ModelSpec.read(path)
    family = model_class(read)
    spec = family.serving(read)
    assert (spec.model_type, spec.pooling, spec.normalize, spec.hidden_size) == (model_type, pooling, True, dim)
    with torch.device("meta"):
        model = family(spec.config)
    assert (model.window, model.causal) == (window, causal)
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode("hi").ids
    assert len(ids) == 2 + wrap and max(ids) < spec.vocab_size  # (bos,) two bytes, eos
    if model_type != "gemma3_text":
        assert spec.prompts[next(k for k in spec.prompts if k.endswith("query"))].startswith("Instruct: ")


def test_embeddinggemma_preset_runs_its_dense_modules(tmp_path, monkeypatch):
    """The embeddinggemma-300m preset is written in the published pipeline's layout: Transformer, mean
    Pooling, 2_Dense (768 -> 3072) and 3_Dense (3072 -> 768), no bias, Identity, float32 weights in
    each module's model.safetensors, then Normalize. The engine runs the whole pipeline on its random
    weights (a copy of the preset at one layer and a small vocabulary, as fast as a test should be): its
    vectors are the mean-pooled states through both Dense modules, normalised."""
    from safetensors.numpy import load_file

    from trellis.modeldir import ModelSpec

    from trellis.modelref import resolve_model_path
    from presets import PRESETS, RANDOM_WEIGHTS

    monkeypatch.setenv("TRELLIS_CACHE", str(tmp_path / "cache"))
    path = resolve_model_path("preset:embeddinggemma-300m")
    modules = json.loads((path / "modules.json").read_text())
    assert [(m["idx"], m["path"], m["type"].rsplit(".", 1)[-1]) for m in modules] == [
        (0, "", "Transformer"), (1, "1_Pooling", "Pooling"), (2, "2_Dense", "Dense"), (3, "3_Dense", "Dense"),
        (4, "4_Normalize", "Normalize")]
    weights = [load_file(str(path / d / "model.safetensors")) for d in ("2_Dense", "3_Dense")]
    assert [{k: (v.shape, v.dtype) for k, v in w.items()} for w in weights] == [
        {"linear.weight": ((3072, 768), np.float32)}, {"linear.weight": ((768, 3072), np.float32)}]
    spec = ModelSpec.read(path)
    assert [(d.path.name, d.in_features, d.out_features, d.bias, d.activation) for d in spec.dense] == [
        ("2_Dense", 768, 3072, False, "torch.nn.modules.linear.Identity"),
        ("3_Dense", 3072, 768, False, "torch.nn.modules.linear.Identity")]
    assert (spec.pooling, spec.normalize, spec.embedding_dim) == ("mean", True, 768)

    small = tmp_path / "small"
    shutil.copytree(path, small)
    config = PRESETS["embeddinggemma-300m"]["config"]
    (small / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1, "vocab_size": 512,
                                                   "layer_types": config["layer_types"][:1]}))
    assert (small / RANDOM_WEIGHTS).is_file()
    engine = Engine(EngineConfig(model=str(small), device="cpu", dtype="float32"))
    assert engine.embedding_dim == 768 and len(engine.dense) == 2
    ids = [Tokenizer.from_file(str(small / "tokenizer.json")).encode(t).ids for t in ("hello there", "a b c d e f")]
    batch = Batch.from_sequences(ids)
    got = engine.step(batch).synchronize()
    with torch.inference_mode():
        hidden = engine._encode(batch.input_ids, batch.positions, batch.cu_seqlens, batch.max_seqlen, batch.seq_lens)
    pooled = torch.stack([hidden[batch.cu_seqlens[i]:batch.cu_seqlens[i + 1]].mean(0) for i in range(2)])
    w2, w3 = (torch.from_numpy(w["linear.weight"]) for w in weights)
    want = F.normalize(pooled @ w2.T @ w3.T, dim=-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert F.cosine_similarity(got, F.normalize(pooled, dim=-1)).max() < 0.5  # the Dense modules ran


# --- served end to end: deploy.local (Ivy + one Tulip), the official openai client -----------------

@pytest.fixture(scope="module", params=[("llama", False), ("mistral", False), ("qwen2", True), ("gemma3_text", True)],
                ids=lambda p: p[0])
def served(request, tmp_path_factory):
    model_type, bidirectional = request.param
    d = tmp_path_factory.mktemp(model_type) / f"tiny-{model_type}"
    d.mkdir()
    if model_type == "gemma3_text":  # EmbeddingGemma's published pipeline, its two Dense modules too
        save_embeddinggemma(d)
    else:
        save_decoder(model_type, d, bidirectional=bidirectional)
    with local_stack(d, tmp_path_factory.mktemp("stack")) as (url, _):
        yield url, d


def test_served_embeddings_match_sentence_transformers(served):
    """Each family's published layout through Ivy and a Tulip with the official openai client against
    sentence-transformers' encode(): plain, the query (and document) prompt by `input_type`, an
    instruction, Matryoshka `dimensions` against `truncate_dim`."""
    import openai
    from sentence_transformers import SentenceTransformer

    url, d = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    st = SentenceTransformer(str(d), device="cpu", model_kwargs={"attn_implementation": "eager"})
    if d.name == "tiny-gemma3_text":  # the whole published pipeline is what is served
        assert [type(m).__name__ for m in st] == ["Transformer", "Pooling", "Dense", "Dense", "Normalize"]
    texts = ["what is a tulip", "Tulips are spring-blooming perennial herbaceous bulbiferous geophytes."]
    prompts = json.loads((d / "config_sentence_transformers.json").read_text())["prompts"]  # st adds empty ones
    query_name = next((k for k in ("query", "web_search_query") if k in prompts), None)

    def vectors(dimensions=openai.NOT_GIVEN, **extra):
        r = client.embeddings.create(model=d.name, input=texts, encoding_format="float", dimensions=dimensions,
                                     extra_body=extra or None)
        return np.array([x.embedding for x in r.data])

    def cos(a, b):
        return ((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min()

    plain = vectors()
    assert plain.shape == (2, 64) and np.allclose(np.linalg.norm(plain, axis=1), 1, atol=1e-5)
    assert cos(plain, st.encode(texts)) >= 0.9999
    assert cos(vectors(input_type="query"), st.encode(texts, prompt_name=query_name)) >= 0.9999
    if "document" in prompts:
        doc = vectors(input_type="document")
        assert cos(doc, st.encode(texts, prompt_name="document")) >= 0.9999
        if prompts["document"]:  # the prompt is really applied
            assert cos(doc, plain) < 0.9999
    short = vectors(dimensions=16)  # Matryoshka: the first 16, normalised again
    assert short.shape == (2, 16) and np.allclose(np.linalg.norm(short, axis=1), 1, atol=1e-5)
    assert cos(short, st.encode(texts, truncate_dim=16)) >= 0.9999
    if prompts[query_name].startswith("Instruct: "):  # an instruction in the model's own query template
        task = prompts[query_name].split("\n")[0].removeprefix("Instruct: ")
        assert cos(vectors(instruction=task), st.encode(texts, prompt_name=query_name)) >= 0.99999
