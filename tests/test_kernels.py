"""ROSE's Triton kernels (`rose.kernels`) against their torch references, and BERT's small-batch
path against its torch path. Without CUDA they run under Triton's interpreter (TRITON_INTERPRET=1,
float32), which checks the kernels' indexing, masking and maths; the GPU tests check bf16 speed paths."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="Triton is not installed")

from rose.kernels import attention as kattn  # noqa: E402
from rose.kernels import gemm  # noqa: E402
from rose.kernels import rows as krows  # noqa: E402
from rose.layers import pooling  # noqa: E402
from rose.layers.attention import AttentionBackend, AttentionMetadata, select_backend  # noqa: E402
from rose.models.bert import BertModel  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DT = torch.bfloat16 if DEV.type == "cuda" else torch.float32
TOL = 2e-2 if DT == torch.bfloat16 else 1e-5


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def rand(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).to(DEV, DT)


@pytest.mark.parametrize("m,n,k", [(128, 192, 256), (70, 96, 128), (64, 64, 384)])
@pytest.mark.parametrize("act", [None, "gelu", "swiglu", "geglu", "geglu_tanh"])
def test_linear_matches_reference(m, n, k, act):
    torch.manual_seed(m + n + k)
    x, b = rand(m, k), rand(n)
    w = rand(2 * n if act in gemm.GATED else n, k, scale=k ** -0.5)
    bias = None if act in gemm.GATED else b
    out = gemm.linear(x, w, bias, act)
    assert out.shape == (m, n) and torch.isfinite(out).all()
    assert rel(out, gemm.linear_reference(x, w, bias, act)) < TOL


@pytest.mark.parametrize("t,hidden,offset", [(70, 96, 0), (128, 1024, 2), (5, 1536, 2)])
def test_embed_norm_matches_reference(t, hidden, offset):
    torch.manual_seed(t + hidden)
    word, pos, types = rand(500, hidden), rand(300, hidden), rand(2, hidden)
    ids = torch.randint(0, 500, (t,), device=DEV)
    positions = torch.randint(0, 300 - offset, (t,), device=DEV)
    g, b = rand(hidden, scale=0.1) + 1, rand(hidden, scale=0.1)
    out = krows.embed_norm(ids, positions, word, pos, types[0], g, b, 1e-5, offset)
    assert out.shape == (t, hidden) and out.dtype == DT
    assert rel(out, krows.embed_norm_reference(ids, positions, word, pos, types[0], g, b, 1e-5, offset)) < TOL


def seq_ids_of(cu, t):
    """Each token's sequence (the padding after cu[-1]: the number of sequences, as staged)."""
    counts = (cu[1:] - cu[:-1]).long()
    ids = torch.repeat_interleave(torch.arange(len(counts), device=cu.device), counts)
    return torch.cat([ids, torch.full((t - ids.shape[0],), len(counts), device=cu.device)])


@pytest.mark.parametrize("last", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_pool_rows_matches_reference(last, normalize):
    """CLS / last-token rows, float32, normalised or not; empty dummy sequences at the end of the
    bucket (starting at T) read a valid row."""
    hidden = rand(40, 96)
    cu = torch.tensor([0, 9, 39, 40, 40, 40], dtype=torch.int32, device=DEV)
    out = krows.pool_rows(hidden, cu, last, normalize)
    want = pooling.pool(hidden, cu, seq_ids_of(cu, 40), "last" if last else "cls").float()
    want = pooling.normalize(want) if normalize else want
    assert out.shape == (5, 96) and out.dtype == torch.float32
    assert rel(out, want) < TOL
    if normalize:
        assert torch.allclose(out.norm(dim=1), torch.ones(5, device=DEV), atol=1e-3)
    kept = hidden[[0, 9, 39]]  # rows gathered already (`pooling.kept_rows`, no cu_seqlens): converted, normalised
    assert rel(krows.pool_rows(kept, None, last, normalize), pooling.normalize(kept) if normalize else kept) < TOL


@pytest.mark.parametrize("d", [96, 384, 1024])
def test_pool_mean_and_normalize_match_references(d):
    """Means over each sequence's tokens (longer than one 32-row chunk, one token, empty dummies at
    the end), then normalised in place."""
    hidden = rand(80, d)
    cu = torch.tensor([0, 1, 45, 79, 79, 79], dtype=torch.int32, device=DEV)
    out = krows.pool_mean(hidden, cu)
    assert out.shape == (5, d) and out.dtype == torch.float32
    want = pooling.pool(hidden, cu, seq_ids_of(cu, 80), "mean")  # token 79 is padding: pooled into a dropped row
    assert rel(out, want) < 1e-5 and torch.equal(out[3:], torch.zeros(2, d, device=DEV))
    normed = krows.normalize_rows(out.clone())
    assert rel(normed[:3], pooling.normalize(want[:3])) < 1e-5


@pytest.mark.parametrize("m,n,k,split,tile", [(128, 128, 256, 1, None), (128, 128, 256, 4, None),
                                              (70, 96, 512, 2, None), (70, 96, 256, 2, (4, 2)), (128, 128, 256, 4, (8, 4))])
@pytest.mark.parametrize("rms,pre,beta", [(False, False, True), (True, True, False), (False, True, False),
                                          (False, False, False)], ids=["bert", "qwen3", "modernbert", "ln-no-bias"])
def test_split_k_partials_reduced_by_add_norm(m, n, k, split, tile, rms, pre, beta):
    torch.manual_seed(split + m)
    x, w = rand(m, k), rand(n, k, scale=k ** -0.5)
    parts = gemm.linear_partials(x, w, split)
    assert parts.shape == (split, m, n) and parts.dtype == torch.float32
    assert rel(parts.sum(0), x.float() @ w.float().T) < TOL
    bias, res, g, beta = (None if rms else rand(n)), rand(m, n), rand(n), (rand(n) if beta else None)
    got = gemm.add_norm(parts, bias, res, g, beta, 1e-6, rms=rms, config=tile, pre=pre)  # tile: rows, warps
    want = gemm.add_norm_reference(x.float() @ w.float().T, bias, res, g, beta, 1e-6, rms=rms, pre=pre)
    for a, b in zip(got if pre else (got,), want if pre else (want,)):
        assert a.dtype == DT and rel(a, b) < TOL


@pytest.mark.parametrize("offset", [0.0, 30.0, 100.0])
def test_add_norm_layernorm_statistics_in_one_pass_hold_on_an_offset_row(offset):
    """add_norm's LayerNorm takes mean and variance from one reduction (sum, sum of squares). Rows whose
    mean is many times their spread (here offset by up to ~60 standard deviations) are where
    E[x^2] - mean^2 loses digits: in float32 (the CPU run) still well under bf16's rounding (2^-8, what the
    kernel writes on the GPU); 30 sd measured 8e-5."""
    torch.manual_seed(int(offset))
    m, n = 64, 384
    parts, res = torch.randn(2, m, n, device=DEV), rand(m, n) + offset
    g, beta = rand(n).abs() + 0.5, rand(n)
    got = gemm.add_norm(parts, None, res, g, beta, 1e-6)
    want = gemm.add_norm_reference(parts.sum(0), None, res, g, beta, 1e-6)
    assert rel(got, want) < max(TOL, 1e-3)


@pytest.mark.parametrize("split", [1, 4])
def test_add_norm_applies_the_projections_own_norm_first(split):
    """Gemma3's sandwich: RMSNorm of the projection (`post`), the residual add, the next RMSNorm."""
    torch.manual_seed(split)
    m, n, k = 70, 96, 256
    x, w, res = rand(m, k), rand(n, k, scale=k ** -0.5), rand(m, n)
    gp, g = rand(n).abs() + 0.5, rand(n).abs() + 0.5
    got = gemm.add_norm(gemm.linear_partials(x, w, split), None, res, g, None, 1e-6, rms=True, post=gp)
    want = gemm.add_norm_reference(x.float() @ w.float().T, None, res, g, None, 1e-6, rms=True, post=gp)
    plain = gemm.add_norm_reference(x.float() @ w.float().T, None, res, g, None, 1e-6, rms=True)
    for a, b, c in zip(got, want, plain):
        assert rel(a, b) < TOL and rel(a, c) > 0.05  # the post norm is applied


def test_plan_takes_the_measured_entry_then_the_heuristic():
    assert gemm.plan(128, 1024, 4096) == gemm.TUNED[(1024, 4096, 128)]
    assert gemm.plan(300, 1024, 4096) == gemm.TUNED[(1024, 4096, 512)]
    config, split, tma = gemm.plan(128, 384, 1536)  # a shape nobody measured
    assert split == gemm.split_for(128, 384, 1536) and not tma and 1536 % (split * config[2]) == 0


def test_split_for_fills_the_gpu_without_tiny_k():
    assert gemm.split_for(128, 1024, 4096) > 1
    assert 4096 // gemm.split_for(128, 1024, 4096) >= 256
    assert gemm.split_for(4096, 1024, 1024) == 1  # enough programs already
    assert 384 % (gemm.split_for(64, 384, 384) * 64) == 0


@pytest.mark.parametrize("lens,heads,kv_heads,dim,causal", [
    ([5, 128, 37], 4, 4, 64, False), ([100, 1], 4, 2, 128, True), ([64], 2, 2, 32, False), ([300], 2, 1, 64, True),
    ([256, 7], 2, 2, 96, False)])  # head dim under its power-of-two block: full key blocks masked on d alone
def test_short_attention_matches_sdpa(lens, heads, kv_heads, dim, causal):
    torch.manual_seed(len(lens) + dim)
    T = sum(lens) + 7  # a bucket's padding rows
    q, k, v = rand(T, heads, dim), rand(T, kv_heads, dim), rand(T, kv_heads, dim)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist() + [sum(lens)] * 2, dtype=torch.int32)  # 2 dummies
    max_len = max(64, 1 << (max(lens) - 1).bit_length())
    want = kattn.attention_reference(q, k, v, cu, causal)
    for tile in (None, (16, 128, 2), (64, 32, 4)):  # the default and other launch tiles
        out = kattn.attention(q, k, v, cu.to(DEV), max_len, causal, config=tile)
        assert rel(out, want) < TOL
        assert (out[sum(lens):] == 0).all()  # padding rows are written, as zeros


@pytest.mark.parametrize("causal", [False, True])
def test_short_attention_adds_a_score_bias_by_position(causal):
    """MPNet's relative position bias: [heads, L, L] for the length bucket L, a strided view (as the
    model's permuted lookup is), each sequence reading its top-left [n, n]; padding rows stay zero."""
    torch.manual_seed(5)
    lens, H, D, L = [5, 70, 1, 0, 33], 2, 32, 128
    T = sum(lens) + 9
    q, k, v = rand(T, H, D), rand(T, H, D), rand(T, H, D)
    bias = rand(L, L, H, scale=2.0).permute(2, 0, 1)
    assert not bias.is_contiguous()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    want = kattn.attention_reference(q, k, v, cu, causal, bias)
    assert rel(want, kattn.attention_reference(q, k, v, cu, causal)) > 0.05  # the bias matters
    for tile in (None, (16, 32, 2)):
        out = kattn.attention(q, k, v, cu.to(DEV), L, causal, config=tile, bias=bias)
        assert rel(out, want) < TOL
        assert (out[sum(lens):] == 0).all()
    with pytest.raises(ValueError, match="score bias"):
        kattn.attention(q, k, v, cu.to(DEV), L, causal, bias=bias[:, :64, :64])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window,tile", [(9, None), (9, (16, 32, 2)), (65, (64, 32, 4)), (1, None)])
def test_short_attention_honours_a_sliding_window(causal, window, tile):
    """|i - j| < window (j <= i if causal), as the band mask of SDPA: sequences longer and shorter
    than the window, blocks of keys wholly outside it skipped, padding rows zero."""
    torch.manual_seed(window)
    lens, H, D = [5, 150, 1, 0, 40], 2, 32
    T = sum(lens) + 9
    q, k, v = rand(T, H, D), rand(T, H, D), rand(T, H, D)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    want = kattn.attention_reference(q, k, v, cu, causal, window=window)
    assert rel(want, kattn.attention_reference(q, k, v, cu, causal)) > 0.05  # the window matters
    out = kattn.attention(q, k, v, cu.to(DEV), 256, causal, config=tile, window=window)
    assert rel(out, want) < TOL
    assert (out[sum(lens):] == 0).all()
    from rose.layers.attention import SdpaBackend  # and the engine's reference backend agrees

    meta = AttentionMetadata(cu, 256, tuple(lens), causal, window)
    assert rel(SdpaBackend()(q, k, v, meta)[:sum(lens)], want[:sum(lens)]) < TOL


def test_attention_tiles_fit_in_shared_memory_and_keep_the_measured_ones():
    for d in (32, 64, 128, 256):
        for length, seqs in ((1, 1), (128, 1), (600, 4), (512, 5), (4096, 1)):
            bm, bn, _ = kattn.tile(length, d, seqs, 16)
            assert kattn.smem_bytes(bm, bn, d) <= kattn.SMEM_BUDGET and bn >= 16
    assert kattn.tile(128, 64, 1, 16) == (64, 128, 4) and kattn.tile(128, 128, 1, 16) == (32, 128, 4)
    assert kattn.tile(128, 256, 1, 3)[1] == 32  # EmbeddingGemma: fewer keys per iteration


def test_attention_reads_strided_qkv_without_a_copy():
    T, H, D = 40, 2, 32
    qkv = rand(T, 3 * H * D)
    q, k, v = qkv.view(T, 3, H, D).unbind(1)
    assert not q.is_contiguous()
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    out = kattn.attention(q, k, v, cu.to(DEV), 64)
    assert rel(out, kattn.attention_reference(q, k, v, cu)) < TOL


class Interpreted(AttentionBackend):
    """The triton backend's call, which select_backend offers on CUDA only."""

    name = "triton"

    def __call__(self, q, k, v, meta):
        return kattn.attention(q, k, v, meta.cu_seqlens, meta.max_seqlen, meta.causal, bias=meta.bias,
                               window=meta.window)


def ragged_batch(causal: bool, lens=(9, 30, 1), bucket: int = 48):
    """Token ids, positions and metadata of `lens` padded to a `bucket`-token step (rows past the last
    sequence belong to none), as a graph's step sees them."""
    ids = torch.randint(5, 100, (bucket,), device=DEV)
    pos = torch.cat([torch.arange(n) for n in lens] + [torch.zeros(bucket - sum(lens), dtype=torch.long)]).to(DEV)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    return ids, pos, AttentionMetadata(cu, 64, tuple(lens), causal)


KEPT = (0, 9, 38)  # ragged_batch's first tokens and its last sequence's last token: `Family.forward`'s rows


def kept_rows_agree(model, ids, pos, meta, backend, want, torch_rows=None):
    """The model with `rows` (the last block after attention on those rows alone) gives want's rows;
    `torch_rows`: the same from the torch path, taken before the small path was turned on."""
    rows = torch.tensor(KEPT, device=DEV)
    got = model(ids, pos, meta, backend, rows=rows)
    assert got.shape[0] == len(KEPT) and rel(got, want[list(KEPT)]) < TOL
    if torch_rows is not None:
        assert torch_rows.shape[0] == len(KEPT) and rel(torch_rows, want[list(KEPT)]) < TOL


BERT = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
            max_position_embeddings=128, hidden_act="gelu_new", layer_norm_eps=1e-12)


@pytest.mark.parametrize("ops", [None, "qkv,out,up,down"], ids=["default", "all"])
def test_bert_small_step_equals_torch_path(ops, monkeypatch):
    """The up projection in Triton applies tanh GELU; in cuBLASLt (`linear_gelu`) tanh on CUDA, erf on
    CPU: each is compared with a model whose torch path has the same GELU."""
    if ops:
        monkeypatch.setenv("ROSE_TRITON_OPS", ops)
    torch.manual_seed(0)
    act = "gelu_new" if ops or DEV.type == "cuda" else "gelu"
    model = BertModel({**BERT, "hidden_act": act}).to(DEV, DT).eval()
    ids, pos, meta = ragged_batch(causal=False)
    with torch.inference_mode():
        want = model(ids, pos, meta, select_backend("sdpa", DEV, DT))[:40]
        torch_rows = model(ids, pos, meta, select_backend("sdpa", DEV, DT), rows=torch.tensor(KEPT, device=DEV))
        assert model.use_kernels(1024)
        got = model(ids, pos, meta, Interpreted())[:40]
        kept_rows_agree(model, ids, pos, meta, Interpreted(), want, torch_rows)
    assert rel(got, want) < TOL


@pytest.mark.parametrize("family", ["distilbert", "mpnet", "nomic_bert"])
@pytest.mark.parametrize("ops", [None, "qkv,out,up,down"], ids=["default", "all"])
def test_post_norm_small_step_of_other_families_equals_torch_path(family, ops, monkeypatch):
    """DistilBERT, MPNet and NomicBERT take BERT's small step (`rose.layers.small_step.post_norm_block`)
    under their own names; MPNet's position bias goes into the Triton attention kernel, NomicBERT's
    q/k are rotated in one kernel and its SwiGLU is the gate/up GEMM's epilogue."""
    import transformers

    from rose.models.distilbert import DistilBertModel
    from rose.models.mpnet import MPNetModel
    from rose.models.nomic_bert import NomicBertModel

    if ops:
        monkeypatch.setenv("ROSE_TRITON_OPS", ops)
    torch.manual_seed(1)
    act = "gelu_new" if ops or DEV.type == "cuda" else "gelu"
    if family == "distilbert":
        cfg = transformers.DistilBertConfig(vocab_size=100, dim=64, n_layers=2, n_heads=2, hidden_dim=128,
                                            activation=act).to_dict()
        model = DistilBertModel(DistilBertModel.standard_config(cfg))
    elif family == "nomic_bert":  # the published remote-code config's GPT-2 style keys
        model = NomicBertModel(NomicBertModel.standard_config(dict(
            vocab_size=100, n_embd=64, n_head=2, n_layer=2, n_inner=128, n_positions=128, layer_norm_epsilon=1e-12)))
    else:
        cfg = transformers.MPNetConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=128, hidden_act=act).to_dict()
        model = MPNetModel(cfg)
    model = model.to(DEV, DT).eval()
    model.materialize(DEV)  # NomicBERT's rotary table back in float32
    ids, pos, meta = ragged_batch(causal=False)
    sdpa = select_backend("sdpa", DEV, DT)
    calls = []
    monkeypatch.setattr(gemm, "add_norm", lambda *a, f=gemm.add_norm, **kw: calls.append(1) or f(*a, **kw))
    with torch.inference_mode():
        want = model(ids, pos, meta, sdpa)[:40]
        torch_rows = model(ids, pos, meta, sdpa, rows=torch.tensor(KEPT, device=DEV))
        assert model.use_kernels(1024) == 1024 and not calls
        got = model(ids, pos, meta, Interpreted())[:40]
        assert len(calls) == 4  # two add + norm kernels per block: the small step ran
        kept_rows_agree(model, ids, pos, meta, Interpreted(), want, torch_rows)
    assert rel(got, want) < TOL


def test_use_kernels_needs_an_ffn_the_epilogue_has():
    from rose.models.nomic_bert import NomicBertModel

    assert not BertModel({**BERT, "hidden_act": "relu"}).use_kernels(1024)
    cfg = dict(vocab_size=100, n_embd=64, n_head=2, n_layer=1, n_inner=128, n_positions=128)
    assert NomicBertModel(NomicBertModel.standard_config(cfg)).use_kernels(1024) == 1024
    assert not NomicBertModel(NomicBertModel.standard_config({**cfg, "mlp_fc1_bias": True})).use_kernels(1024)
    from rose.models.qwen3 import Qwen3Model

    assert Qwen3Model(QWEN3).use_kernels(1024) == 256  # its cap
    assert Qwen3Model(QWEN3).use_kernels(128) == 128
    assert not Qwen3Model({**QWEN3, "mlp_bias": True}).use_kernels(1024)  # its epilogues have no biases


@pytest.mark.parametrize("act", [None, "gelu", "swiglu"])
@pytest.mark.parametrize("split", [1, 2])
def test_tma_kernel_matches_pointer_kernel(act, split):
    torch.manual_seed(split)
    m, n, k = 70, 96, 256
    x = rand(m, k)
    w = rand(2 * n if act == "swiglu" else n, k, scale=k ** -0.5)
    b = None if act == "swiglu" else rand(n)
    want = gemm.linear_reference(x, w, b, act)
    assert rel(gemm.linear(x, w, b, act, tma=True), want) < TOL
    if act is None:
        assert rel(gemm.linear_partials(x, w, split, tma=True).sum(0), x.float() @ w.float().T) < TOL


@pytest.mark.parametrize("norm", [True, False], ids=["qwen3", "rotary-only"])
def test_qk_norm_rope_matches_reference(norm):
    from rose.kernels.rope import qk_norm_rope, qk_norm_rope_reference
    from rose.layers.rotary import Rotary, apply_rotary

    torch.manual_seed(3)
    H, Hk, D, T = 4, 2, 64, 37
    qkv = rand(T, (H + 2 * Hk) * D)
    pos = torch.randint(0, 500, (T,)).to(DEV)
    rotary = Rotary(D, 512, 1e6)
    table = rotary.cos_sin.to(DEV)
    qw, kw = (rand(D), rand(D)) if norm else (None, None)
    got = qk_norm_rope(qkv, pos, table, qw, kw, 1e-6, H, Hk, D)
    want = qk_norm_rope_reference(qkv, pos, table, qw, kw, 1e-6, H, Hk, D)
    for g, w in zip(got, want):
        assert g.shape == w.shape and rel(g, w) < TOL
    if not norm:  # the models' own rotary (NomicBERT's torch path) agrees
        q, k, _ = qkv.float().split([H * D, Hk * D, Hk * D], dim=-1)
        rq, rk = apply_rotary(q.view(T, H, D), k.view(T, Hk, D), table[:, pos].unsqueeze(2))
        assert rel(got[0], rq) < TOL and rel(got[1], rk) < TOL


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh"])
def test_modernbert_small_step_equals_torch_path(act):
    """Pre-norm LayerNorm without bias fused with each residual add, the GeGLU epilogue, both rotary
    bases, the local layers' window (SDPA's band mask, lens past it): against the torch path; a tanh
    GELU keeps torch's path."""
    from rose.models.modernbert import ModernBertModel

    torch.manual_seed(2)
    cfg = dict(vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, intermediate_size=96,
               max_position_embeddings=128, global_attn_every_n_layers=3, local_attention=16, hidden_activation=act)
    model = ModernBertModel(cfg).to(DEV, DT).eval()
    model.materialize(DEV)
    for p in model.parameters():  # norms away from 1, so a wrong weight shows
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    ids, pos, meta = ragged_batch(causal=False)
    sdpa = select_backend("sdpa", DEV, DT)
    with torch.inference_mode():
        want = model(ids, pos, meta, sdpa)[:40]
        torch_rows = model(ids, pos, meta, sdpa, rows=torch.tensor(KEPT, device=DEV))
        assert model.use_kernels(1024) == (1024 if act == "gelu" else 0)
        got = model(ids, pos, meta, sdpa)[:40]
        assert rel(model(ids, pos, meta, Interpreted())[:40], want) < TOL  # the window in the Triton kernel
        kept_rows_agree(model, ids, pos, meta, Interpreted(), want, torch_rows)
    assert rel(got, want) < TOL
    if act == "gelu":  # the window reached the local layers: without it the output moves
        model.window = 10_000
        with torch.inference_mode():
            assert rel(got, model(ids, pos, meta, sdpa)[:40]) > 0.03


QWEN3 = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, intermediate_size=96, max_position_embeddings=256, is_causal=False)


@pytest.mark.parametrize("ops", [None, "qkv,out,up,down", "out,down"], ids=["default", "all", "cublas-up"])
@pytest.mark.parametrize("causal", [False, True])
def test_qwen3_small_step_equals_torch_path(ops, causal, monkeypatch):
    from rose.models.qwen3 import Qwen3Model

    if ops:
        monkeypatch.setenv("ROSE_TRITON_OPS", ops)
    torch.manual_seed(1)
    model = Qwen3Model({**QWEN3, "is_causal": causal}).to(DEV, DT).eval()
    model.materialize(DEV)
    for p in model.parameters():  # norms away from 1, so a wrong weight shows
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)
    ids, pos, meta = ragged_batch(causal)
    with torch.inference_mode():
        want = model(ids, pos, meta, select_backend("sdpa", DEV, DT))[:40]
        torch_rows = model(ids, pos, meta, select_backend("sdpa", DEV, DT), rows=torch.tensor(KEPT, device=DEV))
        assert model.use_kernels(1024) == Qwen3Model.MAX_KERNEL_TOKENS == 256
        got = model(ids, pos, meta, Interpreted())[:40]
        kept_rows_agree(model, ids, pos, meta, Interpreted(), want, torch_rows)
    assert rel(got, want) < TOL


def test_gemma3_small_step_equals_torch_path():
    """EmbeddingGemma's block in ROSE's kernels: (1 + w) RMSNorms, the post-attention and
    post-feedforward norms fused with the residual add and the next norm, q/k norm + rotary per layer
    type (their own bases), GeGLU (tanh) in the gate/up epilogue, windowed and full layers."""
    import transformers

    from rose.models.gemma3 import Gemma3TextModel

    cfg = transformers.Gemma3TextConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                        max_position_embeddings=256, sliding_window=8, query_pre_attn_scalar=24,
                                        use_bidirectional_attention=True,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    torch.manual_seed(2)
    model = Gemma3TextModel(cfg.to_dict()).to(DEV, DT).eval()
    for name, p in model.named_parameters():  # (1 + w) norms away from 1, so a wrong weight shows
        if p.dim() == 1:
            p.data.uniform_(-0.5, 0.5)
    model.materialize(DEV)
    ids, pos, meta = ragged_batch(causal=False)
    with torch.inference_mode():
        want = model(ids, pos, meta, select_backend("sdpa", DEV, DT))[:40]
        torch_rows = model(ids, pos, meta, select_backend("sdpa", DEV, DT), rows=torch.tensor(KEPT, device=DEV))
        assert model.use_kernels(1024) == Gemma3TextModel.MAX_KERNEL_TOKENS
        got = model(ids, pos, meta, Interpreted())[:40]
        kept_rows_agree(model, ids, pos, meta, Interpreted(), want, torch_rows)
        model.windows = (0,) * 3  # the windows bind: without them the output moves
        assert rel(got, model(ids, pos, meta, Interpreted())[:40]) > 0.03
    assert rel(got, want) < TOL
