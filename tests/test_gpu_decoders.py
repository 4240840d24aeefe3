"""CUDA only: the decoder presets (real shapes, random weights) in bfloat16: CUDA-graph replay against
eager, and the windowed layers' backend (a window argument, or the fallback) against SDPA's band
mask on sequences longer than the window. Skipped (with the reason) without CUDA."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rose.batch import Batch
from rose.engine import Engine, EngineConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU on this machine"),
]

# preset: (window of its sliding layers, a length past it)
PRESETS = {"e5-mistral-7b-instruct": (4096, 4500), "gte-qwen2-1.5b-instruct": (0, 0),
           "embeddinggemma-300m": (257, 600)}


def seqs_of(lens, seed=0, vocab=250):
    g = np.random.default_rng(seed)
    return [g.integers(3, vocab, n) for n in lens]


def engine(name, **kw):
    return Engine(EngineConfig(model=name, device="cuda", dtype="bfloat16", **kw))


@pytest.fixture(scope="module", params=list(PRESETS))
def preset(request, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("TRELLIS_CACHE", str(tmp_path_factory.mktemp("presets")))
    eager, graphs = engine(request.param, graphs="off"), engine(request.param, graphs="lazy")
    yield request.param, eager, graphs
    del eager, graphs
    torch.cuda.empty_cache()
    mp.undo()


@pytest.mark.parametrize("lens", [(1,), (128,), (3, 9, 1), (512, 512, 100), (600,) * 4])
def test_graph_replay_equals_eager(preset, lens):
    name, eager, graphs = preset
    window, _ = PRESETS[name]
    assert graphs.model.window == window and (graphs.attention.windowed or not window)
    if graphs.runner is None:  # the windowed layers' fallback is not capturable (torch's varlen has no window)
        pytest.skip(f"no CUDA graphs for {name} with attention {graphs.attention.name}")
    batch = Batch.from_sequences(seqs_of(lens))
    want = eager.step(batch).synchronize().clone()
    for _ in range(3):  # eager hit, capture, replay
        got = graphs.step(batch).synchronize().clone()
        assert F.cosine_similarity(got, want).min().item() >= 0.999


def test_windowed_layers_match_sdpa_band_mask(preset):
    name, eager, _ = preset
    window, long = PRESETS[name]
    if not window:
        pytest.skip(f"{name} has no sliding-window layers")
    assert eager.attention.windowed  # its own window argument, or the fallback (named in Info)
    batch = Batch.from_sequences(seqs_of((long, 37)))
    ref = engine(name, graphs="off", attention="sdpa")
    want = ref.step(batch).synchronize().clone()
    del ref
    torch.cuda.empty_cache()
    got = eager.step(batch).synchronize()
    assert F.cosine_similarity(got, want).min().item() >= 0.999
