"""CUDA only: each encoder family's real-shape preset (random weights) in bfloat16, CUDA-graph replay
against the same engine's eager steps (cosine >= 0.999), and the attention each one runs: MPNet and
T5 on the biased Triton attention in graphs (against SDPA per sequence and the padded batch), ModernBERT's
local layers on a windowed backend; the cross-encoder presets' logits replayed against eager."""

import pytest
import torch
import torch.nn.functional as F

from rose.batch import Batch
from rose.engine import Engine, EngineConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PRESETS = ["msmarco-distilbert", "all-mpnet-base-v2", "gte-modernbert-base", "nomic-embed-text-v1.5",
           "splade-cocondenser", "sentence-t5-base"]


@pytest.mark.parametrize("preset", PRESETS)
def test_graph_replay_matches_eager(preset):
    g = torch.Generator().manual_seed(0)
    seqs = [[2] + torch.randint(10, 250, (n,), generator=g).tolist() + [3] for n in (300, 17, 120, 5)]
    batch = Batch.from_sequences(seqs)
    eager = Engine(EngineConfig(model=f"preset:{preset}", graphs="off")).step(batch).synchronize()
    e = Engine(EngineConfig(model=f"preset:{preset}", graphs="eager-all"))
    if preset in ("all-mpnet-base-v2", "sentence-t5-base"):  # the position bias: the Triton kernel, captured; SDPA
        assert e.attention.name == "triton" and e.runner is not None  # and the padded batch agree
        for name in ("sdpa", "padded"):
            other = Engine(EngineConfig(model=f"preset:{preset}", graphs="off", attention=name)).step(batch).synchronize()
            assert F.cosine_similarity(other, eager).min().item() >= 0.999, name
    assert (e.runner is not None) == e.attention.capturable  # else graphs are off, with a log line
    if preset == "gte-modernbert-base":
        assert e.attention.windowed
    for _ in range(3):  # capture, then replays
        out = e.step(batch).synchronize()
        assert F.cosine_similarity(out, eager).min().item() >= 0.999
    if e.runner is not None:
        assert e.runner.stats.replays >= 1


@pytest.mark.parametrize("preset", ["bge-reranker-v2-m3", "gte-reranker-modernbert-base", "qwen3-reranker-0.6b",
                                    "mxbai-rerank-base-v1"])
def test_cross_encoder_graph_replay_matches_eager(preset):
    """Query-document pairs ([CLS] q [SEP] d [SEP]; ModernBERT's with segment starts, which it ignores):
    the logits of replayed graphs are the eager step's (ModernBERT's head on the mean of the states;
    Qwen3-Reranker's LogitScore on the last token, and its one short pair on the small step's kernels;
    DeBERTa-v3's per-sequence bias on the padded backend)."""
    g = torch.Generator().manual_seed(0)
    seqs, starts = [], []
    for q, d in ((12, 300), (8, 17), (20, 120), (5, 40)):
        a, b = (torch.randint(10, 250, (n,), generator=g).tolist() for n in (q, d))
        seqs.append([2] + a + [3] + b + [3])
        starts.append(q + 2)
    batches = [Batch.from_sequences(seqs, None, starts if preset == "gte-reranker-modernbert-base" else None)]
    if preset == "qwen3-reranker-0.6b":
        batches.append(Batch.from_sequences(seqs[-1:]))  # 47 tokens: under Qwen3's kernel cap
    eager_engine = Engine(EngineConfig(model=f"preset:{preset}", graphs="off"))
    e = Engine(EngineConfig(model=f"preset:{preset}", graphs="eager-all"))
    assert (e.runner is not None) == e.attention.capturable
    for batch in batches:
        eager = eager_engine.step(batch).synchronize()
        for _ in range(3):  # capture, then replays
            out = e.step(batch).synchronize()
            assert out.shape == (batch.num_seqs, 1)
            torch.testing.assert_close(out, eager, atol=0.02 * max(1.0, eager.abs().max().item()), rtol=0)
    if e.runner is not None:
        assert e.runner.stats.replays >= 1
