"""`trellis embed`'s throughput (issue 50) beside the engine's own, in one run, on one Embedder.

    python -m benchmarks.embed_job --model default --device cpu --rows 2000 --length 128        # the CPU figure
    python -m benchmarks.embed_job --model preset:bge-m3 --device cuda --rows 100000 --length 512  # the GPU target

A Parquet file of `--rows` texts of `--length` tokens each (`--distinct` different texts, repeated) is embedded
`--runs` times by jobs.run.run into a fresh OUTPUT (each run reads, tokenizes, steps, writes and commits every
part; the model is loaded once, before the first run). Before each run the engine alone steps `--engine-batch` x
length (default 100 x length, the published bulk shape) as many times as makes `--engine-rows` embeddings
(default 20,000, at most --rows): the engine's figure comes first, so a time-limited call has it, and the rounds
interleave (engine, job, engine, job, ...) so a drifting clock falls on both. The job's emb/s over the engine's
is the issue's ">= 95 %" figure. Once, first, the engine also steps the job's own step shape (its token budget
// length sequences; on CPU Tulip's 2,048-token pieces: `engine_step_job_shape`; `--max-batch-tokens` sets the
job's budget). Each job row carries `host_idle_share`: the share of its wall time with no engine step in flight
(jobs.backends.StepClock), the host work the steps did not hide. One JSON object per measurement on stdout; all of
them, with the date and machine, in `--out` (a JSON file, rewritten after each measurement).

With --ray, each in-process run is followed by one on Ray for each actor group (`--ray-actors 1,2`: one actor,
then two; on a GPU host, 1: one GPU), on the same input through the same jobs.run.run (jobs.ray: an Embedder in
each actor), the actors' start-up left out as the in-process Embedder's load is (the issue's ">= 90 %" figure):

    python -m benchmarks.embed_job --model default --device cpu --rows 2000 --length 32 --ray --ray-actors 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np


def texts(model_path: Path, n: int, length: int, distinct: int) -> list[str]:
    from benchmarks.concurrency import text_of

    pool = [text_of(model_path / "tokenizer.json", length, seed=k) for k in range(min(distinct, n))]
    return [pool[i % len(pool)] for i in range(n)]


def engine_rate(engine, length: int, batch: int, rows: int) -> float:
    """Embeddings a second of `engine.step` on `batch` sequences of `length` tokens (after 3 warm-up steps)."""
    from rose.batch import Batch

    b = Batch.from_sequences([np.full(length, 5, dtype=np.int64)] * batch)
    for _ in range(3 if engine.device.type == "cuda" else 1):  # CUDA: eager, capture, replay; CPU: one
        engine.step(b).synchronize()
    steps = max(1, rows // batch)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step(b).synchronize()
    return steps * batch / (time.perf_counter() - t)


def start_ray(args, groups: list[int], cpus: int, inp: Path, tmp: str, base: list[str]) -> list[dict]:
    """Each group's actors started and loaded (jobs.ray, as `trellis embed --ray` starts them), kept for every
    run. On CPU a group of n actors asks for cpus // n CPUs each; a local instance gets the CPUs of all the groups
    (logical: the groups take turns, one busy at a time)."""
    import ray
    import torch

    from jobs.config import EmbedJobConfig
    from jobs.ray import embedders, start_actors, wait_ready

    gpu = args.device != "cpu" and torch.cuda.is_available()
    if args.ray == "local":
        ray.init(num_cpus=cpus if gpu else sum(n * max(1, cpus // n) for n in groups), include_dashboard=False,
                 logging_level="WARNING")
    else:
        ray.init(address=args.ray, logging_level="WARNING")
    out = []
    for n in groups:
        extra = [] if gpu else ["--ray-cpus", str(max(1, cpus // n))]
        cfg = EmbedJobConfig.from_args([str(inp), str(Path(tmp) / "x"), *base, "--ray", args.ray,
                                        "--ray-actors", str(n), *extra])
        t = time.perf_counter()
        actors = start_actors(cfg)
        wait_ready(actors)
        out.append({"actors": n, "actors_handles": actors, "embedders": embedders(actors, cfg.settings()),
                    "load_s": round(time.perf_counter() - t, 2),
                    "resources": {"num_gpus": 1} if gpu else {"num_cpus": max(1, cpus // n)}})
        print(f"# Ray: {n} actors ready in {out[-1]['load_s']} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--length", type=int, default=128, help="tokens per text, special tokens included")
    ap.add_argument("--distinct", type=int, default=64, help="different texts among the rows")
    ap.add_argument("--rows-per-part", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--engine-batch", type=int, default=100)
    ap.add_argument("--max-batch-tokens", type=int, default=0, help="the job's step budget (trellis embed "
                    "--max-batch-tokens; 0: its default, 16,384 or the model's maximum)")
    ap.add_argument("--engine-rows", type=int, default=20000,
                    help="embeddings each engine figure steps (at most --rows; 0: --rows)")
    ap.add_argument("--ray", nargs="?", const="local", default="",
                    help="also run the job on Ray (trellis embed --ray ADDRESS; alone: a local instance of as many "
                         "logical CPUs as the actor groups ask for), each run beside the in-process one")
    ap.add_argument("--ray-actors", default="1,2", help="with --ray: actor groups, e.g. 1,2: one actor of all "
                    "the CPUs, then two of half each (on GPUs: one GPU an actor)")
    ap.add_argument("--out", default="", help="write every measurement here (JSON)")
    args = ap.parse_args(argv)

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from benchmarks.common import environment
    from jobs.config import EmbedJobConfig
    from jobs.embed import Embedder
    from jobs.run import run
    from trellis.modelref import resolve
    from tulip.steps import CPU_PIECE_TOKENS

    groups = [int(n) for n in args.ray_actors.split(",") if n.strip()] if args.ray else []
    cpus = os.cpu_count() or 1

    ref = resolve(args.model)
    rows = []
    machine = {}

    def record(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:  # after each measurement: a run cut short keeps what it measured
            write(args, machine, rows, None)

    with tempfile.TemporaryDirectory(prefix="embed-job-bench-") as tmp:
        inp = Path(tmp) / "in.parquet"
        t = time.perf_counter()
        pq.write_table(pa.table({"id": np.arange(args.rows), "text": texts(ref.path, args.rows, args.length,
                                                                           args.distinct)}), inp)
        print(f"# {args.rows} texts of {args.length} tokens written in {time.perf_counter() - t:.1f} s", flush=True)
        base = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--rows-per-part",
                str(args.rows_per_part), "--progress", "off", "--max-batch-tokens", str(args.max_batch_tokens)]
        cfg = EmbedJobConfig.from_args([str(inp), str(Path(tmp) / "out-0"), *base])
        t = time.perf_counter()
        embedder = Embedder(cfg.settings(), device=args.device, dtype=args.dtype,
                            max_batch_tokens=args.max_batch_tokens)
        load_s = time.perf_counter() - t
        machine.update(environment(), platform=platform.platform(), torch_threads=torch.get_num_threads(),
                       cpu_count=os.cpu_count())
        engine = embedder.backend.engine
        length = min(args.length, engine.spec.max_seq_len)
        engine_rows = min(args.engine_rows or args.rows, args.rows)

        def engine_row(batch: int, k: int, bench: str = "engine_step") -> dict:
            return {"bench": bench, "model": args.model, "backend": args.device, "shape": f"{batch}x{args.length}",
                    "emb_per_s": round(engine_rate(engine, length, batch, engine_rows), 1), "rows": engine_rows,
                    "run": k, "dtype": str(engine.dtype).removeprefix("torch."), "attention": engine.attention.name,
                    "load_average_1m": os.getloadavg()[0]}

        ray_groups = []
        try:
            record(engine_row(args.engine_batch, 0))
            # the steps the job's scheduler forms: its token budget (on CPU Tulip's loop runs a piece at a time)
            job_batch = max(1, (embedder.budget if engine.device.type == "cuda" else
                                min(embedder.budget, CPU_PIECE_TOKENS)) // length)
            if job_batch != args.engine_batch:
                record(engine_row(job_batch, 0, "engine_step_job_shape"))
            ray_groups = start_ray(args, groups, cpus, inp, tmp, base) if groups else []
            for k in range(args.runs):  # engine, in-process, then each Ray group, in turn: the same load for each
                if k:
                    record(engine_row(args.engine_batch, k))
                cfg = EmbedJobConfig.from_args([str(inp), str(Path(tmp) / f"out-{k}"), *base])
                s = run(cfg, [embedder])
                record({"bench": "embed_job", "model": args.model, "backend": args.device, "rows": s["rows"],
                        "length": args.length, "tokens": s["tokens"], "seconds": s["seconds"],
                        "emb_per_s": round(s["rows"] / s["seconds"], 1), "run": k, "load_s": round(load_s, 2),
                        "host_idle_share": s.get("host_idle_share"), "step_busy_seconds": s.get("step_busy_seconds"),
                        "load_average_1m": os.getloadavg()[0]})
                for g in ray_groups:
                    cfg = EmbedJobConfig.from_args([str(inp), str(Path(tmp) / f"ray{g['actors']}-{k}"), *base,
                                                    "--ray", args.ray])
                    s = run(cfg, g["embedders"])
                    record({"bench": "embed_job_ray", "model": args.model, "backend": args.device, "rows": s["rows"],
                            "length": args.length, "tokens": s["tokens"], "seconds": s["seconds"],
                            "emb_per_s": round(s["rows"] / s["seconds"], 1), "run": k, "ray": args.ray,
                            "actors": g["actors"], "actor_resources": g["resources"], "load_s": g["load_s"],
                            "load_average_1m": os.getloadavg()[0]})
        finally:
            embedder.close()
            if ray_groups:
                import ray

                for g in ray_groups:
                    for a in g["actors_handles"]:
                        ray.kill(a)
                ray.shutdown()
    job = [r["emb_per_s"] for r in rows if r["bench"] == "embed_job"]
    eng = [r["emb_per_s"] for r in rows if r["bench"] == "engine_step"]
    idle = [r["host_idle_share"] for r in rows if r["bench"] == "embed_job" and r["host_idle_share"] is not None]
    summary = {"bench": "embed_job_summary", "job_emb_per_s_median": float(np.median(job)),
               "engine_emb_per_s": float(np.median(eng)),
               "job_over_engine": round(float(np.median(job)) / float(np.median(eng)), 3),
               # each round's job over the engine figure measured just before it
               "job_over_engine_rounds": [round(j / e, 3) for j, e in zip(job, eng)],
               "host_idle_share_median": float(np.median(idle)) if idle else None}
    shape = [r for r in rows if r["bench"] == "engine_step_job_shape"]
    if shape:
        summary["engine_job_shape_emb_per_s"] = shape[0]["emb_per_s"]
        summary["job_over_engine_job_shape"] = round(float(np.median(job)) / shape[0]["emb_per_s"], 3)
    for n in groups:
        on_ray = [r["emb_per_s"] for r in rows if r["bench"] == "embed_job_ray" and r["actors"] == n]
        summary[f"ray_{n}_actors_emb_per_s_median"] = float(np.median(on_ray))
        summary[f"ray_{n}_actors_over_in_process"] = round(float(np.median(on_ray)) / float(np.median(job)), 3)
    print(json.dumps(summary), flush=True)
    if args.out:
        write(args, machine, rows, summary)
    return 0


def write(args, machine: dict, rows: list[dict], summary: dict | None) -> None:
    result = {"date": time.strftime("%Y-%m-%d"), "machine": {**machine, "load_average": os.getloadavg()},
              "args": vars(args), "runs": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out).with_name(Path(args.out).name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
