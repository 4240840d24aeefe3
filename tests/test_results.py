"""benchmarks/results/ as evidence: one dated folder per run, each with its README; rows compressed and readable;
SUMMARY.md regenerated from the runs summary-inputs.txt lists, byte for byte."""

import gzip
import re
import shutil
from pathlib import Path

from benchmarks import summary
from benchmarks.common import read_rows, results_files

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_every_run_folder_is_indexed_and_has_its_readme():
    folders = sorted(d.name for d in RESULTS.iterdir() if d.is_dir())
    assert folders and all(re.fullmatch(r"20\d\d-\d\d-\d\d_[a-z0-9-]+_[a-z0-9.-]+", f) for f in folders), folders
    index = (RESULTS / "README.md").read_text()
    listed = re.findall(r"^\| \[([^\]]+)\]\(\1/\) \| (20\d\d-\d\d-\d\d) \|", index, re.M)
    assert sorted(f for f, _ in listed) == folders, "results/README.md's table and the folders differ"
    assert all(f.startswith(day) for f, day in listed)
    for f in folders:
        readme = (RESULTS / f / "README.md").read_text().splitlines()
        assert readme[0].startswith("# ") and readme[2].startswith("> Run folder"), f


def test_committed_rows_are_compressed_and_readable(tmp_path):
    assert not list(RESULTS.rglob("*.jsonl")), "commit a run's rows as .jsonl.gz (gzip -n9)"
    files = list(RESULTS.rglob("*.jsonl.gz"))
    assert len(files) > 300
    assert sum(len(read_rows(f)) for f in files) > 9_000

    # the shared reader: plain and compressed alike, a log line between rows skipped
    text = '{"bench": "a", "p50_ms": 1.5}\nnot a row\n\n{"bench": "b"}\n'
    (tmp_path / "x.jsonl").write_text(text)
    (tmp_path / "y.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "z.txt").write_text(text)
    assert [p.name for p in results_files(tmp_path)] == ["x.jsonl", "y.jsonl.gz"]
    assert read_rows(tmp_path / "x.jsonl") == read_rows(tmp_path / "y.jsonl.gz") == [{"bench": "a", "p50_ms": 1.5},
                                                                                      {"bench": "b"}]


def test_summary_regenerates_from_the_listed_runs(tmp_path, monkeypatch):
    # the charts are left out (matplotlib is most of the time); their links stay as the files exist
    monkeypatch.setattr(summary, "draw", lambda chart, model, env, path: path.write_bytes(b""))
    monkeypatch.setattr(summary, "draw_hop", lambda rows, path: True)
    inputs = summary.inputs(RESULTS)
    assert inputs and all(f.is_file() and f.name.endswith(".jsonl.gz") for f in inputs)
    for f in inputs:  # only what the list names, so a stray file elsewhere cannot change the summary unnoticed
        (tmp_path / f.relative_to(RESULTS)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, tmp_path / f.relative_to(RESULTS))
    shutil.copy(RESULTS / summary.INPUTS, tmp_path / summary.INPUTS)
    summary.main([str(tmp_path)])
    assert (tmp_path / "SUMMARY.md").read_text() == (RESULTS / "SUMMARY.md").read_text()
