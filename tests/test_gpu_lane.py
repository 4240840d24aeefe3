"""The online lane (rose.engine.EngineConfig.online_lane_tokens) on a GPU: an online step launched while a bulk
step runs finishes first, beside it, and both give the vectors they give alone. Skipped without CUDA."""

import numpy as np
import pytest
import torch

from rose.batch import Batch
from rose.engine import Engine, EngineConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU on this machine"),
]


def seqs_of(lens, seed=0, vocab=30000):
    g = np.random.default_rng(seed)
    return [g.integers(5, vocab, n) for n in lens]


def backends():
    out = ["auto"]
    try:
        import flashinfer  # noqa: F401  (plans in device buffers: the lane must have its own)

        out.append("flashinfer-fa2")
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("attention", backends())
def test_an_online_step_beside_a_bulk_step_finishes_first_and_both_equal_their_steps_alone(attention):
    e = Engine(EngineConfig(model="preset:bge-m3", device="cuda", attention=attention, online_lane_tokens=1024))
    assert e.lane is not None and e.lane.ops.stream.priority < e.runner.ops.stream.priority
    bulk = Batch.from_sequences(seqs_of([512] * 16))  # 8,192 tokens: ~5-10 ms on an H100
    small = [Batch.from_sequences(seqs_of([n], seed=i + 1)) for i, n in enumerate((128, 77, 300))]
    for _ in range(3):  # eager, capture, replay, in both runners
        want_bulk = e.step(bulk).synchronize().clone()
        want = [e.step(b).synchronize().clone() for b in small]
        alone = [e.step(b, urgent=True).synchronize().clone() for b in small]
    for a, w in zip(alone, want):  # the lane's graphs, one at a time, equal the main runner's
        torch.testing.assert_close(a, w, atol=1e-3, rtol=0)
    replays = e.lane.stats.replays
    first, rounds = 0, 30
    for r in range(rounds):
        big = e.step(bulk)
        got = e.step(small[r % 3], urgent=True).synchronize().clone()
        first += not big.ready()  # the bulk step launched before it still running
        torch.testing.assert_close(got, want[r % 3], atol=1e-3, rtol=0)
        torch.testing.assert_close(big.synchronize(), want_bulk, atol=1e-3, rtol=0)
    assert e.lane.stats.replays == replays + rounds
    assert first >= 0.8 * rounds, f"the online step finished first in {first} of {rounds} rounds"
    # (review of 6dce07e) the lane's captures cleared cuBLAS's workspaces, the main runner's among them (CudaOps
    # .capture); a main-runner capture after them may be handed that freed workspace's memory: the main runner's
    # older graph and the new one both still give their vectors
    other = Batch.from_sequences(seqs_of([256] * 8, seed=9))
    want_other = [e.step(other).synchronize().clone() for _ in range(3)]  # eager, capture, replay
    torch.testing.assert_close(want_other[2], want_other[0], atol=1e-3, rtol=0)
    torch.testing.assert_close(e.step(bulk).synchronize(), want_bulk, atol=1e-3, rtol=0)
    torch.testing.assert_close(e.step(other).synchronize(), want_other[0], atol=1e-3, rtol=0)
