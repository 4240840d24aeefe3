"""The benchmark harness on CPU: every suite end to end on a tiny model (few iterations), the
summary and charts produced, and the correctness gate aborting a run whose served vectors are
perturbed (a Tulip serving slightly different weights than the reference)."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import save_checkpoint
from tests.conftest import ROOT, Proc, free_port


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-bench-model")
    save_checkpoint("bert", d, vocab_size=30522, max_position_embeddings=512)
    return d


@pytest.mark.slow
def test_all_suites_end_to_end_on_cpu(tiny, tmp_path, model_path):
    shutil.copy(model_path / "tokenizer.json", tiny / "tokenizer.json")  # the concurrency suite sends text
    out = tmp_path / "results"
    r = subprocess.run([sys.executable, "-m", "benchmarks", "run", "--suite", "all", "--quick", "--model", str(tiny),
                        "--out", str(out), "--tulip-args", "--device cpu"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for f in out.glob("*.jsonl") for line in f.read_text().splitlines()]
    benches = {row["bench"] for row in rows}
    assert {"gate", "online", "scoring", "bulk", "engine", "gemm", "hop", "concurrency", "bulk-ivy", "kernels"} <= benches
    for row in rows:
        assert {"when", "torch", "gpu", "git"} <= set(row)
    assert all(row["passed"] for row in rows if row["bench"] == "gate")
    summary = (out / "SUMMARY.md").read_text()
    assert "online 1x16" in summary and "bulk 100x64" in summary and "engine step in-process" in summary
    assert "through Ivy over HTTP" in summary and "| 1 | 1 | aiohttp | 4 x 1x64 text |" in summary and "bulk via Ivy" in summary
    table = json.loads((out / "attention_table_4x4x16.json").read_text())
    assert table["heads"] == [4, 4, 16] and len(table["cells"]) == 4 and table["cells"][0]["winner"] in ("sdpa", "padded")  # the CPU backends; timing picks
    assert (out / "kernels_4x4x16.png").stat().st_size > 5_000
    assert (out / f"summary_{tiny.name}.png").stat().st_size > 10_000


def test_correctness_gate_aborts_on_perturbed_vectors(tiny, tmp_path):
    bad = tmp_path / "perturbed"
    shutil.copytree(tiny, bad)
    f = next(bad.glob("*.safetensors"))
    t = load_file(str(f))
    g = torch.Generator().manual_seed(0)
    for k in t:  # small noise on every matrix: vectors move by a few percent, the shapes stay
        if t[k].ndim == 2:
            t[k] = t[k] + 0.3 * t[k].std() * torch.randn(t[k].shape, generator=g)
    save_file(t, str(f))
    port = free_port()
    tulip = Proc(["-m", "tulip", "--model", str(bad), "--port", str(port), "--device", "cpu"], tmp_path)
    try:
        tulip.wait_for(lambda: "TULIP_READY" in tulip.output())
        out = tmp_path / "results"
        r = subprocess.run([sys.executable, "-m", "benchmarks.online", "--model", str(tiny), "--target",
                            f"127.0.0.1:{port}", "--out", str(out), "--n", "3", "--suites", "online"], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    finally:
        tulip.stop()
    assert r.returncode == 1
    assert "correctness gate FAILED" in r.stderr
    rows = [json.loads(line) for line in next(out.glob("*.jsonl")).read_text().splitlines()]
    assert [row["bench"] for row in rows] == ["gate"] and rows[0]["passed"] is False



@pytest.fixture(scope="module")
def tiny_cross_encoder(tmp_path_factory):
    """A tiny BertForSequenceClassification with MiniLM's WordPiece tokenizer (pairs typed 0 ... 1 ...)."""
    from tests.checkpoints import save_cross_encoder

    return save_cross_encoder("bert", tmp_path_factory.mktemp("tiny-rerank") / "ce")[0]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_rerank_benchmark_cross_encoder_beside_bi_encoder(tiny_cross_encoder, tmp_path):
    """benchmarks.rerank end to end on CPU: a cross-encoder and a bi-encoder (MiniLM) each behind
    deploy.local, the gate (float32 served = float32 reference), 1- and 4-client cells, the chart."""
    out = tmp_path / "results"
    r = subprocess.run([sys.executable, "-m", "benchmarks.rerank", "--model", str(tiny_cross_encoder), "--model",
                        "default", "--quick", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for name, kind in (("ce", "cross-encoder"), ("default", "bi-encoder")):
        rows = _rows(out / f"rerank_{name}.jsonl")
        assert [row["bench"] for row in rows] == ["gate", "rerank", "rerank"]
        gate, *cells = rows
        assert gate["passed"] and gate["kind"] == kind and gate["served_tokens"] == gate["reference_tokens"]
        assert gate["max_abs_diff_scores"] < 1e-4 and gate["correlation_scores"] > 0.9999
        assert gate["reference_spread"] > 0.01  # the documents score apart: the gate can see a mix-up
        if kind == "cross-encoder":
            assert gate["max_abs_diff_logits"] < 1e-4
        assert [c["clients"] for c in cells] == [1, 4]
        for c in cells:
            assert c["kind"] == kind and c["documents"] == 4 and c["doc_tokens"] == 24 and c["n"] >= 4
            assert 0 < c["p50_ms"] <= c["p99_ms"] and c["docs_per_s"] > 0
            assert {"when", "torch", "gpu", "git"} <= set(c)
    assert (out / "rerank_p50.png").stat().st_size > 5_000


def test_rerank_gate_aborts_when_served_scores_differ(tiny_cross_encoder, tmp_path):
    """An Ivy (`--target`) serving perturbed weights against the reference on the published ones: the
    gate row says failed, nothing is timed, exit 1."""
    bad = tmp_path / "perturbed"
    shutil.copytree(tiny_cross_encoder, bad)
    f = next(bad.glob("*.safetensors"))
    t = load_file(str(f))
    g = torch.Generator().manual_seed(0)
    for k in t:  # noise on every matrix: the pair scores move, the shapes stay
        if t[k].ndim == 2:
            t[k] = t[k] + 0.3 * t[k].std() * torch.randn(t[k].shape, generator=g)
    save_file(t, str(f))
    port = free_port()
    stack = Proc(["-m", "deploy.local", "--model", str(bad), "--port", str(port), "--device", "cpu",
                  "--served-model-name", "ce"], tmp_path)
    try:
        stack.wait_for(lambda: "Trellis is ready" in stack.output())
        out = tmp_path / "results"
        r = subprocess.run([sys.executable, "-m", "benchmarks.rerank", "--model", str(tiny_cross_encoder), "--target",
                            f"http://127.0.0.1:{port}", "--quick", "--out", str(out)], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    finally:
        stack.stop()
    assert r.returncode == 1, r.stderr[-3000:]
    assert "correctness gate FAILED" in r.stderr
    rows = _rows(out / "rerank_ce.jsonl")
    assert [row["bench"] for row in rows] == ["gate"] and rows[0]["passed"] is False
    assert rows[0]["max_abs_diff_logits"] > rows[0]["tolerance"]


@pytest.mark.slow
def test_run_resumes_where_it_stopped(tiny, tmp_path):
    """`--max-minutes` starts no new part once spent; `--resume` with the same command skips what is done
    (nothing is appended twice) and finishes the rest; other arguments start over."""
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "benchmarks", "run", "--suite", "gemm,engine", "--quick", "--model", str(tiny),
           "--out", str(out), "--resume"]

    def run(*extra, status=0):
        r = subprocess.run([*cmd, *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == status, r.stderr[-3000:]
        return r.stdout

    first = run("--max-minutes", "0.0001", status=3)  # gemm runs, then the budget is spent: incomplete
    assert "not yet run: engine" in first and not list(out.glob("engine_*.jsonl"))
    gemm_rows = (out / f"gemm_{tiny.name}.jsonl").read_text().count("\n")
    second = run()
    assert "gemm already done" in second and "benchmarks: complete" in second
    assert (out / f"gemm_{tiny.name}.jsonl").read_text().count("\n") == gemm_rows  # not run again
    assert list(out.glob("engine_*.jsonl")) and not (out / ".partial").exists()
    assert json.loads((out / "run-state.json").read_text())["done"] == ["gemm", "engine"]
    third = run("--engine-args", "--iters 3")  # another command: starts over
    assert "starting over" in third and "already done" not in third

def test_run_takes_several_models_each_with_its_suites(tiny, tmp_path):
    """`--model A,B=engine` runs --suite for A and only the engine for B, B's parts named part@B."""
    other = tmp_path / "other-model"
    save_checkpoint("xlm-roberta", other, vocab_size=30522, max_position_embeddings=130)
    out = tmp_path / "results"
    r = subprocess.run([sys.executable, "-m", "benchmarks", "run", "--suite", "gemm", "--quick", "--model",
                        f"{tiny},{other}=engine", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "run-state.json").read_text())["done"] == ["gemm", f"engine@{other}"]
    assert (out / f"gemm_{tiny.name}.jsonl").is_file() and list(out.glob("engine_other-model*.jsonl"))
    assert not list(out.glob(f"engine_{tiny.name}*.jsonl"))


@pytest.mark.slow
def test_offline_run_script_drives_the_one_command(tiny, tmp_path):
    """`offline.sh run` (what a lent GPU machine is given, call after call) passes its flags to
    `benchmarks run` as they are today, and tars the results into $OUT every call."""
    import os

    out, res = tmp_path / "out", tmp_path / "res"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "TRELLIS_GIT_REV": "test", "TRELLIS_SITE": str(tmp_path / "site"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", "benchmarks/offline.sh", "run", str(res), "--quick", "--suite", "gemm,engine",
                        "--model", str(tiny), "--engine-args", ""], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "benchmarks: complete" in r.stdout
    names = subprocess.run(["tar", "tzf", str(out / "results.tgz")], capture_output=True, text=True).stdout
    assert f"res/gemm_{tiny.name}.jsonl" in names and "res/run-state.json" in names


def test_gemm_candidates_compute_the_same_linear():
    """The GEMM probe's candidate strategies are the same maths as F.linear (+ GELU)."""
    import torch
    import torch.nn.functional as F

    from benchmarks.gemm import strategy_fn

    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(48, 64, generator=g), torch.randn(48, generator=g), torch.randn(5, 64, generator=g)
    ref = F.linear(x, w, b)
    torch.testing.assert_close(strategy_fn("cublas", "down", w, b)(x), ref)
    assert strategy_fn("gelu-epilogue", "down", w, b) is None
    torch.testing.assert_close(strategy_fn("linear+gelu", "up", w, b)(x), F.gelu(ref, approximate="tanh"))
    # cuBLASLt's epilogue is tanh GELU; the CPU kernel of _addmm_activation is exact GELU
    torch.testing.assert_close(strategy_fn("gelu-epilogue", "up", w, b)(x), F.gelu(ref))
    with pytest.raises(ValueError, match="unknown GEMM strategy"):
        strategy_fn("cublass", "up", w, b)


def test_readme_performance_table_matches_the_committed_results():
    """The README quotes the best committed run of every bge-m3 gRPC cell (benchmarks.summary's choice)."""
    import re
    from pathlib import Path

    from benchmarks import summary

    root = Path(__file__).resolve().parents[1]
    _, cells = summary.tulip_table(summary.load(root / "benchmarks" / "results"), "bge-m3")
    readme = (root / "README.md").read_text()
    assert cells
    for name, value, *_ in cells:
        bench, shape = name.split(" ", 1)
        n, rest = shape.split("x", 1)
        label = f"{bench} {n} x {rest}"  # "online 1x128" -> "online 1 x 128"; bulk keeps ", 4 clients"
        line = next((ln for ln in readme.splitlines() if ln.startswith(f"| {label} |")), None)
        assert line is not None, f"README has no row for {label}"
        quoted = float(re.search(r"[\d.]+", line.split("|")[2]).group())
        assert abs(quoted - value) <= (0.5 if bench == "bulk" else 0.006), (label, quoted, value)


@pytest.mark.slow
def test_gateway_benchmark_measures_ivy_alone(tmp_path):
    """benchmarks.gateway on CPU: Ivy in front of the stand-in Tulip, latency and saturation rows with
    the worker's CPU per request, then the per-stage rows from Ivy's IVY_STAGES stamps."""
    base = [sys.executable, "-m", "benchmarks.gateway", "--model", "default", "--length", "64", "--n", "30",
            "--out", str(tmp_path)]
    r = subprocess.run(base + ["--seconds", "1", "--clients", "2", "--encodings", "base64,float"], cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "gateway.jsonl").read_text().splitlines()]
    assert [(x["bench"], x["encoding"]) for x in rows] == [("ivy-latency", "base64"), ("ivy-saturation", "base64"),
                                                           ("ivy-latency", "float"), ("ivy-saturation", "float")]
    sat = rows[1]
    assert sat["failed"] == 0 and sat["req_per_s"] > 0 and sat["ivy_cpu_ms_per_req"] > 0 and sat["server"] == "uvicorn"
    assert {"when", "torch", "gpu", "git"} <= set(sat)
    r = subprocess.run(base + ["--stages", "--encodings", "base64", "--label", "stages", "--server", "granian"],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    stages = {x["stage"]: x for x in map(json.loads, (tmp_path / "gateway_stages.jsonl").read_text().splitlines())
              if x["bench"] == "ivy-stage"}
    assert {"receive", "decode", "tokenize", "balancer", "grpc", "encode", "send", "total"} <= set(stages)
    assert all(s["n"] == 30 for k, s in stages.items() if not k.startswith("outside"))
    assert stages["total"]["p50_us"] > stages["tokenize"]["p50_us"] > 0
    png = tmp_path / "stages.png"
    r = subprocess.run([sys.executable, "-m", "benchmarks.gateway", "--chart", str(tmp_path / "gateway_stages.jsonl"),
                        "--out", str(png)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r.stderr[-2000:]


def _exit_at_once(queue):
    raise SystemExit(3)


def test_hop_fails_fast_when_its_server_dies():
    """A server that dies before it is ready (an import or model load failing on the GPU host) is an
    error within seconds, not a wait for the whole start-up timeout."""
    import multiprocessing as mp
    import time

    from benchmarks.hop import _wait_ready

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_exit_at_once, args=(q,))
    p.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code 3"):
        _wait_ready(p, q, 600)
    assert time.monotonic() - t0 < 30


def test_clientab_pairs_two_trees_and_the_proto_client(tmp_path):
    """benchmarks.clientab: one Tulip over the null engine, two trees' trellis.client and the proto-only
    client taking turns in one process; a row per client and round, then the medians."""
    out = tmp_path / "ab.jsonl"
    subprocess.run([sys.executable, "-m", "benchmarks.clientab", "--trees", f"a={ROOT},b={ROOT}", "--n", "30",
                    "--warmup", "5", "--rounds", "1", "--transports", "stream,unary", "--timeout", "10",
                    "--out", str(out)], cwd=ROOT, check=True, timeout=300, capture_output=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    timed = [r for r in rows if r["bench"] == "clientab" and r.get("round") == 0]
    assert sorted((r["client"], r["transport"]) for r in timed) == sorted(
        (c, t) for c in ("a", "b", "proto") for t in ("stream", "unary"))
    assert all(r["n"] == 30 and r["p50_ms"] > 0 and r["main_thread_cpu_us"] > 0 for r in timed)
    summary = [r for r in rows if r["bench"] == "clientab-summary"]
    assert len(summary) == 6 and all(r["median_p50_ms"] == r["p50s_ms"][0] for r in summary)


def test_rows_say_how_their_servers_were_configured(monkeypatch):
    """A benchmark row carries the TULIP_* / IVY_* settings its servers inherited, and the summary's
    config column reads TULIP_COMPILE as `--compile` (a run configured by environment is not shown
    as uncompiled)."""
    from benchmarks import common, summary

    monkeypatch.setenv("TULIP_COMPILE", "true")
    monkeypatch.setenv("TULIP_WARMUP", "1x128")
    env = common.environment()
    assert env["server_env"] == "TULIP_COMPILE=true TULIP_WARMUP=1x128"
    row = {"backend": "trellis-tulip", "attention": "triton", "transport": "grpc-stream", **env}
    assert summary._config(row) == "triton + compile, stream"
    assert summary._config({**row, "server_env": "TULIP_COMPILE=false"}) == "triton, stream"
    assert summary._config({"backend": "trellis-tulip --compile", "attention": "varlen"}) == "varlen + compile"


def test_gpu_sampler_summarises_nvidia_smi_and_is_empty_without_it(tmp_path):
    """benchmarks.common.GpuSampler: nvidia-smi's CSV samples (here a stand-in script: no GPU on this
    machine) become the clock, power and throttle summary a throughput row carries; none of it, and no
    error, where nvidia-smi is missing."""
    from benchmarks.common import GpuSampler

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/bash\n"
                   "echo '1980, 121.80, 700.00, 0x0000000000000000'\n"
                   "echo '[N/A], [N/A], 700.00, 0x0000000000000000'\n"
                   "while true; do echo '1665, 693.40, 700.00, 0x0000000000000004'; sleep 0.02; done\n")
    smi.chmod(0o755)
    with GpuSampler(ms=20, smi=str(smi)) as gpu:
        time.sleep(0.5)
    s = gpu.summary()
    assert s["gpu_samples"] >= 3 and s["sm_clock_mhz_min"] == 1665 and s["sm_clock_mhz_p50"] == 1665
    assert s["power_w_max"] == 693.4 and s["power_limit_w"] == 700 and s["throttle_reasons"] == ["sw_power_cap"]
    assert 0.5 < s["throttled_share"] < 1
    with GpuSampler(smi=str(tmp_path / "absent")) as gpu:
        pass
    assert gpu.summary() == {}


@pytest.mark.slow
def test_images_benchmark_smoke_runs_every_cell(tmp_path):
    """benchmarks.images --smoke (issue 51): tiny CLIP towers built and saved by transformers, on the CPU: the gate
    (ROSE's image vectors against transformers' on the same weights), ROSE's steps, transformers eager and
    torch.compile'd, a Tulip over gRPC, an Ivy with the ~100 KB test JPEG (its vector equal to Tulip's for the same
    pixels) and ivy.images' decode: a row for each, and the chart."""
    from benchmarks.common import read_rows

    out = tmp_path / "images"
    r = subprocess.run([sys.executable, "-m", "benchmarks.images", "--smoke", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_rows(out / "images_clip-vit-base-patch16-tiny.jsonl")
    cells = sorted((x["cell"], x.get("batch", 0), x.get("mode") or x.get("requests_in_flight") or "") for x in rows)
    assert cells == sorted([("gate", 0, ""), ("engine", 1, "one step at a time"), ("engine", 4, "one step at a time"),
                            ("engine", 4, "two steps in flight"), ("hf-eager", 1, "one call at a time"),
                            ("hf-eager", 4, "one call at a time"), ("hf-compile", 1, "one call at a time"),
                            ("hf-compile", 4, "one call at a time"), ("grpc", 4, 1), ("grpc", 4, 2), ("grpc", 1, 1),
                            ("ivy", 1, ""), ("decode", 1, "")])
    by = {x["cell"]: x for x in rows}
    assert by["gate"]["passed"] and by["gate"]["cos_min"] >= 0.9999
    assert by["ivy"]["cos_vs_tulip"] >= 0.9999 and 90_000 <= by["ivy"]["jpeg_bytes"] <= 110_000
    assert by["decode"]["output"] == "uint8 [224, 224, 3]"
    assert all(x["images_per_s"] > 0 for x in rows if x["cell"] in ("engine", "hf-eager", "hf-compile"))
    assert all({"when", "torch", "gpu", "git", "p50_ms"} <= set(x) for x in rows if x["cell"] not in ("gate", "engine")
               or x.get("mode") == "one step at a time")
    assert (out / "images_clip-vit-base-patch16-tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
