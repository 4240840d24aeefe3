"""GraphRunner's state machine, buckets, padding and oversize fallback on CPU, with the
CUDA calls faked (graphs that re-run the captured function on replay)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rose.batch import Batch
from rose.graphs import GraphConfig, GraphKey, GraphRunner
from rose.layers.attention import AttentionBackend


class MaskedAttention(AttentionBackend):
    """Capturable on CPU: the block-diagonal mask is derived on the device from cu_seqlens only (and
    the band of a sliding-window layer from the flat positions: |i - j| < window)."""

    name = "masked"
    capturable = True
    windowed = True

    def __call__(self, q, k, v, meta):
        T = q.shape[0]
        pos = torch.arange(T, device=q.device)
        seg = torch.searchsorted(meta.cu_seqlens.long(), pos, right=True)
        seg = torch.where(pos < meta.cu_seqlens[-1], seg, -1 - pos)  # padding tokens see only themselves
        mask = seg[:, None] == seg[None, :]
        if meta.window:
            mask &= (pos[:, None] - pos[None, :]).abs() < meta.window
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        return o.transpose(0, 1)


class FakeGraph:
    def __init__(self, fn, out):
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self):
        self.replays += 1
        new = self.fn()
        for o, n in zip(*((self.out, new) if isinstance(self.out, tuple) else ((self.out,), (new,)))):
            o.copy_(n)


class FakeEvent:
    def record(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


class FakeOps:
    def __init__(self):
        self.captured = []

    def pinned(self, shape, dtype):
        return torch.zeros(shape, dtype=dtype)

    def event(self):
        return FakeEvent()

    stream = None

    def use_stream(self):
        pass

    def capture(self, fn):
        out = fn()
        g = FakeGraph(fn, out)
        self.captured.append(g)
        return g, out

    def copy(self, dst, src):
        dst.copy_(src)

    def copier(self, dst, src):
        return lambda: dst.copy_(src)

    def launcher(self, g):
        return g.replay


def make_runner(engine, **kw):
    masked = MaskedAttention()

    def masked_call(fn, *args):
        saved, engine.attention = engine.attention, masked
        try:
            return fn(*args)
        finally:
            engine.attention = saved

    def forward(ids, pos, seq_ids, cu, max_seqlen):
        return masked_call(engine._forward, ids, pos, seq_ids, cu, max_seqlen)

    def forward_extras(ids, pos, seq_ids, cu, max_seqlen, extras):
        return masked_call(engine._forward_extras, ids, pos, seq_ids, cu, max_seqlen, extras)

    plans = []
    cfg = GraphConfig(**{"max_tokens": 2048, "max_seqs": 16, "ring": 3, **kw})
    runner = GraphRunner(forward, lambda key, cu, n: plans.append((key, cu.tolist(), n)), engine.embedding_dim,
                         torch.device("cpu"), cfg, ops=FakeOps(),
                         forward_extras=forward_extras if engine.heads is not None else None)
    runner.plans = plans
    return runner


def test_buckets():
    c = GraphConfig(max_tokens=2048)
    assert [c.token_bucket(n) for n in (1, 64, 65, 1000, 1024, 1025, 1280, 1281, 2048, 2049)] == [
        64, 64, 128, 1024, 1024, 1280, 1280, 1536, 2048, None]
    assert [c.seq_bucket(n) for n in (1, 2, 3, 5, 256, 257)] == [1, 2, 4, 8, 256, None]
    assert [c.len_bucket(n, 1024) for n in (1, 64, 65, 500, 1000)] == [64, 64, 128, 512, 1024]
    assert c.len_bucket(300, 320) == 320
    with pytest.raises(ValueError, match="graph mode 'sometimes'"):
        GraphConfig(mode="sometimes")
    with pytest.raises(ValueError, match="buckets must tile"):
        GraphConfig(max_tokens=1100)


def seqs_of(*lens, seed=0, vocab=30000):
    g = np.random.default_rng(seed)
    return [g.integers(min(1000, vocab // 2), vocab, n) for n in lens]


def test_state_machine_and_padding_equals_eager(engine):
    e = engine
    r = make_runner(e)
    batch = Batch.from_sequences(seqs_of(3, 9, 1))  # 13 real tokens in a 64-token, 4-sequence bucket
    key = r.key(batch)
    assert key == GraphKey(4, 64, 64) and (key.seqs, key.tokens, key.max_len) == (4, 64, 64) and not key.extras
    assert r.state(key) == "cold"
    ref = e.step(batch).synchronize()
    outs = []
    for expected_state in ("warm", "captured", "captured"):
        outs.append(r.step(batch).synchronize().clone())
        assert r.state(key) == expected_state
    s = r.stats
    assert (s.keys, s.eager, s.captures, s.replays) == (1, 1, 1, 2)
    assert s.capture_ms >= 0 and key in s.capture_ms_by_key
    # The backend plans before every run with the padded host metadata (a dummy empty sequence).
    assert r.plans == [(GraphKey(4, 64, 64), [0, 3, 12, 13, 13], 64)] * 3
    for o in outs:
        assert o.shape == (3, 384)
        assert F.cosine_similarity(o, ref).min().item() >= 0.9999


def test_other_keys_and_far_below_bucket(engine):
    e = engine
    r = make_runner(e, mode="eager-all")
    for lens in [(256, 200, 5), (1,), (1, 1, 1, 1, 1), (256, 256, 256, 200, 100)]:
        batch = Batch.from_sequences(seqs_of(*lens, seed=len(lens)))
        got = r.step(batch).synchronize()
        ref = e.step(batch).synchronize()
        assert F.cosine_similarity(got, ref).min().item() >= 0.9999, lens
    assert r.stats.captures == 4 and r.stats.eager == 0
    # The ring of 3 is reused without corrupting a result copied out in time.
    b1 = Batch.from_sequences(seqs_of(5))
    first = r.step(b1).synchronize().clone()
    for _ in range(5):
        r.step(Batch.from_sequences(seqs_of(7, seed=9)))
    assert torch.allclose(r.step(b1).synchronize(), first)


def test_oversize_falls_back(engine):
    r = make_runner(engine)
    assert r.step(Batch.from_sequences(seqs_of(*[256] * 9))) is None  # 2304 tokens > 2048
    assert r.step(Batch.from_sequences(seqs_of(*[1] * 17))) is None  # 17 sequences > 16
    assert r.stats.oversize == 2 and r.stats.keys == 0


def test_batch_that_fills_its_bucket_with_cls_pooling(tmp_path):
    """Dummy sequences of a full bucket start at row T: CLS pooling must not index past it."""
    from rose.engine import Engine, EngineConfig
    from tests.checkpoints import save_checkpoint

    path, _ = save_checkpoint("xlm-roberta", tmp_path)
    e = Engine(EngineConfig(model=str(path), device="cpu"))
    assert e.spec.pooling == "cls"
    r = make_runner(e)
    batch = Batch.from_sequences(seqs_of(32, 16, 16, seed=3, vocab=500))  # 64 tokens: 3 sequences in a (4, 64) bucket
    assert r.key(batch)[:2] == (4, 64)
    ref = e.step(batch).synchronize()
    got = r.step(batch).synchronize()
    assert F.cosine_similarity(got, ref).min().item() >= 0.9999


def test_graph_stats_are_exported_as_metrics():
    import types

    from prometheus_client import generate_latest

    from rose.graphs import GraphStats
    from tulip.metrics import TulipMetrics

    stats = GraphStats(keys=3, eager=3, captures=2, replays=40, oversize=1, capture_ms=12.5)
    text = generate_latest(TulipMetrics(types.SimpleNamespace(runner=types.SimpleNamespace(stats=stats))).registry)
    text = text.decode()
    for line in ("tulip_graph_keys 3.0", "tulip_graph_captures 2.0", "tulip_graph_replays 40.0",
                 "tulip_graph_oversize 1.0", "tulip_graph_capture_ms 12.5"):
        assert line in text


def test_token_level_outputs_through_graphs(tmp_path):
    """BGE-M3's sparse weights and ColBERT vectors through captured graphs (keys of their own, padded
    to the bucket, token rows cut back to the batch) equal the eager step; dense-only keys are unchanged."""
    from rose.engine import Engine, EngineConfig
    from tests.checkpoints import save_checkpoint

    path, _ = save_checkpoint("xlm-roberta", tmp_path / "m3")
    g = torch.Generator().manual_seed(1)
    torch.save({"weight": torch.randn(1, 64, generator=g) * 0.3, "bias": torch.tensor([0.05])}, path / "sparse_linear.pt")
    torch.save({"weight": torch.randn(48, 64, generator=g) * 0.2, "bias": torch.randn(48, generator=g) * 0.1},
               path / "colbert_linear.pt")
    e = Engine(EngineConfig(model=str(path), device="cpu"))
    r = make_runner(e, max_tokens=256)
    batch = Batch.from_sequences(seqs_of(5, 17, 9, vocab=500))  # 31 tokens in a 64-token bucket
    for extras in ({"sparse"}, {"colbert"}, {"sparse", "colbert"}):
        extras = frozenset(extras)
        ref = e.step(batch, extras).synchronize()
        for _ in range(3):  # eager, capture, replay
            got = r.step(batch, extras).synchronize()
        assert r.state(r.key(batch, extras)) == "captured" and r.key(batch, extras).extras == extras
        for a, b in zip(got, ref):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert got[1].shape == (31,) and got[2].shape == (31, 48)
    dense = r.step(batch).synchronize()  # the dense-only key is its own
    assert isinstance(dense, torch.Tensor) and r.key(batch) == GraphKey(4, 64, 64)
    torch.testing.assert_close(dense, ref[0], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="no \\['bogus'\\] output"):
        e.step(batch, frozenset({"bogus"}))
    from tulip.warmup import warm_up

    warm_up(e, ("2x16+sparse+colbert", "1x8"))  # Tulip's --warmup runs the steps with those outputs
    with pytest.raises(ValueError, match="no \\['colbert'\\] output"):
        warm_up(Engine(EngineConfig(model=str(save_checkpoint("bert", tmp_path / "plain")[0]), device="cpu")),
                ("1x8+colbert",))


def test_a_batch_stages_the_same_from_its_host_arrays_as_from_its_tensors():
    import dataclasses

    runner = GraphRunner(lambda *a: None, lambda *a: None, 8, torch.device("cpu"), GraphConfig(max_tokens=256, ring=2),
                         ops=FakeOps())
    for seqs in ([np.arange(5, 40)], [np.arange(5, 40), np.arange(7, 20), np.arange(3, 90)]):
        batch = Batch.from_sequences(seqs)
        assert batch.host is not None and batch.host[0].ctypes.data == batch.input_ids.data_ptr()  # one memory
        key = runner.key(batch)
        assert runner.key(batch) is key  # remembered per shape
        runner._stage(batch, 0, key.seqs, key.tokens)
        runner._stage(dataclasses.replace(batch, host=None), 1, key.seqs, key.tokens)
        assert np.array_equal(runner._staging[0].numpy(), runner._staging[1].numpy())
    skipped = Batch.from_sequences([np.arange(5, 40)], pool_from=[3])  # its own seq_ids: no host arrays
    assert skipped.host is None and int(skipped.seq_ids[0]) == 1


def test_a_slot_restaged_writes_what_a_fresh_slot_would():
    """A slot staged again with the same shared arrays (a one-sequence batch of a recurring length)
    writes only the ids; with any other length, bucket, sequence count or arrays, everything. Each time
    the bytes a step copies equal a fresh runner's staging of the same batch."""
    g = np.random.default_rng(0)

    def runner():
        return GraphRunner(lambda *a: None, lambda *a: None, 8, torch.device("cpu"),
                           GraphConfig(max_tokens=256, ring=2), ops=FakeOps())

    used = runner()
    for seqs, pool_from in ([[35], None], [[35], None], [[20], None], [[35], None], [[35], [4]], [[35], None],
                            [[100], None], [[35], None], [[35, 12], None], [[35], None]):
        batch = Batch.from_sequences([g.integers(5, 1000, n) for n in seqs], pool_from)
        key = used.key(batch)
        used._stage(batch, 0, key.seqs, key.tokens)
        fresh = runner()
        fresh._stage(batch, 0, key.seqs, key.tokens)
        tb, cu = key.tokens, key.seqs + 1  # what the step's graph reads
        assert np.array_equal(used._in_tok_np[0, :3 * tb], fresh._in_tok_np[0, :3 * tb]), (seqs, pool_from)
        assert np.array_equal(used._in_cu_np[0, :cu], fresh._in_cu_np[0, :cu]), (seqs, pool_from)


def test_use_stream_sets_the_engine_stream_when_the_stream_or_the_device_differs(monkeypatch):
    """CudaOps.use_stream makes the engine's stream current only when it is not already the calling
    thread's current stream on the current device (torch's set_stream also makes its device current):
    with engines of two GPUs stepped from one thread, the second finds its stream current on its own
    device but another device current, and is switched back. CPU stand-ins for torch's bindings."""
    import rose.graphs as graphs

    class Stream:
        device_index, stream_id = 1, 77

    state = {"stream": 77, "device": 1}
    sets = []
    monkeypatch.setattr(graphs, "_current_stream_id", lambda index: state["stream"] if index == 1 else 0)
    monkeypatch.setattr(graphs, "_current_device", lambda: state["device"])

    def set_stream(s):
        sets.append(s)
        state["stream"], state["device"] = s.stream_id, s.device_index

    monkeypatch.setattr(graphs.torch.cuda, "set_stream", set_stream)
    ops = object.__new__(graphs.CudaOps)
    ops.stream = Stream()
    ops.use_stream()
    assert sets == []  # already current: no call
    state["device"] = 0  # another engine's device made current by this thread
    ops.use_stream()
    assert sets == [ops.stream] and state["device"] == 1
    state["stream"] = 5  # another stream current on this device
    ops.use_stream()
    assert len(sets) == 2 and state["stream"] == 77


def test_cudaops_copies_go_to_the_driver_only_where_a_byte_copy_is_torchs_copy():
    """CudaOps.copy and its bound form `copier` hand a copy to the driver (a stand-in for
    cuMemcpyAsync here) only for contiguous tensors of one dtype and size; anything else, and a copy
    the driver refuses, is torch's copy_. CPU tensors, no CUDA."""
    import rose.graphs as graphs

    calls, refuse = [], []

    def driver(dst_ptr, src_ptr, nbytes, stream):
        calls.append((dst_ptr, src_ptr, nbytes, stream))
        return 1 if refuse else 0  # a CUDA error code, or success (the stand-in copies nothing)

    ops = object.__new__(graphs.CudaOps)
    ops._copy, ops._handle = driver, 42
    src, dst = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    for run in (lambda d, s: ops.copy(d, s), lambda d, s: ops.copier(d, s)()):
        calls.clear()
        run(dst, src)
        assert calls == [(dst.data_ptr(), src.data_ptr(), 32, 42)] and not dst.any()  # the driver's, not torch's
        half = torch.zeros(8, dtype=torch.float16)
        run(half, src)  # another dtype: torch's copy_ converts
        strided = torch.zeros(16)[::2]
        run(strided, src)  # a strided view: torch's
        assert len(calls) == 1 and torch.equal(half.float(), src) and torch.equal(strided, src)
        refuse.append(True)
        run(dst, src)  # refused: torch's copy_ after the driver's try
        refuse.clear()
        assert len(calls) == 2 and torch.equal(dst, src)
        dst.zero_()
    no_driver = object.__new__(graphs.CudaOps)
    no_driver._copy, no_driver._handle = None, 0
    no_driver.copier(dst, src)()
    assert torch.equal(dst, src)


def test_shape_classes_cover_every_class_a_step_can_fall_in():
    """tulip.warmup.warm_up compiles the kernels of these classes on CUDA: every (sequences, length) pair
    `rose.kernels.shape_class` can give a step of at most the budget must be among them."""
    from rose.kernels import shape_class
    from tulip.warmup import shape_classes

    from tulip.warmup import class_batches

    classes = set(shape_classes(8192, 16384))
    for n, length in [(1, 1), (1, 128), (3, 500), (2, 8192), (1, 7936), (200, 64), (31, 512), (5, 3000),
                      (9000, 1), (4000, 4)]:
        sn, sl = shape_class(n, length)
        assert (sn, min(sl, 8192)) in classes, (n, length)
    for n, length in classes:  # each realised within the budget, in its own class
        for batch in class_batches(n, length, 16384):
            assert batch.num_tokens <= 16384
            assert shape_class(len(batch.seq_lens), batch.max_seqlen) == (n, max(64, length)) or length == 8192


def test_the_online_lane_runs_urgent_steps_in_graphs_attention_and_a_stream_of_its_own(tmp_path, monkeypatch):
    """`online_lane_tokens`: urgent steps that fit the lane's buckets replay the lane's own graphs, planned by its
    own attention backend, on a stream of higher priority; bigger ones and the rest go to the main runner; the
    vectors are the eager step's either way. (CUDA-only parts with fake ops: no GPU here.)"""
    from rose import engine as eng
    from rose.engine import Engine, EngineConfig
    from rose.models import model_class
    from tests.checkpoints import save_checkpoint

    made = []

    class Ops(FakeOps):
        def __init__(self, device, priority=0):
            super().__init__()
            self.priority = priority
            made.append(self)

    monkeypatch.setattr(eng, "CudaOps", Ops)
    path, _ = save_checkpoint("bert", tmp_path / "bert")
    e = Engine(EngineConfig(model=str(path), device="cpu", attention="padded", online_lane_tokens=100))
    assert e.runner is None and e.lane is None  # on a CPU: no graphs
    eager = {n: e.step(Batch.from_sequences(seqs_of(*([n] * 3), vocab=500))).synchronize() for n in (9, 60)}
    e.runner, e.lane = e._graph_runners(model_class(e.spec))
    assert [o.priority for o in made] == [0, -1]  # the main runner's stream, then the lane's more urgent one
    assert e.lane.cfg.max_tokens == 128 and e.runner.cfg.max_tokens == 16384  # the lane: 100 up to its bucket
    assert e.lane.prepare.__self__ is not e.attention and e.runner.prepare.__self__ is e.attention
    for _ in range(3):  # eager, capture, replay
        small = e.step(Batch.from_sequences(seqs_of(9, 9, 9, vocab=500)), urgent=True).synchronize()
        big = e.step(Batch.from_sequences(seqs_of(60, 60, 60, vocab=500)), urgent=True).synchronize()  # 180 tokens
        plain = e.step(Batch.from_sequences(seqs_of(9, 9, 9, vocab=500))).synchronize()
    # (a capture replays once) the small urgent step in the lane; the big one there counted oversize
    assert (e.lane.stats.keys, e.lane.stats.replays, e.lane.stats.oversize) == (1, 2, 3)
    assert (e.runner.stats.keys, e.runner.stats.replays) == (2, 4)  # the big urgent step and the plain one
    from tulip.metrics import TulipMetrics
    from prometheus_client import generate_latest

    text = generate_latest(TulipMetrics(e).registry).decode()
    assert "tulip_graph_replays 4.0" in text and "tulip_graph_lane_replays 2.0" in text
    assert "tulip_graph_lane_oversize 3.0" in text
    for got, want in ((small, eager[9]), (plain, eager[9]), (big, eager[60])):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
