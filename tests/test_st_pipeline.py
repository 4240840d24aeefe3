"""sentence-transformers pipelines read as they are published: Transformer, Pooling (cls / mean / max /
weightedmean / lasttoken, with and without the prompt), Dense modules (one or two, with activations),
Normalize; directories saved by sentence-transformers itself and compared with its own encode(); one
such pipeline served end to end with Matryoshka dimensions; pplx-embed-v1's published layout (its
model_type and quantizer module) with int8 / binary outputs against the quantizer's definition."""

import asyncio
import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rose.batch import Batch
from rose.engine import Engine, EngineConfig
from tests.checkpoints import qwen3_reference, save_checkpoint, save_pplx
from tests.conftest import Proc, free_port, local_stack
from tests.sentences import SENTENCES
from trellis.modeldir import ModelSpec

TEXTS = SENTENCES[:12]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
# (out_features, bias, activation) per Dense module after a 64-wide pooled vector
DENSES = {"one": [(48, True, torch.nn.Tanh())],
          "two": [(96, False, torch.nn.Identity()), (32, True, torch.nn.Tanh())]}  # EmbeddingGemma has two


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory, model_path):
    """A tiny random BERT saved by transformers, with all-MiniLM's tokenizer (30522 ids)."""
    d = tmp_path_factory.mktemp("bert")
    save_checkpoint("bert", d, vocab_size=30522)
    for f in TOKENIZER_FILES:
        shutil.copy(model_path / f, d / f)
    return d


def save_pipeline(src, dst, pooling: str, denses, normalize: bool = True, include_prompt: bool = True, seed=0):
    """SentenceTransformer(modules=[Transformer, Pooling, Dense..., Normalize]).save(dst); returns it."""
    from sentence_transformers import SentenceTransformer, models

    torch.manual_seed(seed)
    t = models.Transformer(str(src))
    mods, dim = [t, models.Pooling(64, pooling_mode=pooling, include_prompt=include_prompt)], 64
    for out, bias, act in denses:
        mods.append(models.Dense(dim, out, bias=bias, activation_function=act))
        dim = out
    if normalize:
        mods.append(models.Normalize())
    st = SentenceTransformer(modules=mods, device="cpu")
    st.save(str(dst))
    return st.eval()


def ours(engine, st, texts, pool_from=None):
    ids = st.tokenizer(texts, truncation=True, max_length=engine.spec.max_seq_len)["input_ids"]
    return engine.step(Batch.from_sequences(ids, pool_from)).synchronize()


def assert_parity(got, want, normalized: bool):
    want = torch.as_tensor(want)
    cos = F.cosine_similarity(got, want)
    assert cos.min().item() >= 0.9999, cos
    if not normalized:  # the magnitudes too
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("dense", list(DENSES))
@pytest.mark.parametrize("pooling", ["cls", "mean", "max", "weightedmean", "lasttoken"])
def test_pipeline_matches_sentence_transformers(bert_dir, tmp_path, pooling, dense):
    normalize = dense == "one"  # two Dense modules straight out: their magnitudes are compared too
    st = save_pipeline(bert_dir, tmp_path / "m", pooling, DENSES[dense], normalize=normalize)
    e = Engine(EngineConfig(model=str(tmp_path / "m"), device="cpu", dtype="float32"))
    assert e.embedding_dim == DENSES[dense][-1][0] == st.get_sentence_embedding_dimension()
    assert len(e.spec.dense) == len(DENSES[dense]) and e.spec.normalize == normalize
    got = ours(e, st, TEXTS)
    assert got.shape == (len(TEXTS), e.embedding_dim)
    assert_parity(got, st.encode(TEXTS, convert_to_tensor=True), normalize)
    for i in (0, 4):  # batch invariance: alone as in the batch
        assert F.cosine_similarity(ours(e, st, [TEXTS[i]])[0], got[i], dim=0).item() >= 0.99999


@pytest.mark.parametrize("pooling", ["max", "weightedmean"])
def test_prompt_left_out_of_max_and_weighted_mean(bert_dir, tmp_path, pooling):
    """include_prompt: false: the prompt attends but is not pooled; weighted mean keeps the text's
    positions in the whole sequence as its weights (sentence-transformers' rule)."""
    st = save_pipeline(bert_dir, tmp_path / "m", pooling, DENSES["one"], include_prompt=False)
    e = Engine(EngineConfig(model=str(tmp_path / "m"), device="cpu", dtype="float32"))
    assert e.spec.include_prompt is False
    prompt = "query: "
    n = len(st.tokenizer(prompt)["input_ids"]) - 1  # the prompt's tokens, its [SEP] not counted
    texts = [prompt + t for t in TEXTS[3:9]]
    got = ours(e, st, texts, [n] * len(texts))
    want = st.encode(TEXTS[3:9], prompt=prompt, convert_to_tensor=True)
    assert_parity(got, want, True)
    assert F.cosine_similarity(ours(e, st, texts), want).min().item() < 0.9999  # pooling the prompt differs


def test_older_layout_reads_the_same(bert_dir, tmp_path):
    """What older sentence-transformers releases write: `sentence_transformers.models.*` types, the
    boolean pooling keys, Dense weights in pytorch_model.bin; served as the current layout is."""
    from safetensors.torch import load_file

    d = tmp_path / "m"
    st = save_pipeline(bert_dir, d, "weightedmean", DENSES["two"])
    modules = json.loads((d / "modules.json").read_text())
    for m in modules:
        m["type"] = "sentence_transformers.models." + m["type"].rsplit(".", 1)[-1]
    (d / "modules.json").write_text(json.dumps(modules))
    (d / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
         "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
         "pooling_mode_weightedmean_tokens": True, "pooling_mode_lasttoken": False}))
    for sub in ("2_Dense", "3_Dense"):
        torch.save(load_file(str(d / sub / "model.safetensors")), d / sub / "pytorch_model.bin")
        (d / sub / "model.safetensors").unlink()
    spec = ModelSpec.read(d)
    assert (spec.pooling, [(x.in_features, x.out_features, x.bias, x.activation) for x in spec.dense]) == (
        "weightedmean", [(64, 96, False, "torch.nn.modules.linear.Identity"),
                         (96, 32, True, "torch.nn.modules.activation.Tanh")])
    e = Engine(EngineConfig(model=str(d), device="cpu", dtype="float32"))
    assert_parity(ours(e, st, TEXTS), st.encode(TEXTS, convert_to_tensor=True), True)


def _spec_dir(tmp_path, modules, dense_cfg=None):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64, "vocab_size": 10}))
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"path": p, "type": "sentence_transformers.models." + t} if "." not in t else {"path": p, "type": t}
         for t, p in modules]))
    (tmp_path / "2_Dense").mkdir(exist_ok=True)
    (tmp_path / "2_Dense" / "config.json").write_text(json.dumps(
        dense_cfg or {"in_features": 64, "out_features": 8, "bias": True,
                      "activation_function": "torch.nn.modules.activation.Tanh"}))
    (tmp_path / "2_Dense" / "model.safetensors").write_bytes(b"")
    return tmp_path


@pytest.mark.parametrize("modules, dense_cfg, message", [
    ([("Transformer", ""), ("Pooling", "1_Pooling"), ("my_pkg.Whitening", "")], None,
     "module 'my_pkg.Whitening' is not supported"),
    ([("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", ""), ("Dense", "2_Dense")], None,
     "comes after Normalize"),
    ([("Transformer", ""), ("Dense", "2_Dense")], None, "without a Pooling module"),
    ([("Transformer", ""), ("Pooling", "1_Pooling"), ("Dense", "2_Dense")],
     {"in_features": 32, "out_features": 8}, "in_features 32 does not match the 64"),
    ([("Transformer", ""), ("Pooling", "1_Pooling"), ("Dense", "2_Dense")],
     {"in_features": 64, "out_features": 8, "use_residual": True}, "use_residual"),
    ([("Transformer", ""), ("Pooling", "1_Pooling"), ("Dense", "2_Dense")],
     {"in_features": 64, "out_features": 8, "module_input_name": "token_embeddings"}, "token_embeddings"),
])
def test_pipelines_not_served_are_clear_errors(tmp_path, modules, dense_cfg, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec.read(_spec_dir(tmp_path, modules, dense_cfg))


def test_dense_weights_and_activation_are_checked(bert_dir, tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "m"
    save_pipeline(bert_dir, d, "mean", DENSES["one"])
    cfg = json.loads((d / "2_Dense" / "config.json").read_text())
    (d / "2_Dense" / "config.json").write_text(json.dumps({**cfg, "activation_function": "my_pkg.Swish"}))
    with pytest.raises(ValueError, match="activation_function 'my_pkg.Swish' is not supported"):
        Engine(EngineConfig(model=str(d), device="cpu", dtype="float32"))
    (d / "2_Dense" / "config.json").write_text(json.dumps(cfg))
    save_file({"linear.weight": torch.zeros(48, 64)}, str(d / "2_Dense" / "model.safetensors"))  # no bias
    with pytest.raises(ValueError, match="do not match its config"):
        Engine(EngineConfig(model=str(d), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def dense_stack(tmp_path_factory, bert_dir):
    """deploy.local serving a Transformer -> mean Pooling -> Dense -> Dense -> Normalize pipeline."""
    d = tmp_path_factory.mktemp("dense-pipeline") / "dense-pipeline"
    st = save_pipeline(bert_dir, d, "mean", DENSES["two"])
    with local_stack(d, tmp_path_factory.mktemp("dense-stack")) as (url, _):
        yield url, d.name, st


def test_dense_pipeline_served_with_matryoshka_dimensions(dense_stack):
    from openai import OpenAI

    url, name, st = dense_stack
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    want = st.encode(TEXTS, convert_to_numpy=True)
    got = np.array([x.embedding for x in client.embeddings.create(model=name, input=TEXTS).data])
    assert got.shape == (len(TEXTS), 32)  # the last Dense's out_features
    assert_parity(torch.as_tensor(got, dtype=torch.float32), want, True)
    short = np.array([x.embedding for x in client.embeddings.create(model=name, input=TEXTS, dimensions=12).data])
    cut = want[:, :12] / np.linalg.norm(want[:, :12], axis=1, keepdims=True)
    assert short.shape == (len(TEXTS), 12)
    assert_parity(torch.as_tensor(short, dtype=torch.float32), cut, True)
    import openai

    with pytest.raises(openai.BadRequestError, match="between 1 and 32"):
        client.embeddings.create(model=name, input="hi", dimensions=64)  # the hidden size is not the output's


def quantize_int8(x: torch.Tensor) -> np.ndarray:
    """pplx-embed-v1's quantizer (its st_quantize.py, Int8TanhQuantizer) as published: tanh, times 127,
    rounded, clamped to [-128, 127]; what sentence-transformers' encode() returns by default for it."""
    return torch.clamp(torch.round(torch.tanh(x) * 127), -128, 127).numpy().astype(np.int8)


def quantize_ubinary(x: torch.Tensor) -> np.ndarray:
    """Its packed binary quantization ("ubinary"): the bits x >= 0, packed along the last axis."""
    return np.packbits((x >= 0).numpy(), axis=-1)


@pytest.fixture(scope="module")
def pplx_tulip(tmp_path_factory):
    """A Tulip serving a tiny directory in pplx-embed-v1's published layout."""
    d, hf = save_pplx(tmp_path_factory.mktemp("pplx") / "pplx")
    hf.config._attn_implementation = "eager"
    port = free_port()
    proc = Proc(["-m", "tulip", "--model", str(d), "--port", str(port), "--device", "cpu"],
                tmp_path_factory.mktemp("pplx-tulip"))
    proc.wait_for(lambda: "TULIP_READY" in proc.output())
    yield f"127.0.0.1:{port}", hf
    proc.stop()


def test_pplx_layout_float_int8_and_binary(pplx_tulip):
    from trellis.client import TulipClient
    from trellis.tulip.v1 import tulip_pb2

    target, hf = pplx_tulip
    seqs = [[5, 6, 7], [9], list(range(0, 256)), list(range(100, 140)), [3, 4, 400, 17, 250]]
    with torch.no_grad():
        ref = torch.stack([qwen3_reference(hf, s, bidirectional=True).mean(0) for s in seqs])  # mean pooling

    async def main():
        async with TulipClient(target) as c:
            info = await c.info()
            return (info, await c.embed(seqs), await c.embed(seqs, encoding=tulip_pb2.ENCODING_INT8),
                    await c.embed(seqs, encoding=tulip_pb2.ENCODING_BINARY),
                    await c.embed(seqs, 24, encoding=tulip_pb2.ENCODING_INT8))

    info, f, i8, bits, i8_24 = asyncio.run(main())
    assert list(info.encodings) == [tulip_pb2.ENCODING_FLOAT32, tulip_pb2.ENCODING_INT8, tulip_pb2.ENCODING_BINARY]
    assert (info.pooling, info.normalized, info.embedding_dim) == ("mean", False, 64)
    # float: the mean-pooled vector before the quantizer (bidirectional whatever the config's flags)
    assert_parity(torch.from_numpy(f.copy()), ref, False)
    # int8 / binary: the quantizer's definition, exactly, on the served vector; and the reference's codes
    # within one step (float32 rounding may cross a .5 boundary)
    assert np.array_equal(i8, quantize_int8(torch.from_numpy(f.copy())))
    assert np.array_equal(bits, quantize_ubinary(torch.from_numpy(f.copy())))
    assert np.abs(i8.astype(int) - quantize_int8(ref).astype(int)).max() <= 1
    assert (bits.shape, i8.dtype) == ((len(seqs), 8), np.int8)
    # Matryoshka on int8: the first codes of the full vector's, as sentence-transformers' truncate_dim
    assert np.array_equal(i8_24, i8[:, :24])


def test_pplx_layout_spec(tmp_path):
    from rose.models import model_class
    from rose.models.pplx_qwen3 import PPLXQwen3Model

    d, _ = save_pplx(tmp_path / "pplx")
    spec = ModelSpec.read(d)
    assert (spec.model_type, spec.pooling, spec.normalize, spec.quantized_outputs, spec.dense) == (
        "bidirectional_pplx_qwen3", "mean", False, True, ())
    assert model_class(spec) is PPLXQwen3Model
    assert not PPLXQwen3Model.is_causal({**spec.config, "use_bidirectional_attention": False})  # always
    # the quantizer decides, not the family: a bidirectional Qwen3 without it offers no int8 / binary
    (d / "modules.json").write_text(json.dumps(json.loads((d / "modules.json").read_text())[:2]))
    assert ModelSpec.read(d).quantized_outputs is False
