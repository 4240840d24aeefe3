"""Shared benchmark plumbing: environment facts, percentiles, JSON lines, published numbers."""

from __future__ import annotations

import datetime as _dt
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

# ../shared/DESIGN.md: one H200, end to end through each stack (client in another process).
PUBLISHED = {
    "bge-m3": {
        "online_p50_ms": {128: {"vllm-0.22": 4.60, "tulip-rust": 1.53}, 512: {"vllm-0.22": 4.65, "tulip-rust": 2.03},
                          4096: {"vllm-0.22": 11.71, "tulip-rust": 9.57}},
        "bulk_emb_per_s": {512: {"vllm-0.22": 1342, "tulip-rust": 1499}, 1024: {"vllm-0.22": 622.5, "tulip-rust": 691.5},
                           4096: {"vllm-0.22": 116.6, "tulip-rust": 125.4}},
    },
    "pplx-embed-1-0.6b": {
        "online_p50_ms": {128: {"vllm-0.22": 4.94, "tulip-rust": 1.88}, 512: {"vllm-0.22": 4.98, "tulip-rust": 2.75},
                          4096: {"vllm-0.22": 16.15, "tulip-rust": 15.41}},
        "bulk_emb_per_s": {512: {"vllm-0.22": 902, "tulip-rust": 927}, 1024: {"vllm-0.22": 423, "tulip-rust": 423},
                           4096: {"vllm-0.22": 73.5, "tulip-rust": 72.2}},
    },
}
# Issue targets for the in-process engine step (BGE-M3 shape, bf16).
ENGINE_TARGETS = {"bge-m3": {"step_p50_ms": {128: 0.55, 512: 0.9, 4096: 8.0}, "emb_per_s_100x512": 1900,
                             "emb_per_s_mixed": 3000}}


def model_tag(model: str) -> str:
    """A model reference as a part of a results file's name: a preset's name (the names its results had before
    the `preset:` prefix), a Hub id's ORG--NAME[@REVISION] (as the Hugging Face cache names it), a directory's
    name."""
    from trellis.modelref import PRESET, parse_hub_id

    if model.startswith(PRESET):
        return model[len(PRESET):]
    hub = None if Path(model).expanduser().is_dir() else parse_hub_id(model)
    if hub is not None:
        return hub[0].replace("/", "--") + (f"@{hub[1]}" if hub[1] else "")
    return Path(model).name


def environment() -> dict:
    import torch

    env = {
        "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "gpus": torch.cuda.device_count(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "git": git_rev(),
        "grpc_experiments": os.environ.get("GRPC_EXPERIMENTS"),  # e.g. benchmarks.tailab's after+io: gRPC's I/O path
    }
    # the Tulip / Ivy settings a benchmark's servers inherit (TULIP_COMPILE=true is `--compile`)
    if served := " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("TULIP_", "IVY_"))):
        env["server_env"] = served
    from importlib import metadata

    for key, dist in (("flashinfer", "flashinfer-python"), ("flash_attn_4", "flash-attn-4")):
        try:
            env[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return env


def git_rev() -> str:
    """TRELLIS_GIT_REV (machines without the repository's .git), else the checkout's short revision."""
    return os.environ.get("TRELLIS_GIT_REV") or _git_rev()


def _git_rev() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def percentiles(samples_ms: list[float]) -> dict:
    a = np.asarray(samples_ms)
    return {"n": len(a), "p50_ms": round(float(np.percentile(a, 50)), 4), "p99_ms": round(float(np.percentile(a, 99)), 4),
            "mean_ms": round(float(a.mean()), 4)}


def results_files(folder: Path) -> list[Path]:
    """A folder's JSON-lines results, plain (`*.jsonl`, as a run writes them) and gzip-compressed (`*.jsonl.gz`,
    as the committed runs under benchmarks/results/ are kept), sorted by name."""
    return sorted([*folder.glob("*.jsonl"), *folder.glob("*.jsonl.gz")], key=lambda p: p.name)


def read_rows(path: Path) -> list[dict]:
    """The JSON objects of one results file, `.jsonl` or `.jsonl.gz` alike (every reader of results goes through
    here, so a committed run can be compressed without its readers noticing); lines that are not objects (a
    log line a run printed in between) are skipped."""
    path = Path(path)
    with (gzip.open(path, "rt") if path.name.endswith(".gz") else path.open()) as f:
        return [json.loads(line) for line in f if line.lstrip().startswith("{")]


class Recorder:
    """Prints one JSON object per measurement and keeps them for the summary and charts."""

    def __init__(self, out: Path | None, name: str):
        self.rows: list[dict] = []
        self.env = environment()
        self.path = None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            self.path = out / f"{name}.jsonl"
            self.path.write_text("")

    def emit(self, **row) -> dict:
        row = {**row, **self.env}
        self.rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(line + "\n")
        return row


# nvidia-smi's throttle ("clock event") reason bits that mean the GPU was held below its clock
THROTTLE_REASONS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
                    0x80: "hw_power_brake"}


class GpuSampler:
    """`nvidia-smi` sampling GPU `gpu`'s SM clock, power draw and throttle reasons every `ms` while a
    block runs, so a throughput figure says whether the board held its clock: `with GpuSampler() as
    gs: ...`, then `gs.summary()` (an empty dict where nvidia-smi is not there or gave no sample).
    Measured this way on an H200 (2026-12-04), bge-m3's 100 x 512 loop drew ~693 W of its 700 W and
    ran at ~1,665 MHz against 1,980 for short steps (benchmarks/results/2026-12-04_h200_small-step-power-d49d5af/)."""

    QUERY = "clocks.sm,power.draw,power.limit,clocks_throttle_reasons.active"

    def __init__(self, ms: int = 100, gpu: int = 0, smi: str = "nvidia-smi"):
        self.cmd = [smi, f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits", "-lms", str(ms), "-i", str(gpu)]
        self.proc = None
        self.lines: list[str] = []

    def __enter__(self) -> GpuSampler:
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:  # no nvidia-smi here
            self.proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                out, _ = self.proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # an nvidia-smi that ignores SIGTERM costs its samples, not the run
                self.proc.kill()
                out, _ = self.proc.communicate()
            self.lines = out.splitlines()

    def summary(self) -> dict:
        rows = []
        for line in self.lines:
            try:
                clock, power, limit, reasons = (x.strip() for x in line.split(","))
                rows.append((float(clock), float(power), float(limit), int(reasons, 16)))
            except ValueError:  # a header, "[N/A]", a field this nvidia-smi does not know
                continue
        if not rows:
            return {}
        clock, power, limit, reasons = (np.array(c) for c in zip(*rows))
        held = reasons & sum(THROTTLE_REASONS)  # per sample, the bits that held the clock down
        return {"gpu_samples": len(rows), "sm_clock_mhz_p50": float(np.median(clock)), "sm_clock_mhz_min": float(clock.min()),
                "power_w_p50": round(float(np.median(power)), 1), "power_w_max": round(float(power.max()), 1),
                "power_limit_w": float(limit.max()), "throttled_share": round(float(np.mean(held != 0)), 3),
                "throttle_reasons": [name for bit, name in THROTTLE_REASONS.items() if (held & bit).any()]}


def graph_replay_ms(issue, iters: int) -> float:
    """Median milliseconds of one replay of a CUDA graph holding what `issue()` launches (run once
    eagerly first, so compilation and kernel selection stay out of the capture)."""
    import torch

    issue()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        issue()
    g.replay()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return float(np.median(ts))


def progress(items, desc: str):
    """A progress bar on stderr (tqdm) over `items` (or range(items))."""
    from tqdm import tqdm

    return tqdm(range(items) if isinstance(items, int) else items, desc=desc, leave=False, mininterval=1.0,
                file=sys.stderr)


def bulk_clients(client, args: tuple, n_req: int, clients: int = 4) -> dict:
    """Run `client(*args, seed, barrier, queue)` in `clients` processes (spawned); each sends `n_req`
    requests of 100 sequences after the barrier and puts (start, end, embeddings) on the queue.
    Returns the aggregate embeddings per second over the span from first start to last end."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(clients), ctx.Queue()
    procs = [ctx.Process(target=client, args=(*args, i, barrier, q)) for i in range(clients)]
    for p in procs:
        p.start()
    res = [q.get(timeout=1200) for _ in procs]
    for p in procs:
        p.join()
    start, end = min(r[0] for r in res), max(r[1] for r in res)
    return {"emb_per_s": round(sum(r[2] for r in res) / (end - start), 1), "clients": clients,
            "requests_per_client": n_req}


def pyplot():
    """matplotlib.pyplot with a file backend, or None (with a note) where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'): no chart", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def spawn_until_ready(module_args: list[str], ready_text: str, log: Path, timeout: float = 900):
    """Start `python -m <module_args>` in the repository, output to `log`; return the process once
    `ready_text` appears there (or raise with the log's tail if it exits or times out)."""
    import time

    root = Path(__file__).resolve().parent.parent
    p = subprocess.Popen([sys.executable, "-m", *module_args], cwd=root, stdout=log.open("w"),
                         stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"{module_args[0]} exited {p.returncode}:\n{log.read_text()[-3000:]}")
        if ready_text in log.read_text():
            return p
        time.sleep(0.5)
    p.kill()
    raise TimeoutError(f"{module_args[0]} was not ready after {timeout:.0f} s")


_CLIENT_LOOP = None


def run_client(coro):
    """Run a gRPC client coroutine on this process's one client event loop (uvloop where installed,
    as Ivy runs). grpc.aio ties its completion-queue poller to the loops it has served: a fresh
    `asyncio.run` per cell left it waking closed loops ("Event loop is closed")."""
    global _CLIENT_LOOP
    if _CLIENT_LOOP is None:
        try:
            import uvloop

            _CLIENT_LOOP = uvloop.new_event_loop()
        except ImportError:
            import asyncio

            _CLIENT_LOOP = asyncio.new_event_loop()
    return _CLIENT_LOOP.run_until_complete(coro)


def stop(proc: subprocess.Popen, sig: int = 15, timeout: float = 30.0) -> None:
    """Signal a server this run started (SIGTERM by default) and wait for it; killed if it outlasts `timeout`."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


_GIVEN: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on. With TRELLIS_FREE_PORTS=LO-HI (the test harness sets one range per
    pytest worker, below the kernel's ephemeral range), a port of that range not given out before by this
    process: the kernel's port-0 choice comes from the ephemeral range, where a concurrent client's outgoing
    connection or another worker's pick can take it before the server binds it."""
    import random
    import socket

    span = os.environ.get("TRELLIS_FREE_PORTS", "")
    if not span:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    lo, hi = (int(x) for x in span.split("-"))
    for _ in range(200):
        port = random.randrange(lo, hi)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port in TRELLIS_FREE_PORTS={span}")


def write_profile(prof, out: Path, name: str = "profile", lines: int = 30) -> None:
    """A cProfile.Profile's stats under `out`: NAME.pstats, and the top `lines` by own and by cumulative time as
    NAME-tottime.txt / NAME-cumulative.txt."""
    import io
    import pstats

    out.mkdir(parents=True, exist_ok=True)
    prof.dump_stats(str(out / f"{name}.pstats"))
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(lines)
        (out / f"{name}-{key}.txt").write_text(text.getvalue())
