"""Online latency while a bulk job shares the Tulip (issue 50): the two priority classes measured.

    python -m benchmarks.priority --model default --device cpu --max-batch-tokens 512 [--bulk 8] [--seqs 4] [--length 128]
    python -m benchmarks.priority --model preset:bge-m3 --device cuda --bulk 8 --seqs 100 --length 512 \
        --online-length 128 --n 400 --gap-ms 5 --online-batch-step-tokens 0 1024 [--base .prio-base]
    python -m benchmarks.priority --tulip 127.0.0.1:50051       (a running Tulip)

Phases on one Tulip: `job-alone` (the job alone for `--alone-s`: its rate with no online work beside it, first
by default so that no online request came before it), `idle` (online probes alone), `job-batch` (a job keeps `--bulk` requests of `--seqs` x `--length` tokens outstanding at
PRIORITY_BATCH, as `trellis embed` does, while the probes run) and `job-online` (the same job at PRIORITY_ONLINE:
one first-come-first-served queue, what every request got before the classes; slow beside a big job, so not in the
default `--phases`). The probes are single sequences of `--online-length` tokens, one at a time on a client of their
own, `--gap-ms` apart. One JSON object per phase (the probes' p50 / p99 ms, the job's embeddings per second in that
phase), then a `priority-summary` object per Tulip: idle and beside-the-job p99, their ratio (issue 50's target:
at most 2) and the job's rate alone and beside the probes.

A Tulip is started per (`--batch-step-tokens`, `--online-batch-step-tokens`, `--online-lane-tokens`: the online
lane, online steps on a CUDA stream of their own beside the job's) triple; `--base DIR` adds one more
whose `tulip` package is this tree's with DIR's `*.py` files in place of its own (e.g. the scheduler and engine
loop before a change), so a before / after pair runs on the same machine in one call (rows `tulip: base`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Recorder, free_port, percentiles, spawn_until_ready, stop
from trellis.cli import prog
from trellis.client import EmbedOptions, TulipClient
from trellis.tulip.v1 import tulip_pb2

ROOT = Path(__file__).resolve().parent.parent
CLASSES = {"idle": None, "job-alone": tulip_pb2.PRIORITY_BATCH, "job-batch": tulip_pb2.PRIORITY_BATCH,
           "job-online": tulip_pb2.PRIORITY_ONLINE}


async def phase(target: str, name: str, args, vocab: int) -> dict:
    job_priority = CLASSES[name]
    rng = np.random.default_rng(0)
    job_seqs = [rng.integers(1000, vocab - 1, (args.seqs, args.length)).astype(np.int32) for _ in range(args.bulk)]
    probe = rng.integers(1000, vocab - 1, (1, args.online_length)).astype(np.int32)
    done = 0
    running = True

    async def worker(client: TulipClient, seqs) -> None:
        nonlocal done
        opts = EmbedOptions(priority=job_priority)
        while running:
            await client.call(list(seqs), opts)
            done += len(seqs)

    async with TulipClient(target) as job, TulipClient(target) as online:
        for _ in range(3 if name != "job-alone" else 0):  # the probe's stream open, its graph captured (job-alone:
            await online.embed(list(probe))                # none, no online work live in Tulip, ONLINE_LIVE_S)
        workers = [asyncio.ensure_future(worker(job, s)) for s in job_seqs] if job_priority is not None else []
        await asyncio.sleep(args.settle_s)  # the job's queue filled
        d0, t0 = done, time.perf_counter()
        lat = []
        if name == "job-alone":
            await asyncio.sleep(args.alone_s)
        else:
            for _ in range(args.n):
                s = time.perf_counter()
                await online.embed(list(probe))
                lat.append((time.perf_counter() - s) * 1e3)
                await asyncio.sleep(args.gap_ms / 1e3)
        elapsed = time.perf_counter() - t0
        running = False
        await asyncio.gather(*workers)
    lat_row = percentiles(lat) if lat else {"n": 0, "p50_ms": None, "p99_ms": None, "mean_ms": None}
    return {**lat_row, "job_emb_per_s": round((done - d0) / elapsed, 1) if workers else 0.0}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog=prog("benchmarks.priority"), description=__doc__.split("\n\n")[0])
    ap.add_argument("--tulip", default="", help="a running Tulip (HOST:PORT); none: start one with --model")
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-batch-tokens", type=int, default=0, help="the started Tulip's step budget (0: its own)")
    ap.add_argument("--bulk", type=int, default=8, help="the job's requests outstanding")
    ap.add_argument("--seqs", type=int, default=4, help="sequences per job request")
    ap.add_argument("--length", type=int, default=128, help="tokens per job sequence")
    ap.add_argument("--online-length", type=int, default=64, help="tokens of the online probe")
    ap.add_argument("--n", type=int, default=60, help="probes per phase")
    ap.add_argument("--gap-ms", type=float, default=20.0, help="pause between probes")
    ap.add_argument("--settle-s", type=float, default=1.0, help="job time before the probes start")
    ap.add_argument("--alone-s", type=float, default=3.0, help="how long the job-alone phase measures the job")
    ap.add_argument("--out", type=Path, default=None, help="a directory for priority.jsonl")
    ap.add_argument("--batch-step-tokens", type=int, nargs="*", default=[0],
                    help="the started Tulip's --batch-step-tokens (0: its default), one Tulip per value")
    ap.add_argument("--online-batch-step-tokens", type=int, nargs="*", default=[0],
                    help="the started Tulip's --online-batch-step-tokens (0: its default), one Tulip per value "
                         "(and per --batch-step-tokens value)")
    ap.add_argument("--online-lane-tokens", type=int, nargs="*", default=[0],
                    help="the started Tulip's --online-lane-tokens (0: one stream), one Tulip per value (and per "
                         "value of the two above)")
    ap.add_argument("--base", type=Path, default=None,
                    help="a directory of tulip/*.py files (e.g. the scheduler and loop before a change): one more "
                         "Tulip, first, with this tree's tulip package but those files; its rows say tulip: base")
    ap.add_argument("--phases", default="job-alone,idle,job-batch", help="which phases to run, in order "
                    "(idle, job-alone, job-batch, job-online; job-alone first: no online work was ever live)")
    args = ap.parse_args(argv)
    unknown = set(args.phases.split(",")) - set(CLASSES)
    if unknown:
        ap.error(f"--phases: unknown {sorted(unknown)}; choose from {sorted(CLASSES)}")
    if args.base is not None and not sorted(args.base.glob("*.py")):
        ap.error(f"--base {args.base}: no *.py files there")
    if args.base is not None and sys.version_info < (3, 11):  # (older ones ignore PYTHONSAFEPATH: see base_tulip)
        ap.error("--base needs Python 3.11 or later")
    rec = Recorder(args.out, "priority")  # one file for every Tulip of the run
    if args.tulip:
        return run(rec, args, args.tulip, {"tulip": "given"})
    runs = [("base", cap, 0, 0) for cap in args.batch_step_tokens] if args.base is not None else []
    runs += [("tree", cap, live, lane) for cap in args.batch_step_tokens for live in args.online_batch_step_tokens
             for lane in args.online_lane_tokens]
    for which, cap, live, lane in runs:
        port = free_port()
        tmp = Path(tempfile.mkdtemp(prefix="priority-"))
        flags = ["--max-batch-tokens", str(args.max_batch_tokens)] if args.max_batch_tokens else []
        flags += ["--batch-step-tokens", str(cap)] if cap else []
        flags += ["--online-batch-step-tokens", str(live)] if live else []
        flags += ["--online-lane-tokens", str(lane)] if lane else []
        with base_tulip(args.base, tmp) if which == "base" else _nothing():
            proc = spawn_until_ready(["tulip", "--model", args.model, "--device", args.device, "--port", str(port),
                                      *flags], "TULIP_READY", tmp / "tulip.log")
        try:
            run(rec, args, f"127.0.0.1:{port}",
                {"tulip": which, "batch_step_tokens": cap, "online_batch_step_tokens": live, "online_lane_tokens": lane})
        finally:
            stop(proc)
            shutil.rmtree(tmp, ignore_errors=True)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class base_tulip:
    """While open, `python -m tulip` started from the repository imports a copy of this tree's `tulip` package
    with `base`'s files in it: PYTHONSAFEPATH keeps the working directory (the repository) off the front of
    sys.path, PYTHONPATH puts the copy there, and the repository after it (rose, trellis, ...)."""

    def __init__(self, base: Path, tmp: Path):
        self.base, self.pkg = base, tmp / "base"

    def __enter__(self):
        shutil.copytree(ROOT / "tulip", self.pkg / "tulip", ignore=shutil.ignore_patterns("__pycache__"))
        for f in sorted(self.base.glob("*.py")):
            shutil.copy(f, self.pkg / "tulip" / f.name)
        self.saved = {k: os.environ.get(k) for k in ("PYTHONSAFEPATH", "PYTHONPATH")}
        os.environ["PYTHONSAFEPATH"] = "1"
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.pkg), str(ROOT), self.saved["PYTHONPATH"]) if p)
        return self

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        return False


def run(rec: Recorder, args, target: str, tags: dict) -> None:
    async def info():
        async with TulipClient(target) as c:
            return await c.info()

    i = asyncio.run(info())
    rows = {}
    for name in args.phases.split(","):
        rows[name] = row = asyncio.run(phase(target, name, args, i.vocab_size))
        rec.emit(bench="priority", phase=name, model=i.model, device=i.device, backend=i.attention,
                 max_batch_tokens=i.max_batch_tokens, **tags,
                 job=f"{args.bulk}x{args.seqs}x{args.length}", online_length=args.online_length, **row)
    idle, beside, alone = rows.get("idle"), rows.get("job-batch"), rows.get("job-alone")
    if idle and beside:
        ratio = round(beside["p99_ms"] / idle["p99_ms"], 2)
        rec.emit(bench="priority-summary", model=i.model, device=i.device, **tags,
                 job=f"{args.bulk}x{args.seqs}x{args.length}", online_length=args.online_length, n=args.n,
                 gap_ms=args.gap_ms, idle_p99_ms=idle["p99_ms"], beside_job_p99_ms=beside["p99_ms"],
                 beside_job_p50_ms=beside["p50_ms"], p99_over_idle=ratio, target_met=ratio <= 2.0,
                 job_alone_emb_per_s=alone["job_emb_per_s"] if alone else None,
                 job_beside_probes_emb_per_s=beside["job_emb_per_s"])


if __name__ == "__main__":
    main()
