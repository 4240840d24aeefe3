"""The persistent one-launch layer (`rose.kernels.persistent`, issue #52's prototype) against the block's own
eager forward (`rose.models.bert.BertLayer`) on the same weights. Without CUDA it runs under Triton's
interpreter (TRITON_INTERPRET=1, float32), whose programs run one after another: the first takes every tile
in queue order, so these check each stage's maths, the queue's stage boundaries and that every wait is one
an earlier tile satisfies (with `max_spins=0` a wait that would have to spin is counted in `err`), but not
the GPU's memory ordering nor that each wait covers everything its tile reads: the GPU test does that by
running many launches at several grids and asking for the same bits every time."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="Triton is not installed")

from rose.kernels import persistent as P  # noqa: E402
from rose.layers.attention import AttentionMetadata, SdpaBackend  # noqa: E402
from rose.models.bert import BertLayer  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DT = torch.bfloat16 if DEV.type == "cuda" else torch.float32
TOL = 2e-2 if DT == torch.bfloat16 else 1e-5


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def make_layer(hidden, heads, ffn, act="gelu_new", seed=0):
    torch.manual_seed(seed)
    cfg = dict(hidden_size=hidden, num_attention_heads=heads, intermediate_size=ffn, hidden_act=act,
               layer_norm_eps=1e-5)
    layer = BertLayer(cfg).eval()
    for name, p in layer.named_parameters():  # norms and biases away from (1, 0), so a wrong one shows
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5) if "LayerNorm.weight" in name else p.data.uniform_(-0.5, 0.5)
    return layer.to(DEV, DT)


def eager(layer, x):
    """The block's own forward (torch linear layers, SDPA, LayerNorm; on CUDA in bf16 its up projection is
    cuBLASLt's tanh GELU)."""
    meta = AttentionMetadata(torch.tensor([0, x.shape[0]], dtype=torch.int32, device=DEV), 128, (x.shape[0],))
    with torch.inference_mode():
        return layer(x, meta, SdpaBackend())


SMALL = dict(block_n=32, block_n_up=32, block_k=32, attn_block_m=32, ln_rows=8)


@pytest.mark.parametrize("rows,heads,splits,lookahead,act", [
    (40, 2, (2, 2, 2), True, "gelu_new"),  # ragged rows (masks), head dim 32 = block_n, every GEMM split
    (64, 4, (1, 1, 2), False, "gelu"),  # head dim 16 < block_n (one q/k/v tile covers two heads), erf GELU
])
def test_persistent_layer_equals_the_blocks_eager_forward(rows, heads, splits, lookahead, act):
    hidden, ffn = 64, 128
    layer = make_layer(hidden, heads, ffn, act)
    x = torch.randn(rows, hidden).to(DEV, DT)
    want = eager(layer, x)
    c = P.PersistentConfig(**SMALL, split_qkv=splits[0], split_out=splits[1], split_down=splits[2],
                           lookahead=lookahead)
    ws = P.Workspace(hidden, ffn, heads, c, DEV, DT)
    w = P.LayerWeights.from_bert(layer)
    gelu = "erf" if act == "gelu" else "tanh"
    got = P.persistent_layer(x, w, ws, c, gelu)
    assert got.shape == x.shape and got.dtype == DT
    assert rel(got, want) < TOL
    assert ws.err.item() == 0  # no wait had to spin: the queue order is topological
    assert not ws.sync.any()  # the last program out reset the counters ...
    again = P.persistent_layer(x, w, ws, c, gelu)  # ... so a second launch on the same workspace runs
    assert torch.equal(again, got) and ws.err.item() == 0
    if DT == torch.float32:  # the GELU's form shows in float32 (tanh against erf: ~4e-5 here)
        other = P.persistent_layer(x, w, ws, c, "erf" if gelu == "tanh" else "tanh")
        assert rel(other, want) > 10 * rel(got, want)


def test_a_wait_no_earlier_tile_satisfies_is_counted():
    """Start the queue past the q/k/v tiles: every attention tile waits on tiles nobody runs, and each such
    wait is counted (it gives up after max_spins polls rather than hang) and the output is wrong."""
    hidden, heads, ffn = 64, 2, 128
    layer = make_layer(hidden, heads, ffn)
    x = torch.randn(16, hidden).to(DEV, DT)
    c = P.PersistentConfig(**SMALL, split_out=2, split_down=2, max_spins=0 if DEV.type == "cpu" else 1000)
    ws = P.Workspace(hidden, ffn, heads, c, DEV, DT)
    ws.qkv.zero_()
    ws.sync[0] = P.tile_counts(hidden, ffn, heads, 16, c)["qkv"]
    got = P.persistent_layer(x, P.LayerWeights.from_bert(layer), ws, c)
    failed, attention = ws.err.item(), P.tile_counts(hidden, ffn, heads, 16, c)["attention"]
    # on a GPU, tiles that wait on the stuck attention tiles may give up too
    assert failed == attention if DEV.type == "cpu" else failed >= attention
    assert rel(got, eager(layer, x)) > 0.05
    assert not ws.sync.any()


@pytest.mark.parametrize("rows,kw,match", [
    (129, {}, "rows 129"), (8, dict(block_n=48), "block_n 48"), (8, dict(split_out=3), "split_out 3"),
    (8, dict(attn_block_m=24), "attn_block_m 24"), (8, dict(ln_rows=3), "ln_rows 3"),
])
def test_shapes_the_tiling_does_not_cover_are_refused(rows, kw, match):
    with pytest.raises(ValueError, match=match):
        P.check(1024, 4096, 16, rows, P.PersistentConfig(**kw))


def test_tile_counts_of_the_bge_m3_layer():
    counts = P.tile_counts(1024, 4096, 16, 128, P.PersistentConfig())
    assert counts == {"qkv": 48, "attention": 32, "out": 64, "norm1": 16, "up": 64, "down": 64, "norm2": 16}
    w = P.PersistentConfig()
    assert P.sync_size(16, w) == 2 + 16 + 4 + 2 + 4 + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU on this machine")
@pytest.mark.parametrize("rows", [128, 77])
def test_gpu_bge_m3_layer_matches_eager_and_repeats_bit_for_bit(rows):
    """bge-m3's layer shape in bf16 against the eager block; 100 launches at each of three grids (one, two
    programs per SM, and 8 programs, where most waits spin) give the same bits with no failed wait: a missing
    wait or a memory-ordering fault would read a tile before it is written and show as a difference."""
    layer = make_layer(1024, 16, 4096, act="gelu")
    x = torch.randn(rows, 1024, device=DEV).to(DT)
    want = eager(layer, x)
    w = P.LayerWeights.from_bert(layer)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    first = None
    for programs in (sms, 2 * sms, 8):
        c = P.PersistentConfig(programs=programs)
        ws = P.Workspace(1024, 4096, 16, c, DEV, DT)
        outs = [P.persistent_layer(x, w, ws, c) for _ in range(100)]
        torch.cuda.synchronize()
        assert ws.err.item() == 0 and not ws.sync.any()
        first = outs[0] if first is None else first
        assert all(torch.equal(o, first) for o in outs)
    assert rel(first, want) < TOL


def test_the_tests_small_shapes_compile_for_sm_90_with_the_l2_prefetch():
    """The interpreter never reaches the CUDA-only prefetch, so only a compile checks it: the tests' shapes (hidden
    64 in two K splits of bf16: a chunk of 32 elements under one 128-byte line of 64) had asked for
    tl.arange(0, 0) and failed on the H100 (#52). Compiled for sm_90 without a GPU, in a child process without
    TRITON_INTERPRET (under it triton.jit builds interpreted functions that do not compile)."""
    import subprocess
    import sys
    from pathlib import Path

    if not (Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump").exists():
        pytest.skip("this Triton has no bundled CUDA tools (ptxas, cuobjdump)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cells = ["tiny-split2", "tiny-16rows"]
    done = subprocess.run([sys.executable, "-m", "benchmarks.persistent", "--compile-only", "--variants", ",".join(cells)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    for cell in cells:
        line = next(line for line in done.stdout.splitlines() if line.startswith(cell))
        assert "LOCAL:0" in line and "L2 prefetches" in line and "L2 prefetches 0" not in line, line
