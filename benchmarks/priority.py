"""Online latency while a bulk job shares the Tulip (issue 50): the two priority classes measured.

    python -m benchmarks.priority --model default --device cpu --max-batch-tokens 512 [--bulk 8] [--seqs 4] [--length 128]
    python -m benchmarks.priority --tulip 127.0.0.1:50051       (a running Tulip)

Three phases on one Tulip: `idle` (online probes alone), `job-batch` (a job keeps `--bulk` requests of
`--seqs` x `--length` tokens outstanding at PRIORITY_BATCH, as `trellis embed` does, while the probes
run) and `job-online` (the same job at PRIORITY_ONLINE: one first-come-first-served queue, what every
request got before the classes). The probes are single sequences of `--online-length` tokens, one at a
time on a client of their own, `--gap-ms` apart. One JSON object per phase: the probes' p50 / p99 ms and
the job's embeddings per second in that phase.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Recorder, free_port, percentiles, spawn_until_ready, stop
from trellis.cli import prog
from trellis.client import EmbedOptions, TulipClient
from trellis.tulip.v1 import tulip_pb2


async def phase(target: str, job_priority: int | None, args, vocab: int) -> dict:
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
        for _ in range(3):  # the probe's stream open, its graph captured
            await online.embed(list(probe))
        workers = [asyncio.ensure_future(worker(job, s)) for s in job_seqs] if job_priority is not None else []
        await asyncio.sleep(args.settle_s)  # the job's queue filled
        d0, t0 = done, time.perf_counter()
        lat = []
        for _ in range(args.n):
            s = time.perf_counter()
            await online.embed(list(probe))
            lat.append((time.perf_counter() - s) * 1e3)
            await asyncio.sleep(args.gap_ms / 1e3)
        elapsed = time.perf_counter() - t0
        running = False
        await asyncio.gather(*workers)
    return {**percentiles(lat), "job_emb_per_s": round((done - d0) / elapsed, 1) if workers else 0.0}


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
    ap.add_argument("--out", type=Path, default=None, help="a directory for priority.jsonl")
    ap.add_argument("--batch-step-tokens", type=int, nargs="*", default=[0],
                    help="the started Tulip's --batch-step-tokens, one Tulip (idle and job-batch phases) per value")
    ap.add_argument("--phases", default="idle,job-batch,job-online", help="which phases to run, in order")
    args = ap.parse_args(argv)
    if args.tulip:
        return run(args, args.tulip, 0)
    for cap in args.batch_step_tokens:
        port = free_port()
        log = Path(tempfile.mkdtemp(prefix="priority-")) / "tulip.log"
        budget = ["--max-batch-tokens", str(args.max_batch_tokens)] if args.max_batch_tokens else []
        proc = spawn_until_ready(["tulip", "--model", args.model, "--device", args.device, "--port", str(port),
                                  "--batch-step-tokens", str(cap), *budget], "TULIP_READY", log)
        try:
            run(args, f"127.0.0.1:{port}", cap)
        finally:
            stop(proc)


def run(args, target: str, cap: int) -> None:
    rec = Recorder(args.out, "priority")

    async def info():
        async with TulipClient(target) as c:
            return await c.info()

    i = asyncio.run(info())
    classes = {"idle": None, "job-batch": tulip_pb2.PRIORITY_BATCH, "job-online": tulip_pb2.PRIORITY_ONLINE}
    for name in args.phases.split(","):
        row = asyncio.run(phase(target, classes[name], args, i.vocab_size))
        rec.emit(bench="priority", phase=name, model=i.model, device=i.device, backend=i.attention,
                 max_batch_tokens=i.max_batch_tokens, batch_step_tokens=cap,
                 job=f"{args.bulk}x{args.seqs}x{args.length}", online_length=args.online_length, **row)

if __name__ == "__main__":
    main()
