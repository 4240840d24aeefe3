"""Encoder families on CPU in float32 against sentence-transformers (itself over transformers'
own models) on tiny random checkpoints saved in their published layouts: DistilBERT, RoBERTa, CamemBERT,
T5's encoder (ReLU and gated-GELU, with a Dense module), DeBERTa-v3 and v2 (disentangled attention), MPNet
(relative position bias), ModernBERT (local window layers), NomicBERT (published config keys,
prompts, Matryoshka dimensions) and SPLADE (sparse vocabulary weights), plus the attention rules
the families declare (score bias only on sdpa, local layers routed to a windowed backend)."""

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rose.batch import Batch
from rose.engine import Engine, EngineConfig
from rose.layers.attention import SdpaBackend, WindowFallback
from rose.extras import vocab_weights
from torch.utils._python_dispatch import TorchDispatchMode
from tests import checkpoints_encoders as ck
from tests.sentences import SENTENCES

TEXTS = SENTENCES[:24]  # 1 to ~90 tokens with the character-level tokenizer
BUILDERS = {"distilbert": ck.save_distilbert, "roberta": ck.save_roberta,
            "camembert": lambda path: ck.save_roberta(path, family="camembert"), "t5": ck.save_t5,
            "t5-gated": lambda path: ck.save_t5(path, gated=True), "deberta-v3": ck.save_deberta_v2,
            "deberta-v2": lambda path: ck.save_deberta_v2(path, v3=False), "mpnet": ck.save_mpnet, "modernbert": ck.save_modernbert,
            "nomic_bert": ck.save_nomic_bert, "splade": ck.save_splade,
            "splade-distilbert": lambda path: ck.save_splade(path, distilbert=True)}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (directory, sentence-transformers reference), built once per family."""
    cache = {}

    def get(family):
        if family not in cache:
            path = tmp_path_factory.mktemp(family)
            cache[family] = path, BUILDERS[family](path)
        return cache[family]

    return get


def engine(path, **kw) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", **kw))


def run(e: Engine, seqs) -> torch.Tensor:
    return e.step(Batch.from_sequences(seqs)).synchronize()


def ids(ref, texts):
    return ref.tokenizer(list(texts), truncation=True, max_length=256)["input_ids"]


def reference(ref, texts, **kw) -> torch.Tensor:
    out = ref.encode(list(texts), convert_to_tensor=True, **kw)
    return out.to_dense() if out.is_sparse else out


EXPECT = {  # family -> (model_type, pooling, normalised, output width)
    "distilbert": ("distilbert", "mean", False, 64), "roberta": ("roberta", "mean", True, 64),
    "camembert": ("camembert", "mean", True, 64), "t5": ("t5", "mean", True, 48), "t5-gated": ("t5", "mean", True, 48),
    "deberta-v3": ("deberta-v2", "mean", True, 64), "deberta-v2": ("deberta-v2", "mean", True, 64),
    "mpnet": ("mpnet", "mean", True, 64),
    "modernbert": ("modernbert", "cls", True, 64), "nomic_bert": ("nomic_bert", "mean", True, 64),
    "splade": ("bert", "splade", False, ck.VOCAB), "splade-distilbert": ("distilbert", "splade", False, ck.VOCAB),
}


class NoHostTensors(TorchDispatchMode):
    """CUDA graph capture's rule on the CPU: a step makes no tensor from host data (`torch.tensor(x)`
    reaches the dispatcher as aten.lift_fresh), since copying a CPU tensor to the device cannot be
    captured (issue 47, fault 14: DeBERTa's buckets failed every request after a shape's first on a GPU)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.lift_fresh.default:
            raise AssertionError("a host tensor was made inside the step: it cannot be captured in a CUDA graph")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", list(BUILDERS))
def test_matches_sentence_transformers(built, family):
    path, ref = built(family)
    e = engine(path)
    assert (e.spec.model_type, e.spec.pooling, e.spec.normalize, e.embedding_dim) == EXPECT[family]
    seqs = ids(ref, TEXTS)
    assert max(map(len, seqs)) > 40  # longer than ModernBERT's window of 8 each side
    batch = Batch.from_sequences(seqs)  # the host side, before the step
    with NoHostTensors():
        ours = e.step(batch).synchronize()
    want = reference(ref, TEXTS)
    assert ours.shape == want.shape
    n = F.normalize(want, dim=-1)
    assert (n @ n.T).mean().item() < 0.95  # texts get distinct vectors: the check below can fail
    assert F.cosine_similarity(ours, want).min().item() >= 0.9999
    if family.startswith("splade"):
        assert (ours - want).abs().max().item() < 1e-4
    for i in (0, 5, 17):  # one sequence alone gives its row of the ragged batch
        assert F.cosine_similarity(run(e, [seqs[i]])[0], ours[i], dim=0).item() >= 0.99999


def test_splade_sparse_output(built):
    """The sparse output is the row's nonzeros (every vocabulary id SPLADE scores, specials included),
    against the SparseEncoder's sparse tensor to 1e-4; the engine offers it as "sparse"."""
    path, ref = built("splade")
    e = engine(path)
    assert e.extra_outputs == ("sparse",) and e.sparse_rows
    seqs = ids(ref, TEXTS[:6])
    rows = e.step(Batch.from_sequences(seqs), frozenset({"sparse"})).synchronize().numpy()
    want = ref.encode(TEXTS[:6], convert_to_tensor=True).coalesce()
    for i in range(6):
        tok, w = vocab_weights(rows[i])
        sel = want.indices()[0] == i
        ref_ids, ref_w = want.indices()[1][sel].numpy(), want.values()[sel].numpy()
        order = np.argsort(ref_ids)
        assert np.array_equal(tok, ref_ids[order]) and len(tok) > 10
        np.testing.assert_allclose(w, ref_w[order], atol=1e-4)


def test_splade_from_a_plain_masked_lm_directory(built, tmp_path):
    """A BertForMaskedLM directory without sentence-transformers files is served as SPLADE."""
    path, ref = built("splade")
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / f, plain / f)
    e = engine(plain)
    assert (e.spec.pooling, e.embedding_dim) == ("splade", ck.VOCAB)
    seqs = ids(ref, TEXTS[:4])
    assert (run(e, seqs) - reference(ref, TEXTS[:4])).abs().max().item() < 1e-4


def test_splade_pooling_other_than_max_relu_is_an_error(built, tmp_path):
    path, _ = built("splade")
    d = tmp_path / "sum"
    shutil.copytree(path, d)
    (d / "1_SpladePooling" / "config.json").write_text(json.dumps({"pooling_strategy": "sum"}))
    with pytest.raises(ValueError, match="SpladePooling"):
        engine(d)


@pytest.mark.parametrize("family", ["nomic_bert", "modernbert-embed"])
def test_prompts(built, family, tmp_path):
    """Query / document prompts from config_sentence_transformers.json, against sentence-transformers'
    prompt_name (nomic-embed-text-v1.5; modernbert-embed-base: mean pooling and the same prompts)."""
    if family == "nomic_bert":
        path, ref = built(family)
    else:
        path = tmp_path / family
        ref = ck.save_modernbert(path, pooling="mean", prompts=ck.PROMPTS)
    e = engine(path)
    assert e.spec.prompts == ck.PROMPTS and e.spec.pooling == "mean"
    for name, prompt in ck.PROMPTS.items():
        ours = run(e, ids(ref, [prompt + t for t in TEXTS[:8]]))
        want = reference(ref, TEXTS[:8], prompt_name=name)
        assert F.cosine_similarity(ours, want).min().item() >= 0.9999
    assert F.cosine_similarity(ours, reference(ref, TEXTS[:8])).min().item() < 0.9999  # the prompt matters


def test_nomic_matryoshka_dimensions(built):
    """`dimensions` (trellis.postprocess.matryoshka, as Tulip applies it: first d, re-normalised) against truncate_dim."""
    from trellis.postprocess import matryoshka as truncate_dims

    path, ref = built("nomic_bert")
    ours = truncate_dims(run(engine(path), ids(ref, TEXTS)).numpy(), 16)
    want = ref.encode(TEXTS, truncate_dim=16)
    assert ours.shape == want.shape == (len(TEXTS), 16)
    cos = (ours * want).sum(1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.9999 and np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)


def test_nomic_published_config(built, tmp_path):
    """nomic-embed-text-v1.5's own config.json (remote-code, GPT-2 style keys) reads the same; a setting
    it does not use (interleaved rotary) is a clear error."""
    path, ref = built("nomic_bert")
    d = tmp_path / "published"
    shutil.copytree(path, d)
    c = json.loads((d / "config.json").read_text())
    published = {"model_type": "nomic_bert", "architectures": ["NomicBertModel"], "vocab_size": c["vocab_size"],
                 "n_embd": c["hidden_size"], "n_head": c["num_attention_heads"], "n_layer": c["num_hidden_layers"],
                 "n_inner": c["intermediate_size"], "n_positions": c["max_position_embeddings"],
                 "layer_norm_epsilon": c["layer_norm_eps"], "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0,
                 "rotary_emb_interleaved": False, "rotary_scaling_factor": None, "prenorm": False,
                 "activation_function": "swiglu", "qkv_proj_bias": False, "mlp_fc1_bias": False,
                 "mlp_fc2_bias": False, "type_vocab_size": 2, "max_trained_positions": 2048}
    (d / "config.json").write_text(json.dumps(published))
    assert F.cosine_similarity(run(engine(d), ids(ref, TEXTS)), reference(ref, TEXTS)).min().item() >= 0.9999
    (d / "config.json").write_text(json.dumps({**published, "rotary_emb_interleaved": True}))
    with pytest.raises(ValueError, match="rotary_emb_interleaved"):
        engine(d)


def test_modernbert_window_is_respected(built, monkeypatch):
    """The local layers' window changes the output (the reference is sensitive to it), and a backend
    without a window runs only the global layers: the engine routes the local ones elsewhere."""
    from rose.models.modernbert import ModernBertModel

    path, ref = built("modernbert")
    seqs, want = ids(ref, TEXTS), reference(ref, TEXTS)

    class NoWindow(SdpaBackend):
        name, windowed, calls = "no-window", False, 0

        def __call__(self, q, k, v, meta):
            assert not meta.windowed()  # a window that binds never reaches a backend without one
            NoWindow.calls += 1
            return super().__call__(q, k, v, meta.with_window(0))

    class Windowed(SdpaBackend):
        calls = 0

        def __call__(self, q, k, v, meta):
            Windowed.calls += 1
            return super().__call__(q, k, v, meta)

    e = engine(path)
    e.attention = WindowFallback(NoWindow(), Windowed())
    assert F.cosine_similarity(run(e, seqs), want).min().item() >= 0.9999
    assert NoWindow.calls >= 2 and Windowed.calls >= 1  # layers 0 and 2 are global, layer 1 local
    monkeypatch.setattr(ModernBertModel, "sliding_window", classmethod(lambda cls, config: 10_000))
    assert F.cosine_similarity(run(engine(path), seqs), want).min().item() < 0.9999


def test_mpnet_bias_needs_sdpa(built):
    """MPNet's relative position bias changes the output, runs on sdpa under "auto" on CPU, and a
    backend that takes no bias is a clear error."""
    path, ref = built("mpnet")
    e = engine(path)
    assert e.attention.name == "sdpa" and e.runner is None
    seqs, want = ids(ref, TEXTS), reference(ref, TEXTS)
    with torch.no_grad():
        e.model.encoder.relative_attention_bias.weight.zero_()
    assert F.cosine_similarity(run(e, seqs), want).min().item() < 0.9999
    for name in ("varlen", "fa4", "flashinfer-fa2"):
        with pytest.raises(ValueError, match="position bias"):
            engine(path, attention=name)


def test_mpnet_on_the_padded_backend(built):
    """The padded batch (auto's choice for MPNet on CUDA: one capturable call) gives the reference too,
    through the engine, with the batch padded as a CUDA graph pads it (dummy sequences, padding tokens)."""
    path, ref = built("mpnet")
    e = engine(path, attention="padded")
    assert e.attention.name == "padded" and e.attention.capturable
    seqs, want = ids(ref, TEXTS), reference(ref, TEXTS)
    assert F.cosine_similarity(run(e, seqs), want).min().item() >= 0.9999


@pytest.mark.parametrize("causal, window, gqa", [(False, 0, False), (True, 0, True), (False, 5, False), (True, 4, True)])
def test_padded_backend_equals_sdpa_per_sequence(causal, window, gqa):
    """`PaddedBackend` against `SdpaBackend` on one ragged batch with a score bias: a longer
    `max_seqlen` than any sequence (a graph's length bucket), an empty dummy sequence and padding
    tokens past the last one (zero rows out), GQA, causal attention and windows."""
    from rose.layers.attention import AttentionMetadata, PaddedBackend

    torch.manual_seed(0)
    lens, pad = (7, 1, 12, 0), 3
    T, h = sum(lens) + pad, 4
    q = torch.randn(T, h, 8)
    k, v = (torch.randn(T, 2 if gqa else h, 8) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    bias = torch.randn(h, 16, 16)
    meta = AttentionMetadata(cu, 16, lens, causal, window, bias)
    got = PaddedBackend()(q, k, v, meta)
    want = SdpaBackend()(q, k, v, AttentionMetadata(cu, max(lens), lens, causal, window, bias))
    n = sum(lens)
    assert torch.allclose(got[:n], want[:n], atol=1e-5)
    assert not got[n:].any()  # padding tokens belong to no sequence


@pytest.mark.parametrize("family", list(BUILDERS))
def test_served_end_to_end(built, family, tmp_path):
    """deploy.local (a real Tulip and Ivy) serving each family's directory, through the official openai
    client: vectors against sentence-transformers. MPNet runs sdpa only (no graphs), ModernBERT its
    local layers' window, NomicBERT with its query prompt (`input_type`) and Matryoshka `dimensions`,
    SPLADE's vocabulary-sized rows and sparse output (`return_sparse`). About 15 s a family on 2 cores."""
    import signal

    import openai

    from tests.conftest import Proc, free_port

    path, ref = built(family)
    port = free_port()
    proc = Proc(["-m", "deploy.local", "--model", str(path), "--port", str(port), "--device", "cpu"], tmp_path)
    try:
        proc.wait_for(lambda: "Trellis is ready" in proc.output(), timeout=180)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        texts = TEXTS[:8]
        kw, want = {}, reference(ref, texts)
        if family == "nomic_bert":
            kw = {"dimensions": 16, "extra_body": {"input_type": "query"}}
            want = torch.from_numpy(ref.encode(texts, prompt_name="query", truncate_dim=16))
        if family == "splade":
            kw = {"extra_body": {"return_sparse": True}}
        reply = client.embeddings.create(model=name, input=texts, **kw)
        got = torch.tensor([d.embedding for d in reply.data])
        assert got.shape == want.shape
        assert F.cosine_similarity(got, want).min().item() >= 0.9999
        if family == "splade":
            for i, d in enumerate(reply.data):
                sparse = {int(k): v for k, v in d.model_extra["sparse_embedding"].items()}
                nz = torch.nonzero(want[i]).flatten().tolist()
                assert sorted(sparse) == nz
                assert max(abs(sparse[j] - want[i, j].item()) for j in nz) < 1e-4
    finally:
        proc.stop(signal.SIGINT)


def test_sentence_t5_preset(tmp_path, monkeypatch):
    """sentence-t5-base's preset: T5-base's encoder (random weights) with its Dense module and Normalize,
    read as published; a step gives unit vectors of the Dense module's width, the same from two engines."""
    from trellis.modeldir import ModelSpec
    from trellis.modelref import resolve_model_path

    monkeypatch.setenv("TRELLIS_CACHE", str(tmp_path / "cache"))
    path = resolve_model_path("preset:sentence-t5-base")
    spec = ModelSpec.read(path)
    assert (spec.model_type, spec.pooling, spec.normalize, spec.max_seq_len) == ("t5", "mean", True, 256)
    assert [(d.in_features, d.out_features, d.bias) for d in spec.dense] == [(768, 768, False)]
    seqs = [[5 + i for i in range(n)] + [1] for n in (30, 7)]
    got = [run(engine(path), seqs) for _ in range(2)]
    assert got[0].shape == (2, 768) and torch.equal(got[0], got[1])
    torch.testing.assert_close(got[0].norm(dim=1), torch.ones(2))
