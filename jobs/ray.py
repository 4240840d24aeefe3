"""`trellis embed INPUT OUTPUT --ray [ADDRESS]`: the job's parts embedded by Ray actors, each holding one
`Embedder` (the in-process path's unit of work: built once per actor, called once per part). Ray is an optional
extra: `pip install 'trellis[ray]'`.

What Ray is given, and why: the driver (this process) reads the input with `jobs.dataset.Input` (the same parts,
cut the same way as in-process), skips the parts OUTPUT has committed, and sends every other part to one actor as
one call (up to `INFLIGHT_PER_ACTOR` calls queued per actor, so an actor never waits for its next part); the
actor returns the part's rows and bad rows, and the driver commits them through `jobs.dataset.Output`. So the part
files, `_done/` markers, `_job.json` and `_errors.jsonl` are the in-process path's, a job begun one way goes on
the other, and resume stays exact: the unit Ray computes is the unit that is committed. Ray Data's
read_* + map_batches is not what the CLI runs, because its blocks are not the job's parts (a datasource cuts and
coalesces rows by block size, and the core's JSONL reader turns a bad line into an error row, which
`read_json` cannot), so a restart could not tell which input rows are done; and a driver-side commit keeps
OUTPUT one local directory written by one process, whatever node computed a part. For a Ray Data pipeline of
one's own (read, filter, embed, write anywhere; no resume), `EmbedBatches` is the same Embedder as a
`map_batches` class.

ADDRESS: "local" (`--ray` alone: a Ray instance started on this host for the job and stopped after it), "auto"
(the cluster this host is a node of), "ray://HOST:PORT" (Ray Client) or "HOST:PORT" (a cluster's GCS). Actors
(`--ray-actors`, 0: one per GPU of the cluster, or one on a cluster without GPUs): one GPU each where the cluster
has GPUs and --device is not cpu, else an equal share of the CPUs. An actor lost with its process or node is
restarted and its queued parts sent again (`max_restarts`, `max_task_retries`); the driver commits each part
once. The cluster's nodes need the same trellis installed (`pip install 'trellis[ray]'`, e.g. in their image)
and reach the model as this host does (a Hub id is downloaded into each node's cache once).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import pyarrow as pa

from jobs.config import EmbedJobConfig, EmbedSettings
from jobs.dataset import Input, Output
from jobs.embed import Embedder, as_table, split_errors
from jobs.run import Progress, job_record

log = logging.getLogger("jobs.ray")

INFLIGHT_PER_ACTOR = 2  # one part running, one shipped and waiting: the actor never idles for the driver
RESTARTS = 2  # an actor that dies (its process, its node) is restarted this often, its calls retried
EXTRA = "pip install 'trellis[ray]'"


class RayMissing(ValueError):
    """--ray without Ray installed (exit 2, as a bad argument)."""


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise RayMissing(f"--ray needs Ray (ray[data] >= 2.40), which this Python cannot import ({e}): {EXTRA}") \
            from None
    return ray


def connect(address: str) -> bool:
    """Start or join Ray for `address` (module docstring); True when this call did (ray.shutdown at the end).
    A program that began Ray itself (a notebook, a test) keeps its instance, whatever the address says."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    try:
        if address == "local":
            ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)
        else:
            ray.init(address=address, logging_level=logging.WARNING)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise ValueError(f"cannot start or reach Ray at {address!r}: {e}") from None
    return True


class EmbedWorker:
    """One actor's state: one Embedder, built when the actor starts; `embed` is one part."""

    def __init__(self, settings: EmbedSettings, worker: dict, threads: int):
        if threads:  # Ray sets OMP_NUM_THREADS to the actor's CPUs; torch may have read it before: say it again
            import torch

            torch.set_num_threads(threads)
        self.embedder = Embedder(settings, **worker)

    def ready(self) -> str:
        return f"{os.uname().nodename}:{os.getpid()}"

    def embed(self, table: pa.Table, first_row: int) -> tuple[pa.Table, list[dict], int, float]:
        """A part's rows -> (the rows to write, the bad rows, tokens embedded, seconds)."""
        t = time.monotonic()
        good, errors = split_errors(self.embedder(table, first_row))
        tokens = sum(x for x in good.column("tokens").to_pylist() if x is not None)
        return good, errors, tokens, time.monotonic() - t


def plan(cfg: EmbedJobConfig) -> tuple[int, dict, str, int]:
    """(actors, each actor's Ray resources, its device, its torch threads) for the cluster Ray is joined to."""
    ray = import_ray()
    res = ray.cluster_resources()
    gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 0))
    if gpus and cfg.device != "cpu":
        n = cfg.ray_actors or gpus
        if n > gpus:
            log.warning("%d actors of one GPU each on a cluster of %d GPUs: %d wait for GPUs to join", n, gpus,
                        n - gpus)
        return n, {"num_gpus": 1, "num_cpus": 1}, "cuda", 0
    n = cfg.ray_actors or 1
    largest = max((int(node["Resources"].get("CPU", 0)) for node in ray.nodes() if node.get("Alive")), default=cpus)
    per = max(1, min(cpus // n, largest))
    if n * per > cpus:
        log.warning("%d actors of %d CPUs each on a cluster of %d CPUs: some wait for CPUs", n, per, cpus)
    return n, {"num_cpus": per}, "cpu", per


def start_actors(cfg: EmbedJobConfig) -> list:
    """The job's actors (not yet ready: `ray.get(a.ready.remote())` waits for a model loaded)."""
    ray = import_ray()
    n, resources, device, threads = plan(cfg)
    cls = ray.remote(EmbedWorker).options(max_restarts=RESTARTS, max_task_retries=RESTARTS, **resources)
    worker = {"device": device, "dtype": cfg.dtype, "max_batch_tokens": cfg.max_batch_tokens}
    return [cls.remote(cfg.settings(), worker, threads) for _ in range(n)]


def run(cfg: EmbedJobConfig, actors: list | None = None) -> dict:
    """Run the job on Ray; return its summary (jobs.run.run's keys, and `ray`, `actors`). Raises RayMissing /
    JobMismatch / ValueError for bad arguments, RuntimeError when a part failed. `actors`: EmbedWorker actors
    already started for `cfg`'s settings (a program running several jobs on one model), used and left running;
    None: `start_actors(cfg)` after joining Ray (`connect`), killed at the end."""
    ray = import_ray()  # first: without Ray, nothing is read or written
    settings = cfg.settings()
    inp = Input(cfg.input, cfg.input_format, cfg.rows_per_part)
    out = Output(cfg.output, job_record(cfg, inp))
    done = out.done
    total = inp.rows()
    done_rows = sum(m["input_rows"] for m in out.committed.values())
    owned = actors is None
    started = connect(cfg.ray) if owned else False
    progress = None
    pending: dict = {}  # ObjectRef -> (part, actor index)
    failure: list[BaseException] = []
    try:
        t0 = time.monotonic()
        if owned:
            actors = start_actors(cfg)
        where = ray.get([a.ready.remote() for a in actors])  # every model loaded (a constructor's error: here)
        load_s = time.monotonic() - t0
        log.info("Ray actors ready in %.1f s: %s", load_s, ", ".join(where))
        show = cfg.progress == "on" or (cfg.progress == "auto" and sys.stderr.isatty())
        progress = Progress(total, done_rows, show)
        free = [INFLIGHT_PER_ACTOR] * len(actors)

        def collect() -> None:
            """Wait for one call to finish; commit its part (or keep its error)."""
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            part, k = pending.pop(ref)
            free[k] += 1
            try:
                good, errors, tokens, seconds = ray.get(ref)
            except Exception as e:  # the Embedder's error (RayTaskError) or an actor lost past its restarts
                log.error("part %d failed: %s", part.index, e)
                failure.append(e)
                return
            progress.add(out.commit(part, good, errors, tokens, seconds))

        sent = 0
        for part in inp.parts([settings.text_column, settings.id_column]):
            if failure:
                break
            if part.index in done:
                continue
            if cfg.max_rows_per_s:  # the in-process path's throttle
                time.sleep(max(0.0, sent / cfg.max_rows_per_s - (time.monotonic() - progress.start)))
            while max(free) == 0:
                collect()
            k = free.index(max(free))  # the actor with the fewest parts queued
            pending[actors[k].embed.remote(part.table, part.first_row)] = (part, k)
            free[k] -= 1
            sent += part.table.num_rows
        while pending:
            collect()
    finally:
        if progress is not None:
            progress.close()
        if owned:
            for a in actors or ():
                ray.kill(a)
        if started:
            ray.shutdown()
    if failure:
        raise RuntimeError(f"the job stopped: {type(failure[0]).__name__}: {failure[0]} (run it again with the "
                           "same arguments to continue)")
    seconds = time.monotonic() - progress.start
    summary = {"rows": progress.rows, "written": progress.written, "errors": progress.errors,
               "tokens": progress.tokens, "seconds": round(seconds, 3),
               "rows_per_s": round(progress.rows / seconds, 1) if seconds > 0 else 0.0,
               "parts": progress.parts, "parts_resumed": len(done), "total_rows": done_rows + progress.rows,
               "load_seconds": round(load_s, 3), "output": cfg.output, "ray": cfg.ray, "actors": len(actors)}
    out.finish(summary)
    return summary


class EmbedBatches:
    """`Embedder` as a Ray Data `map_batches` class, for a pipeline of one's own (no resume, no OUTPUT layout:
    that is `trellis embed --ray`):

        ds = ray.data.read_parquet("s3://bucket/docs/")
        ds = ds.map_batches(EmbedBatches, fn_constructor_kwargs={"settings": EmbedSettings(model="BAAI/bge-m3")},
                            concurrency=4, num_gpus=1, batch_size=4096, batch_format="pyarrow")
        ds.write_parquet("s3://bucket/vectors/")

    A batch's rows in, their result rows out (the id column, tokens, dense, sparse / colbert where asked, error:
    `jobs.embed`'s docstring). The rows need their id column: a batch's row numbers are not the input's.
    `worker`: the Embedder's keywords (device, dtype, max_batch_tokens; tulip or url to call a fleet)."""

    def __init__(self, settings: EmbedSettings, **worker: Any):
        self.embedder = Embedder(settings, **worker)

    def __call__(self, batch: Any) -> pa.Table:
        table = as_table(batch)
        id_column = self.embedder.settings.id_column
        if id_column not in table.column_names:
            raise ValueError(f"EmbedBatches needs an id column {id_column!r} in the rows (their columns: "
                             f"{', '.join(table.column_names)}): a batch's row numbers are not the dataset's")
        return self.embedder(table)
