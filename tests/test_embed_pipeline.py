"""`trellis embed`'s pipeline (issue 50) with the real engine on CPU (all-MiniLM-L6-v2, a 256-token step budget so
a part is several steps): each part is tokenized while the steps of the parts before it run (jobs.run: the worker
submits, another thread builds and commits), so a part's end does not drain the engine; the job's summary says
how much of its wall time had no step in flight (jobs.backends.StepClock). The steps are the engine's own."""

import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.config import EmbedJobConfig, EmbedSettings
from jobs.embed import Embedder
from jobs.run import run

PARTS, ROWS = 6, 12


@pytest.fixture(scope="module")
def embedder():
    e = Embedder(EmbedSettings(), device="cpu", dtype="float32", max_batch_tokens=256)
    yield e
    e.close()


def test_the_next_part_is_tokenized_while_a_step_runs(embedder, tmp_path):
    texts = [f"{k} " + "word " * 60 for k in range(PARTS * ROWS)]  # ~63 tokens: a part is 3 requests, 3 steps
    pq.write_table(pa.table({"id": [f"r{k}" for k in range(len(texts))], "text": texts}), tmp_path / "in.parquet")
    cfg = EmbedJobConfig.from_args([str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--device", "cpu",
                                    "--rows-per-part", str(ROWS), "--progress", "off"])
    clock = embedder.backend.clock
    clock.spans = spans = []  # (start, end) of each stretch with a step in flight
    calls = []  # (start, end) of each tokenizing call: one a part (12 rows, under the 256-row slice)
    tokenize = embedder._tokenize

    def recording(batch):
        a = time.perf_counter()
        try:
            return tokenize(batch)
        finally:
            calls.append((a, time.perf_counter()))

    embedder._tokenize = recording
    try:
        summary = run(cfg, [embedder])
    finally:
        del embedder._tokenize
        clock.spans = None
    assert len(calls) == PARTS and spans
    # Before the pipeline a part was tokenized after the one before it had drained: no call overlapped a step.
    # (One miss is allowed: a step starts on the step thread a moment after its request reaches the loop.)
    missed = [k for k, (a, b) in enumerate(calls) if k and not any(s < b and e > a for s, e in spans)]
    assert len(missed) <= 1, f"parts tokenized with no step in flight: {missed}"
    assert 0.0 <= summary["host_idle_share"] < 1.0 and summary["step_busy_seconds"] > 0
    assert embedder._window.used == 0  # every request's tokens given back
    df = pd.read_parquet(tmp_path / "out")
    assert df["id"].tolist() == [f"r{k}" for k in range(len(texts))] and summary["rows"] == len(texts)
    direct = embedder(pa.table({"text": texts[-ROWS:]}))  # the last part alone, outside the pipeline
    np.testing.assert_allclose(np.stack(df["dense"].to_numpy()[-ROWS:]),
                               np.stack(direct["dense"].to_numpy(zero_copy_only=False)), atol=1e-5)


def test_the_benchmark_measures_the_engine_before_the_job(tmp_path, capsys):
    """benchmarks/embed_job.py prints (and writes to --out) the engine's figure before the job's, so a call
    cut short by a time limit still has both; the job rows carry host_idle_share."""
    import json

    from benchmarks.embed_job import main

    out = tmp_path / "result.json"
    assert main(["--rows", "24", "--length", "8", "--rows-per-part", "8", "--runs", "2", "--engine-rows", "16",
                 "--engine-batch", "16", "--out", str(out)]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [r["bench"] for r in rows] == ["engine_step", "engine_step_job_shape", "embed_job", "engine_step",
                                          "embed_job", "embed_job_summary"]
    assert rows[0]["rows"] == 16 and rows[1]["shape"] == "256x8"  # the CPU loop's 2,048-token pieces
    assert all(0.0 <= r["host_idle_share"] < 1.0 for r in rows if r["bench"] == "embed_job")
    summary = json.loads(out.read_text())["summary"]
    assert summary == rows[-1] and len(summary["job_over_engine_rounds"]) == 2
    assert summary["job_over_engine"] > 0 and summary["host_idle_share_median"] is not None
