"""`trellis embed` (jobs/, issue 50) on the real all-MiniLM-L6-v2 on CPU: Parquet, JSONL and CSV in, Parquet out
equal to sentence-transformers (read back by pandas), bad rows in _errors.jsonl, a job killed with SIGKILL
and run again holding every row once, a restart with other settings refused, and the same vectors through
a real Tulip (--tulip) and a real Ivy (--url) as in-process."""

import csv
import json
import os
import signal
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.config import EmbedJobConfig, EmbedSettings
from jobs.embed import Embedder
from jobs.run import main, run
from tests.conftest import Proc, free_port, http_status
from tests.sentences import SENTENCES

TEXTS = [s for s in SENTENCES if s.strip()][:24] + ["word " * 400]  # the last one over 256 tokens
IDS = [f"doc-{i}" for i in range(len(TEXTS))]


class Fleet:
    """A real Tulip and an Ivy in front of it, started at the module's first test and waited for only by the
    test that uses them (their start-up overlaps the in-process tests)."""

    def __init__(self, tmp):
        self.tulip = f"127.0.0.1:{free_port()}"
        self.url = f"http://127.0.0.1:{free_port()}"
        self.procs = [Proc(["-m", "tulip", "--model", "default", "--device", "cpu", "--port",
                            self.tulip.rpartition(":")[2]], tmp),
                      Proc(["-m", "ivy", "--port", self.url.rpartition(":")[2], "--tulip", self.tulip], tmp)]

    def wait(self) -> "Fleet":
        self.procs[1].wait_for(lambda: http_status(self.url + "/ready") == 200, timeout=120)
        return self


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    yield f
    for p in reversed(f.procs):
        p.stop()


@pytest.fixture(scope="module")
def embedder(fleet):
    e = Embedder(EmbedSettings(), device="cpu", dtype="float32")
    yield e
    e.close()


@pytest.fixture(scope="module")
def reference(st_model):
    return st_model.encode(TEXTS, normalize_embeddings=True)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("embed-in")
    pq.write_table(pa.table({"id": IDS, "text": TEXTS, "other": list(range(len(TEXTS)))}), d / "in.parquet")
    with open(d / "in.jsonl", "w") as f:
        for i, t in zip(IDS, TEXTS):
            f.write(json.dumps({"id": i, "text": t}) + "\n")
        f.write('{"id": "empty", "text": ""}\n{"id": "null", "text": null}\n{"id": "number", "text": 5}\n'
                '{"id": "long", "text": "' + "word " * 400 + '"}\nnot json\n')
    with open(d / "in.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "n"])
        w.writerows([t, k] for k, t in enumerate(TEXTS))
    return d


def cosines(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)


def config(inp, out, *args: str) -> EmbedJobConfig:
    return EmbedJobConfig.from_args([str(inp), str(out), "--device", "cpu", "--dtype", "float32",
                                     "--rows-per-part", "8", *args])


@pytest.mark.parametrize("name", ["in.parquet", "in.jsonl", "in.csv"])
def test_each_format_gives_sentence_transformers_vectors_with_ids(name, inputs, embedder, reference, tmp_path):
    summary = run(config(inputs / name, tmp_path / "out"), [embedder])
    df = pd.read_parquet(tmp_path / "out")  # the part files alone: the job's own files start with "_"
    if name == "in.csv":  # no id column: the row number
        assert df["id"].tolist() == list(range(len(TEXTS)))
    else:
        assert df["id"].tolist()[:len(IDS)] == IDS
    got = np.stack(df["dense"].to_numpy())[:len(TEXTS)]
    assert got.shape == (len(TEXTS), 384) and cosines(got, reference).min() > 0.9999
    assert sorted(os.listdir(tmp_path / "out" / "_done")) == [f"part-{k:05d}.json" for k in range(4)]
    schema = pq.read_schema(tmp_path / "out" / "part-00000.parquet")
    assert schema.field("dense").type == pa.list_(pa.float32(), 384) and schema.field("tokens").type == pa.int32()
    assert summary["rows"] == (len(TEXTS) + 5 if name == "in.jsonl" else len(TEXTS))
    assert summary["tokens"] == int(df["tokens"].sum()) and df["tokens"].iloc[-1] == 256  # truncated at the end


def test_a_scheme_pyarrow_lacks_is_read_through_fsspec(inputs, embedder, reference, tmp_path):
    """An INPUT URI whose scheme pyarrow has no filesystem for (fsspec's `memory://`; gcsfs, adlfs, ... alike) is
    read through fsspec (jobs.dataset.filesystem's fallback), with the same vectors and ids as a local file."""
    import fsspec

    mem = fsspec.filesystem("memory")
    mem.pipe(f"/trellis-{os.getpid()}/in.parquet", (inputs / "in.parquet").read_bytes())
    try:
        run(config(f"memory://trellis-{os.getpid()}/in.parquet", tmp_path / "out"), [embedder])
    finally:
        mem.rm(f"/trellis-{os.getpid()}", recursive=True)
    df = pd.read_parquet(tmp_path / "out")
    assert df["id"].tolist() == IDS
    assert cosines(np.stack(df["dense"].to_numpy()), reference).min() > 0.9999


def test_bad_rows_go_to_the_errors_file_and_the_job_goes_on(inputs, tmp_path):
    summary = run(config(inputs / "in.jsonl", tmp_path / "out", "--truncate", "none"))
    errors = [json.loads(x) for x in (tmp_path / "out" / "_errors.jsonl").read_text().splitlines()]
    reasons = {e["id"]: e["reason"] for e in errors}
    assert reasons.keys() == {"doc-24", "empty", "null", "number", "long", None}, errors
    assert reasons["empty"] == "text is empty" and reasons["null"] == "text is null"
    assert reasons["number"] == "text is not a string (int)" and "line 30 is not a JSON object" in reasons[None]
    assert "more than the model's maximum of 256" in reasons["long"]
    df = pd.read_parquet(tmp_path / "out")
    assert df["id"].tolist() == IDS[:-1] and summary["errors"] == 6 and summary["written"] == len(IDS) - 1


def test_killed_with_sigkill_and_run_again_every_row_once(inputs, reference, tmp_path, capsys):
    """A job in a child process, throttled so it is still running when its first part commits, is killed
    with SIGKILL; the same arguments again (trellis embed's main, --json) finish it: every row exactly once.
    Other settings on that OUTPUT are refused and leave it as it was."""
    out = tmp_path / "out"
    args = [str(inputs / "in.parquet"), str(out), "--device", "cpu", "--rows-per-part", "4", "--max-rows-per-s", "6"]
    proc = Proc(["-m", "jobs", *args], tmp_path)
    proc.wait_for(lambda: (out / "_done" / "part-00000.json").exists(), timeout=60)
    proc.p.send_signal(signal.SIGKILL)
    proc.p.wait()
    committed = len(os.listdir(out / "_done"))
    assert 1 <= committed < 7 and not (out / "_summary.json").exists()
    assert main([*args, "--dimensions", "64"]) == 2  # other settings: refused
    assert "holds a job with other settings (dimensions: 0 there, 64 now)" in capsys.readouterr().err
    assert main([*args, "--max-rows-per-s", "0", "--json"]) == 0  # (the throttle is not a setting)
    summary = json.loads(capsys.readouterr().out)
    assert summary["parts_resumed"] == committed and summary["total_rows"] == len(TEXTS)
    assert summary["parts"] == 7 - committed and summary["errors"] == 0
    assert set(summary) >= {"rows", "errors", "tokens", "seconds", "rows_per_s"}
    df = pd.read_parquet(out)
    assert sorted(df["id"]) == sorted(IDS) and len(df) == len(IDS)
    got = np.stack(df.set_index("id").loc[IDS, "dense"].to_numpy())
    assert cosines(got, reference).min() > 0.9999
    assert sorted(p for p in os.listdir(out) if p.startswith("part-")) == [f"part-{k:05d}.parquet" for k in range(7)]


def test_tulip_and_ivy_give_the_in_process_vectors(inputs, embedder, fleet, tmp_path):
    local = embedder(pq.read_table(inputs / "in.parquet"))
    fleet.wait()
    remote = run(config(inputs / "in.parquet", tmp_path / "tulip", "--tulip", fleet.tulip))
    assert remote["rows"] == len(TEXTS) and remote["tokens"] == sum(local["tokens"].to_pylist())
    df = pd.read_parquet(tmp_path / "tulip")
    assert df["id"].tolist() == IDS
    assert cosines(np.stack(df["dense"].to_numpy()), np.stack(local["dense"].to_numpy(zero_copy_only=False))).min() \
        > 0.9999
    http = run(config(inputs / "in.parquet", tmp_path / "ivy", "--url", fleet.url, "--encoding", "float16"))
    df = pd.read_parquet(tmp_path / "ivy")
    assert df["id"].tolist() == IDS and http["rows"] == len(TEXTS)
    assert pq.read_schema(tmp_path / "ivy" / "part-00000.parquet").field("dense").type == pa.list_(pa.float16(), 384)
    assert cosines(np.stack(df["dense"].to_numpy()).astype(np.float32),
                   np.stack(local["dense"].to_numpy(zero_copy_only=False))).min() > 0.999  # float16's 3 digits
