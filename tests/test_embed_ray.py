"""`trellis embed --ray` (jobs/ray.py, issue 50) on one module-scoped local Ray instance, all-MiniLM-L6-v2 on CPU:
two Ray actors give the in-process path's output (same ids, vectors to 1e-6, same bad rows and markers); a job
with some parts committed, by either path, is finished by the other with every row exactly once; Ray Data's
a `trellis embed --ray` killed with SIGKILL is finished the same way; Ray Data's map_batches through EmbedBatches
gives the same vectors; without Ray, --ray is exit 2 naming the extra."""

import json
import shutil
import signal
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from jobs.config import EmbedJobConfig, EmbedSettings
from jobs.embed import Embedder
from jobs.run import main, run
from tests.conftest import Proc
from tests.sentences import SENTENCES

TEXTS = [s for s in SENTENCES if s.strip()][:30]
LINES = [json.dumps({"id": f"doc-{i}", "text": t}) for i, t in enumerate(TEXTS)]
# bad rows of every kind, among the good ones: empty, null, not a string, over 256 tokens (truncate none), not JSON
LINES[3:3] = ['{"id": "empty", "text": ""}', '{"id": "null", "text": null}', '{"id": "number", "text": 5}']
LINES[20:20] = ['{"id": "long", "text": "' + "word " * 400 + '"}', "not json"]
PARTS = -(-len(LINES) // 6)


@pytest.fixture(scope="module")
def ray_instance():
    """One local Ray instance for the module; a clear skip where it cannot start. Four logical CPUs (Ray places an
    actor only where the CPUs it asks for are free): one for each of the two job actors, one for the killed job's
    actor (freed when Ray notices its driver is gone), one for Ray Data's map_batches actor."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'trellis[ray]')")
    try:
        ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    except Exception as e:  # noqa: BLE001 (whatever keeps Ray from starting here is the reason to skip)
        pytest.skip(f"Ray cannot start a local instance here: {type(e).__name__}: {e}")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def inp(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray-in") / "in.jsonl"
    path.write_text("\n".join(LINES) + "\n")
    return path


def config(inp, out, *args: str) -> EmbedJobConfig:
    return EmbedJobConfig.from_args([str(inp), str(out), "--device", "cpu", "--dtype", "float32", "--rows-per-part",
                                     "6", "--truncate", "none", "--progress", "off", *args])


@pytest.fixture(scope="module")
def actors(ray_instance, inp, tmp_path_factory):
    """The two actors of `--ray local --ray-actors 2 --ray-cpus 1` (jobs.ray.start_actors), loading their models
    while the in-process reference runs."""
    from jobs.ray import start_actors

    group = start_actors(config(inp, tmp_path_factory.mktemp("x") / "o", "--ray", "local", "--ray-actors", "2",
                                "--ray-cpus", "1"))
    yield group
    for a in group:
        ray_instance.kill(a)


@pytest.fixture(scope="module")
def embedder(actors):
    e = Embedder(EmbedSettings(truncate="none"), device="cpu", dtype="float32")
    yield e
    e.close()


@pytest.fixture(scope="module")
def reference(inp, embedder, tmp_path_factory):
    """The in-process job's OUTPUT."""
    out = tmp_path_factory.mktemp("ref") / "out"
    run(config(inp, out), [embedder])
    return out


def read(out) -> pd.DataFrame:
    return pd.read_parquet(out)


def markers(out) -> dict:
    """Each part's marker without its timing."""
    return {p.name: {k: v for k, v in json.loads(p.read_text()).items() if k != "seconds"}
            for p in sorted((out / "_done").glob("part-*.json"))}


def assert_same(got, ref) -> None:
    a, b = read(got), read(ref)
    assert a["id"].tolist() == b["id"].tolist() and len(set(a["id"])) == len(a)
    assert a["tokens"].tolist() == b["tokens"].tolist()
    np.testing.assert_allclose(np.stack(a["dense"].to_numpy()), np.stack(b["dense"].to_numpy()), atol=1e-6, rtol=0)
    assert markers(got) == markers(ref)
    # the errors file's lines are appended in commit order: the same lines, in whatever order the parts finished
    assert sorted((got / "_errors.jsonl").read_text().splitlines()) == \
        sorted((ref / "_errors.jsonl").read_text().splitlines())


def on_ray(actors) -> list:
    """jobs.run.run's workers on these actors, as `trellis embed --ray` makes them (jobs.ray.RayWorkers)."""
    from jobs.ray import embedders

    return embedders(actors, EmbedSettings(truncate="none"))


def test_two_ray_actors_give_the_in_process_output(ray_instance, actors, inp, reference, tmp_path):
    pids = ray_instance.get([a.ready.remote() for a in actors])
    assert len(set(pids)) == 2  # two actor processes, each with its own Embedder
    summary = run(config(inp, tmp_path / "out", "--ray", "local"), on_ray(actors))
    assert summary["parts"] == PARTS and summary["rows"] == len(LINES)
    assert summary["errors"] == 5 and summary["written"] == len(TEXTS)
    assert_same(tmp_path / "out", reference)
    lines = (tmp_path / "out" / "_errors.jsonl").read_text().splitlines()
    errors = {e["id"]: e["reason"] for e in map(json.loads, lines)}
    assert errors.keys() == {"empty", "null", "number", "long", None}
    assert json.loads((tmp_path / "out" / "_job.json").read_text()) == \
        json.loads((reference / "_job.json").read_text())  # one job, whichever path runs it


@pytest.mark.parametrize("first", ["in-process", "ray"])
def test_a_partial_job_is_finished_by_the_other_path_every_row_once(first, actors, embedder, inp, reference,
                                                                     tmp_path):
    """A job with some parts committed and others not (their part files written, their markers not: a kill
    between the two), as left by one path, run again on the other: the missing parts alone are done."""
    out = tmp_path / "out"
    if first == "in-process":
        shutil.copytree(reference, out)
    else:
        run(config(inp, out, "--ray", "local"), on_ray(actors))
    (out / "_summary.json").unlink()
    redo = [1, PARTS - 1]
    for k in redo:
        (out / "_done" / f"part-{k:05d}.json").unlink()  # the part file stays: a stray, removed and done again
    (out / ".part-00002.parquet.tmp").write_bytes(b"half")
    rest = ["--ray", "local"] if first == "in-process" else []
    summary = run(config(inp, out, *rest), on_ray(actors) if rest else [embedder])
    assert summary["parts"] == len(redo) and summary["parts_resumed"] == PARTS - len(redo)
    assert summary["total_rows"] == len(LINES) and summary["rows"] == 6 + (len(LINES) - 6 * (PARTS - 1))
    assert not (out / ".part-00002.parquet.tmp").exists()
    assert_same(out, reference)


def test_a_ray_job_killed_with_sigkill_is_finished_every_row_once(ray_instance, actors, inp, reference, tmp_path):
    """`python -m jobs ... --ray HOST:PORT` (trellis embed joining the module's Ray by its GCS address, with an
    actor of its own, throttled) is killed with SIGKILL after its first commit; the same job run again (on the
    module's actors) does the parts left: every row exactly once, the in-process output."""
    out = tmp_path / "out"
    proc = Proc(["-m", "jobs", str(inp), str(out), "--device", "cpu", "--dtype", "float32", "--rows-per-part", "6",
                 "--truncate", "none", "--ray", ray_instance.get_runtime_context().gcs_address, "--ray-actors", "1",
                 "--ray-cpus", "1", "--max-rows-per-s", "4"], tmp_path)
    proc.wait_for(lambda: (out / "_done" / "part-00000.json").exists(), timeout=90)
    proc.p.send_signal(signal.SIGKILL)
    proc.p.wait()
    committed = len(list((out / "_done").glob("part-*.json")))
    assert 1 <= committed < PARTS and not (out / "_summary.json").exists()
    summary = run(config(inp, out, "--ray", "local"), on_ray(actors))
    assert summary["parts_resumed"] == committed and summary["parts"] == PARTS - committed
    assert summary["total_rows"] == len(LINES)
    assert_same(out, reference)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray Data's own DataContext fields, on its first use
def test_ray_data_map_batches_runs_the_same_embedder(ray_instance, embedder, tmp_path):
    """EmbedBatches in a Ray Data pipeline of one's own (an actor of map_batches): the in-process vectors."""
    import ray.data

    from jobs.ray import EmbedBatches

    table = pa.table({"id": [f"doc-{i}" for i in range(len(TEXTS))], "text": TEXTS})
    ds = ray.data.from_arrow(table).map_batches(
        EmbedBatches, fn_constructor_kwargs={"settings": EmbedSettings(), "device": "cpu", "dtype": "float32"},
        concurrency=1, num_cpus=1, batch_size=8, batch_format="pyarrow")
    got = ds.to_pandas().set_index("id").loc[table["id"].to_pylist()]
    want = embedder(table)
    want_dense = np.stack(want["dense"].to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(np.stack(got["dense"].to_numpy()), want_dense, atol=1e-6, rtol=0)
    assert got["tokens"].tolist() == want["tokens"].to_pylist()


def test_without_ray_the_flag_is_exit_2_naming_the_extra(inp, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is not installed
    assert main([str(inp), str(tmp_path / "out"), "--ray"]) == 2
    err = capsys.readouterr().err
    assert "--ray needs Ray" in err and "pip install 'trellis[ray]'" in err
    assert not (tmp_path / "out").exists()  # nothing read or written
