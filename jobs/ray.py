"""`trellis embed INPUT OUTPUT --ray [ADDRESS]`: the job's parts embedded by Ray actors, each holding one
`Embedder` (the in-process path's unit of work: built once per actor, called once per part). Ray is an optional
extra: `pip install 'trellis[ray]'`.

What Ray is given, and why: `jobs.run.run` itself runs the job. Its worker threads call `ActorEmbedder`s (an
actor seen as an Embedder) instead of Embedders, so the driver (this process) reads the input with
`jobs.dataset.Input` (the same parts, cut the same way), skips the committed parts, sends each other part to one
actor as one call, and commits what comes back through `jobs.dataset.Output`, throttle, progress, summary and
errors included: one code path. Two threads call each actor (`INFLIGHT_PER_ACTOR`), so its next part is shipped
while it embeds this one. The part files, `_done/` markers, `_job.json` and `_errors.jsonl` are the in-process
path's, a job begun one way goes on the other, and resume stays exact: the unit Ray computes is the unit that
is committed. Ray Data's read_* + map_batches is not what the CLI runs: its blocks are not the job's parts (a
datasource cuts and coalesces rows by block size, and the core's JSONL reader turns a bad line into an error row,
which `read_json` cannot), so a restart could not tell which input rows are done; and a driver-side commit keeps
OUTPUT one local directory written by one process, whatever node computed a part. For a Ray Data pipeline of
one's own (read, filter, embed, write anywhere; no resume), `EmbedBatches` is the same Embedder as a
`map_batches` class.

ADDRESS: "local" (`--ray` alone: a Ray instance started on this host for the job and stopped after it), "auto"
(the cluster this host is a node of), "ray://HOST:PORT" (Ray Client) or "HOST:PORT" (a cluster's GCS). Actors
(`--ray-actors`, 0: one per GPU of the cluster, or one on a cluster without GPUs): one GPU each where the cluster
has GPUs and --device is not cpu, else an equal share of its CPUs (`--ray-cpus`: an actor's CPUs). An actor
lost with its process or node is restarted and its queued parts sent again (`max_restarts`, `max_task_retries`);
the driver commits each part once. The cluster's nodes need the same trellis installed (`pip install
'trellis[ray]'`, e.g. in their image) and reach the model as this host does (a Hub id is downloaded into each
node's cache once). The driver holds OUTPUT: with ray://, that is the client's disk. The actors' start (model
loads included) is logged, and is not in the summary's `load_seconds`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import pyarrow as pa

from jobs.config import EmbedJobConfig, EmbedSettings
from jobs.embed import Embedder, as_table

log = logging.getLogger("jobs.ray")

INFLIGHT_PER_ACTOR = 2  # worker threads per actor: one part running, the next shipped and queued behind it
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
    """One actor's state: one Embedder, built when the actor starts; `embed` is one part. A constructor's error
    is kept and raised by `ready` (an actor whose constructor raised answers every call with ActorDiedError,
    which would hide a bad setting's ValueError, exit 2 in-process)."""

    def __init__(self, settings: EmbedSettings, worker: dict, threads: int):
        self.embedder, self.error = None, None
        try:
            if threads:  # Ray sets OMP_NUM_THREADS to the actor's CPUs; torch may have read it before: say it again
                import torch

                torch.set_num_threads(threads)
            self.embedder = Embedder(settings, **worker)
        except Exception as e:  # noqa: BLE001 (raised again by ready(), the driver's first call)
            self.error = e

    def ready(self) -> str:
        if self.error is not None:
            raise self.error
        return f"{os.uname().nodename}:{os.getpid()}"

    def embed(self, table: pa.Table, first_row: int) -> pa.Table:
        return self.embedder(table, first_row)


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
        return n, {"num_gpus": 1, "num_cpus": cfg.ray_cpus or 1}, "cuda", 0
    n = cfg.ray_actors or 1
    largest = max((int(node["Resources"].get("CPU", 0)) for node in ray.nodes() if node.get("Alive")), default=cpus)
    per = cfg.ray_cpus or max(1, min(cpus // n, largest))
    if n * per > cpus:
        log.warning("%d actors of %g CPUs each on a cluster of %d CPUs: some wait for CPUs", n, per, cpus)
    return n, {"num_cpus": per}, "cpu", max(1, round(per))


def wait_ready(actors: list) -> list[str]:
    """Wait for every actor's model (a constructor's error is raised here), saying every 30 s how many Ray has
    not placed or loaded yet (an actor waits, silently in Ray, for the CPUs or GPU it asks for)."""
    ray = import_ray()
    refs = [a.ready.remote() for a in actors]
    t0 = time.monotonic()
    while True:
        ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=30)
        if not waiting:
            try:
                return ray.get(refs)
            except ray.exceptions.RayTaskError as e:  # a setting the model cannot honour: the in-process message
                if isinstance(e.cause, ValueError):
                    raise ValueError(str(e.cause)) from None
                raise
        log.warning("%d of %d Ray actors not ready after %.0f s (waiting for resources, or loading the model); "
                    "the cluster has %s free", len(waiting), len(refs), time.monotonic() - t0,
                    ray.available_resources())


def start_actors(cfg: EmbedJobConfig) -> list:
    """The job's actors (not yet ready: `ray.get(a.ready.remote())` waits for a model loaded)."""
    ray = import_ray()
    n, resources, device, threads = plan(cfg)
    cls = ray.remote(EmbedWorker).options(max_restarts=RESTARTS, max_task_retries=RESTARTS, **resources)
    worker = {"device": device, "dtype": cfg.dtype, "max_batch_tokens": cfg.max_batch_tokens}
    return [cls.remote(cfg.settings(), worker, threads) for _ in range(n)]


class ActorEmbedder:
    """An EmbedWorker actor seen as an Embedder by jobs.run's worker threads: `embedder(table, first_row)` is one
    call of the actor (the thread waits for it); `close` leaves the actor to whoever started it."""

    def __init__(self, actor, settings: EmbedSettings):
        self.actor, self.settings = actor, settings

    def __call__(self, table: pa.Table, first_row: int = 0) -> pa.Table:
        return import_ray().get(self.actor.embed.remote(table, first_row))

    def close(self) -> None:
        pass


def embedders(actors: list, settings: EmbedSettings) -> list[ActorEmbedder]:
    """jobs.run.run's workers for these actors: INFLIGHT_PER_ACTOR each (one part running, the next queued)."""
    return [ActorEmbedder(a, settings) for _ in range(INFLIGHT_PER_ACTOR) for a in actors]


class RayWorkers:
    """`with RayWorkers(cfg) as w: jobs.run.run(cfg, w.embedders)`: Ray joined or started (`connect`), the job's
    actors started and their models loaded; on leaving, the actors killed and a Ray this began stopped."""

    def __init__(self, cfg: EmbedJobConfig):
        self.cfg, self.actors, self.started = cfg, [], False
        self.embedders: list[ActorEmbedder] = []

    def __enter__(self) -> "RayWorkers":
        self.started = connect(self.cfg.ray)
        try:
            t0 = time.monotonic()
            self.actors = start_actors(self.cfg)
            where = wait_ready(self.actors)
        except BaseException:
            self.__exit__()
            raise
        print(f"trellis embed: Ray ({self.cfg.ray}): {len(where)} actors ready in {time.monotonic() - t0:.1f} s "
              f"({', '.join(where)})", file=sys.stderr)
        self.embedders = embedders(self.actors, self.cfg.settings())
        return self

    def __exit__(self, *exc) -> None:
        ray = import_ray()
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if self.started:
            ray.shutdown()
            self.started = False


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
