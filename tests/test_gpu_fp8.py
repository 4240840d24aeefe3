"""CUDA only (compute capability 8.9+): the fp8 path (issue 52) on the GPU. The fused Triton kernels against
the unfused torch maths in bf16 at real widths, the fp8 GEMM against its dequantised product and bf16's,
graph replay equal to the eager fp8 step, and real all-MiniLM-L6-v2's fidelity held to a floor.

The floor, from the CPU measurement of the recipe (first block's FFN and last block's qkv / out in bf16, searched
weight scales; benchmarks/fp8_fidelity.py, 1,000 sentences, 2026-12-06, 2-core CPU machine): fp8 against bf16 min
cosine 0.99620, p01 0.99681, Spearman of pairwise similarities 0.99866, top-10 neighbour overlap 0.975 (the first
pass, first block whole: 0.99625 / 0.99699 / 0.99839 / 0.973). The min's floor is issue 52's target, 0.995; the
others sit under the CPU figures by about a third to a half of fp8's own distance (the GPU's bf16 reference is not
the CPU's: cuBLASLt's tanh GELU, other accumulation orders; e4m3 ties fall either way): p01 0.996, Spearman 0.9982,
overlap 0.965. Not yet run on a GPU with this recipe (the recipe before measured a min 0.0011 lower on an H100 than on this CPU at 3,000 sentences)."""

import pytest
import torch
import torch.nn.functional as F

from rose.batch import Batch
from rose.engine import Engine, EngineConfig
from rose.layers import fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU on this machine"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                       reason="fp8 GEMMs need compute capability 8.9+"),
]

FLOOR = {"cos_min": 0.995, "cos_p01": 0.996, "spearman_pairwise": 0.9982, "top10_overlap_mean": 0.965}
STEP = 2.0 ** -3


def within_one_step(got, want, share=0.01):
    (gq, gs), (wq, ws) = got, want
    assert torch.allclose(gs, ws, rtol=1e-5, atol=0), (gs / ws - 1).abs().max()
    g, w = fp8.dequantize(gq, gs), fp8.dequantize(wq, ws)
    assert ((g - w).abs() <= STEP * w.abs() + ws * 2.0 ** -9 + 1e-12).all()
    assert (gq.float() != wq.float()).float().mean().item() < share


@pytest.mark.parametrize("n", [384, 1024, 3072, 4096])
@pytest.mark.parametrize("act", [None, "gelu", "gelu_tanh", "swiglu"])
def test_quant_rows_kernel_equals_torch_in_bf16(n, act):
    from rose.kernels import quant

    torch.manual_seed(n)
    x = (torch.randn(2048 + 7, 2 * n if act == "swiglu" else n, device="cuda") * 4).bfloat16()
    within_one_step(quant.quant_rows(x, act), fp8.quant_rows_torch(x, act))


@pytest.mark.parametrize("n", [384, 1024, 2560])
@pytest.mark.parametrize("kind", ["post-layernorm", "pre-rmsnorm", "rmsnorm-alone", "final-rmsnorm"])
def test_norm_quant_kernel_equals_torch_in_bf16(n, kind):
    from rose.kernels import quant

    torch.manual_seed(n)
    y, res = (torch.randn(2048 + 7, n, device="cuda") * 3).bfloat16(), torch.randn(2048 + 7, n, device="cuda").bfloat16()
    g, b = (torch.rand(n, device="cuda") + 0.5).bfloat16(), torch.randn(n, device="cuda").bfloat16()
    *a, kw = {"post-layernorm": (y, res, g, b, 1e-12, dict()),
              "pre-rmsnorm": (y, res, g, None, 1e-6, dict(rms=True, pre=True, out=False)),
              "rmsnorm-alone": (y, None, g, None, 1e-6, dict(rms=True, out=False)),
              "final-rmsnorm": (y, res, g, None, 1e-6, dict(rms=True, pre=True, quant=False))}[kind]
    got, want = quant.norm_quant(*a, **kw), fp8.norm_quant_torch(*a, **kw)
    for gv, wv in zip(got[:2], want[:2]):
        assert (gv is None) == (wv is None)
        if gv is not None:  # bf16 outputs: one bf16 step at most
            assert ((gv.float() - wv.float()).abs() <= 2 ** -7 * wv.float().abs() + 1e-6).all()
    if got[2] is not None:
        within_one_step(got[2:], want[2:])


@pytest.mark.parametrize("n,k", [(3072, 1024), (1024, 1024), (4096, 1024), (1024, 4096)])  # bge-m3's four
def test_fp8_gemm_against_its_dequantised_product_and_bf16(n, k):
    """The issue's measurement: cosine to float32 per GEMM ~0.9993 (H100, row-wise scales)."""
    torch.manual_seed(n + k)
    lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    w = fp8.Fp8Linear.of(lin)
    x = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = fp8.quantize(x)
    got = w(xq, xs).float()
    want = fp8.dequantize(xq, xs) @ fp8.dequantize(w.weight, w.scale.t()).T + lin.bias.float()
    assert ((got - want).norm() / want.norm()).item() < 5e-3
    full = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    assert F.cosine_similarity(got, full).mean().item() > 0.999


def seqs(n, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("model", ["preset:bge-m3", "preset:pplx-embed-1-0.6b"])
def test_fp8_graph_replay_equals_eager_and_stays_near_bf16(model):
    """A 16 x 256 step (4,096 tokens, over the 1,024 threshold): its graph's replays equal the eager fp8 step;
    the small 1 x 128 step stays the bf16 engine's bit for bit (the fp8 weights sit unused beside it)."""
    batch = Batch.from_sequences(seqs(16, 256, 30000))
    eager = Engine(EngineConfig(model=model, device="cuda", quantization="fp8", graphs="off"))
    want = eager.step(batch).synchronize().clone()
    del eager
    graphed = Engine(EngineConfig(model=model, device="cuda", quantization="fp8"))
    outs = [graphed.step(batch).synchronize().clone() for _ in range(3)]  # eager hit, capture, replay
    assert graphed.runner.stats.replays >= 1
    for got in outs:
        assert (got - want).abs().max().item() < 1e-3
    bf16 = Engine(EngineConfig(model=model, device="cuda"))
    ref = bf16.step(batch).synchronize().clone()
    # random weights: a sanity bound only (on the CPU, 4 x 64: min cosine 0.991 bge-m3, 0.994 pplx-embed)
    assert F.cosine_similarity(outs[-1], ref).min().item() > 0.97
    small = Batch.from_sequences(seqs(1, 128, 30000, seed=1))
    assert torch.equal(graphed.step(small).synchronize(), bf16.step(small).synchronize())


def test_real_minilm_fidelity_holds_the_floor():
    """all-MiniLM-L6-v2's real weights, 1,000 generated sentences, every step through fp8, against bf16."""
    from benchmarks.fp8_fidelity import measure
    from trellis.modelref import resolve_model_path

    if not (resolve_model_path("default") / "model.safetensors").is_file():
        pytest.skip("all-MiniLM-L6-v2's weights are not here (benchmarks/fp8_gpu.sh carries them)")
    got = measure("default", 1000, "cuda", 8192, fp32=False, seed=0)["fp8_vs_bf16"]
    low = {k: got[k] for k, floor in FLOOR.items() if got[k] < floor}
    assert not low, f"fp8 fidelity under the floor {FLOOR}: {got}"
