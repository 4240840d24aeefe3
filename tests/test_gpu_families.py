"""CUDA only: each encoder family's real-shape preset (random weights) in bfloat16, CUDA-graph replay
against the same engine's eager steps (cosine >= 0.999), and the attention each one runs: MPNet on
the padded batch in graphs (against SDPA per sequence), ModernBERT's local layers on a windowed backend."""

import pytest
import torch
import torch.nn.functional as F

from rose.batch import Batch
from rose.engine import Engine, EngineConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PRESETS = ["msmarco-distilbert", "all-mpnet-base-v2", "gte-modernbert-base", "nomic-embed-text-v1.5",
           "splade-cocondenser"]


@pytest.mark.parametrize("preset", PRESETS)
def test_graph_replay_matches_eager(preset):
    g = torch.Generator().manual_seed(0)
    seqs = [[2] + torch.randint(10, 250, (n,), generator=g).tolist() + [3] for n in (300, 17, 120, 5)]
    batch = Batch.from_sequences(seqs)
    eager = Engine(EngineConfig(model=preset, graphs="off")).step(batch).synchronize()
    e = Engine(EngineConfig(model=preset, graphs="eager-all"))
    if preset == "all-mpnet-base-v2":  # its position bias: the padded batch, captured; SDPA per sequence agrees
        assert e.attention.name == "padded" and e.runner is not None
        sdpa = Engine(EngineConfig(model=preset, graphs="off", attention="sdpa")).step(batch).synchronize()
        assert F.cosine_similarity(sdpa, eager).min().item() >= 0.999
    assert (e.runner is not None) == e.attention.capturable  # else graphs are off, with a log line
    if preset == "gte-modernbert-base":
        assert e.attention.windowed
    for _ in range(3):  # capture, then replays
        out = e.step(batch).synchronize()
        assert F.cosine_similarity(out, eager).min().item() >= 0.999
    if e.runner is not None:
        assert e.runner.stats.replays >= 1
