"""Per-shape attention backend choice from the kernel sweep's table (host-side, so graphs stay valid)."""

import json

import numpy as np
import torch

from rose.graphs import GraphConfig, GraphKey
from rose.batch import Batch
from rose.engine import Engine, EngineConfig
from rose.kernels import shape_class
from rose.layers.attention import AttentionBackend, SdpaBackend
from rose.layers.attention_table import TableBackend, builtin_table, load_table, table_file
from tests.checkpoints import save_checkpoint


class Named(AttentionBackend):
    def __init__(self, name, capturable=True):
        self.name, self.capturable, self.prepared = name, capturable, []

    def prepare(self, key, cu_host, num_tokens):
        self.prepared.append(key)

    def __call__(self, q, k, v, meta):
        return q


CELLS = [{"seqs": 1, "max_len": 128, "winner": "a", "margin": 1.3},
         {"seqs": 1, "max_len": 4096, "winner": "b", "margin": 1.5},
         {"seqs": 16, "max_len": 512, "winner": "b", "margin": 1.1},
         {"seqs": 16, "max_len": 64, "winner": "gone", "margin": 1.2}]


def test_nearest_cell_and_graph_keys():
    a, b, fb = Named("a"), Named("b"), Named("fallback")
    t = TableBackend(CELLS, {"a": a, "b": b}, fb)
    assert t.capturable
    assert t.pick(1, 100) is a and t.pick(1, 3000) is b and t.pick(12, 500) is b
    assert t.pick(16, 64) is a  # the "gone" backend's cell was dropped; nearest remaining is (1, 128)
    t.prepare(GraphKey(2, 256, 128), np.array([0, 100, 100], dtype=np.int32), 256)  # a graph key: decided by the key
    assert a.prepared == [GraphKey(2, 256, 128)] and t(torch.ones(1), None, None, None).item() == 1
    t.prepare(None, np.array([0, 4000], dtype=np.int32), 4000)  # an eager step: decided by the batch
    assert b.prepared == [None]
    assert not TableBackend(CELLS, {"a": a, "b": Named("b", capturable=False)}, fb).capturable


def test_the_builtin_choice_without_a_shipped_table_is_triton_at_every_shape():
    """Without a table for the head shape: ROSE's Triton kernel at every shape (it won every cell of
    the H200 sweeps against torch's varlen, bidirectional to 8,192 tokens and causal to 4,096); torch's
    varlen alone where the Triton kernel cannot be made."""
    made = {}

    def make(name):
        return made.setdefault(name, Named(name))

    varlen = Named("varlen")
    table = builtin_table(make, varlen)
    for seqs, length in ((1, 128), (1, 4096), (1, 8192), (16, 128), (100, 512), (4, 1024)):
        assert table.pick(*shape_class(seqs, length)) is made["triton"], (seqs, length)

    def no_triton(name):
        raise ImportError("no triton")

    assert builtin_table(no_triton, varlen) is varlen
    sdpa = Named("sdpa")
    assert builtin_table(make, sdpa) is sdpa  # not varlen (no CUDA half precision): left as it is
    assert builtin_table(make, varlen, (16, 16, 64), causal=True).pick(1, 4096) is made["triton"]  # none shipped


def test_the_shipped_tables_take_fa4_for_long_sequences_and_triton_without_it():
    """bge-m3's and pplx-embed's head shapes ship the H200 sweep's table: FlashAttention 4 for long
    sequences, Triton for short ones; without FA4 installed its cells take Triton (the next fastest),
    never torch's varlen."""
    made = {}

    def make(name):
        return made.setdefault(name, Named(name))

    def no_fa4(name):
        if name == "fa4":
            raise ImportError("No module named 'flash_attn'")
        return make(name)

    varlen = Named("varlen")
    for heads in ((16, 16, 64), (16, 8, 128)):
        with_fa4 = builtin_table(make, varlen, heads)
        assert with_fa4.pick(1, 4096) is made["fa4"] and with_fa4.pick(4, 8192) is made["fa4"], heads
        assert with_fa4.pick(1, 128) is made["triton"], heads
        without = builtin_table(no_fa4, varlen, heads)
        assert isinstance(without, TableBackend) and without.name == "table(triton)", heads
        assert all(without.pick(*shape_class(n, L)) is made["triton"] for n in (1, 4, 16, 100) for L in (128, 512, 4096))
    bge = builtin_table(make, varlen, (16, 16, 64))
    assert bge.pick(1, 512) is made["triton"] and bge.pick(16, 1024) is made["fa4"]


def test_a_table_honours_windows_where_its_winners_do():
    """Whether a table honours sliding windows is its winners' to say (its fallback serves only a
    table without cells): Triton's windows are kept even where torch's varlen has no window_size."""
    tri, var = Named("triton"), Named("varlen")
    tri.windowed, var.windowed = True, False
    assert TableBackend([{"seqs": 1, "max_len": 128, "winner": "triton"}], {"triton": tri, "varlen": var}, var).windowed
    assert not TableBackend([{"seqs": 1, "max_len": 128, "winner": "varlen"}], {"triton": tri, "varlen": var}, tri).windowed
    assert not TableBackend([], {"triton": tri}, var).windowed and TableBackend([], {"varlen": var}, tri).windowed


def test_an_eager_step_takes_its_graph_keys_backend():
    """The choice reads the shape's class, so a batch run eagerly (graphs off, or too big for a
    bucket) takes the backend its graph key would: e5-mistral at 4 x 600 tokens had taken the
    512-token cell's kernel eagerly and the 1,024-token cell's in its graph (cosine 0.9983)."""
    cells = [{"seqs": 4, "max_len": 512, "winner": "a"}, {"seqs": 1, "max_len": 1024, "winner": "b"},
             {"seqs": 1, "max_len": 128, "winner": "a"}, {"seqs": 16, "max_len": 128, "winner": "b"}]
    gcfg = GraphConfig()
    for lens in [(600,) * 4, (600,), (700,), (520, 3), (300,) * 8, (100,) * 9, (129,), (64,) * 3, (1,)]:
        a, b = Named("a"), Named("b")
        t = TableBackend(cells, {"a": a, "b": b}, Named("fallback"))
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        n = int(cu[-1])
        key = GraphKey(gcfg.seq_bucket(len(lens)), gcfg.token_bucket(n), gcfg.len_bucket(max(lens), gcfg.token_bucket(n)))
        t.prepare(key, cu, key.tokens)
        t.prepare(None, cu, n)
        graph, eager = [x for x in (a, b) if key in x.prepared], [x for x in (a, b) if None in x.prepared]
        assert graph == eager and len(graph) == 1, (lens, key, graph, eager)
    assert t.pick(*shape_class(4, 600)) is b  # 4 x 600 is in the 1,024-token class (it was the 512 cell's)


def test_load_table_checks_heads_and_drops_unavailable(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"heads": [4, 4, 16], "causal": False, "cells": CELLS}))
    fb = SdpaBackend()

    def make(name):
        if name == "gone":
            raise ImportError("not installed")
        return Named(name)

    assert load_table(path, (8, 8, 16), False, make, fb) is fb  # other heads: the default stays
    t = load_table(path, (4, 4, 16), False, make, fb)
    assert isinstance(t, TableBackend) and sorted(t.backends) == ["a", "b"] and t.name == "table(a+b)"
    assert t.pick(16, 64).name == "a"  # "gone" won that cell but is not here; nothing else was timed there

    # With the sweep's timings, an unavailable winner's cell goes to the fastest backend that is here.
    cells = [{"seqs": 1, "max_len": 128, "winner": "gone", "tokens_per_s": {"gone": 9, "a": 5, "b": 7}},
             {"seqs": 16, "max_len": 4096, "winner": "a", "tokens_per_s": {"a": 9, "b": 8}}]
    path.write_text(json.dumps({"heads": [4, 4, 16], "causal": False, "cells": cells}))
    t = load_table(path, (4, 4, 16), False, make, fb)
    assert t.pick(1, 128).name == "b" and t.pick(16, 4096).name == "a"

    # A directory of the sweep's tables: the one named for the model's head shape, else the default.
    path.rename(tmp_path / table_file((4, 4, 16)))
    assert isinstance(load_table(tmp_path, (4, 4, 16), False, make, fb), TableBackend)
    assert load_table(tmp_path, (8, 4, 16), False, make, fb) is fb
    # a causal model reads the causal sweep's table (`benchmarks.kernels --causal`), never the other one
    assert load_table(tmp_path, (4, 4, 16), True, make, fb) is fb
    (tmp_path / table_file((4, 4, 16), causal=True)).write_text(
        json.dumps({"heads": [4, 4, 16], "causal": True, "cells": cells}))
    assert isinstance(load_table(tmp_path, (4, 4, 16), True, make, fb), TableBackend)


def test_engine_uses_a_table(tmp_path):
    path, _ = save_checkpoint("bert", tmp_path / "m")
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"heads": [4, 4, 16], "causal": False,
                                 "cells": [{"seqs": 1, "max_len": 64, "winner": "sdpa", "margin": 1.0}]}))
    plain = Engine(EngineConfig(model=str(path), device="cpu"))
    tabled = Engine(EngineConfig(model=str(path), device="cpu", attention_table=str(table)))
    assert isinstance(tabled.attention, TableBackend)
    batch = Batch.from_sequences([[2, 3, 4], [5] * 40])
    assert torch.allclose(plain.step(batch).synchronize(), tabled.step(batch).synchronize())


def test_the_sweep_writes_a_causal_table_apart(tmp_path):
    """`benchmarks.kernels --causal` times the backends with a causal mask and writes its own table,
    which causal models load from a directory of tables (on CPU: SDPA and the padded batch only)."""
    from benchmarks import kernels

    assert kernels.main(["--heads", "4,4,16", "--seqs", "1", "--lengths", "64", "--iters", "2", "--causal",
                         "--out", str(tmp_path)]) == 0
    table = json.loads((tmp_path / table_file((4, 4, 16), causal=True)).read_text())
    assert table["causal"] is True and table["cells"][0]["seqs"] == 1
    assert not (tmp_path / table_file((4, 4, 16))).exists()
    fb = Named("fallback")
    t = load_table(tmp_path, (4, 4, 16), True, lambda name: Named(name), fb)
    assert isinstance(t, TableBackend) and t.pick(1, 64).name == table["cells"][0]["winner"]


def test_the_engine_uses_the_builtin_choice_without_a_table_and_for_a_missing_one(tmp_path, monkeypatch):
    """The engine takes the built-in choice without a table, and a table directory without the
    model's head shape falls back to that choice, not to plain varlen."""
    import rose.engine as engine_mod

    seen = []
    builtin = Named("builtin")

    def fake_builtin(make, fallback, heads, causal):
        seen.append(fallback.name)
        return builtin

    monkeypatch.setattr(engine_mod, "builtin_table", fake_builtin)
    path, _ = save_checkpoint("bert", tmp_path / "m")
    assert Engine(EngineConfig(model=str(path), device="cpu")).attention is builtin
    (tmp_path / "tables").mkdir()
    tabled = Engine(EngineConfig(model=str(path), device="cpu", attention_table=str(tmp_path / "tables")))
    assert tabled.attention is builtin and len(seen) == 2
