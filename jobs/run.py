"""`trellis embed INPUT OUTPUT --model MODEL` (`python -m jobs`): the input's parts through one `Embedder` per
worker (a device, a Tulip, or an Ivy; with --ray, a Ray actor holding one: jobs.ray), each part committed to
OUTPUT as it completes; a restart with the same arguments skips the committed parts. Progress on stderr (a tqdm
bar where stderr is a terminal), one summary line at the end, and with --json one JSON object on stdout. Exit
status: 0 done, 1 a worker failed, 2 bad arguments or an OUTPUT holding another job."""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import time

from jobs.config import EmbedJobConfig
from jobs.dataset import Input, JobMismatch, Output
from jobs.embed import Embedder, Pending, split_errors

log = logging.getLogger("jobs")


def workers(cfg: EmbedJobConfig) -> list[dict]:
    """The Embedder keyword arguments of each worker: one per device, per Tulip, or one for an Ivy."""
    if cfg.tulip:
        return [{"tulip": t} for t in cfg.tulip]
    if cfg.url:
        return [{"url": cfg.url, "api_key": cfg.api_key, "served_model": cfg.served_model}]
    return [{"device": d, "dtype": cfg.dtype, "max_batch_tokens": cfg.max_batch_tokens}
            for d in (cfg.devices or (cfg.device,))]


class Progress:
    """Counts under a lock, and the bar (tqdm on stderr) where it is shown."""

    def __init__(self, total: int, done: int, show: bool):
        self.lock = threading.Lock()
        self.rows = self.written = self.errors = self.tokens = self.parts = 0
        self.start = time.monotonic()
        self.bar = None
        if show:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, unit="rows", file=sys.stderr, dynamic_ncols=True,
                            smoothing=0.1, desc="trellis embed")

    def add(self, marker: dict) -> None:
        with self.lock:
            self.parts += 1
            self.rows += marker["input_rows"]
            self.written += marker["rows"]
            self.errors += len(marker["errors"])
            self.tokens += marker["tokens"]
            if self.bar is not None:
                self.bar.update(marker["input_rows"])
                self.bar.set_postfix(tokens=f"{self.tokens:,}", errors=self.errors, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(cfg: EmbedJobConfig, embedders: list[Embedder] | None = None) -> dict:
    """Run the job; return its summary. Raises JobMismatch / ValueError for bad arguments, RuntimeError when a
    worker fails. `embedders`: workers already built for `cfg`'s settings (a program running several jobs on
    one model), used as they are and left open; None: one per `workers(cfg)`, closed at the end."""
    if cfg.ray and embedders is None:  # Ray actors, one Embedder each, called by this loop's threads (jobs.ray)
        from jobs.ray import RayWorkers

        with RayWorkers(cfg) as ray_workers:
            return run(cfg, ray_workers.embedders)
    settings = cfg.settings()
    inp = Input(cfg.input, cfg.input_format, cfg.rows_per_part)
    # what the output depends on (not where it runs: a job begun on a CPU may go on on a GPU or a fleet)
    job = json.loads(json.dumps({**settings.to_json(), "input": cfg.input, "files": inp.fingerprint(),
                                 "rows_per_part": cfg.rows_per_part}))
    out = Output(cfg.output, job)
    done = out.done
    total = inp.rows()
    done_rows = sum(m["input_rows"] for m in out.committed.values())
    specs = workers(cfg)
    t0 = time.monotonic()
    owned = embedders is None
    if not owned and any(e.settings != settings for e in embedders):
        raise ValueError("the embedders given were built for other settings")
    embedders = [None] * len(specs) if owned else list(embedders)
    failure: list[BaseException] = []

    def build(k: int) -> None:
        try:
            embedders[k] = Embedder(settings, **specs[k])
        except BaseException as e:
            failure.append(e)

    threads = [threading.Thread(target=build, args=(k,)) for k in range(len(specs)) if owned]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failure:
        for e in embedders:
            if e is not None:
                e.close()
        raise failure[0]
    load_s = time.monotonic() - t0
    clocks = [c for c in (getattr(getattr(e, "backend", None), "clock", None) for e in embedders) if c is not None]
    busy0 = [c.busy_s() for c in clocks]
    show = cfg.progress == "on" or (cfg.progress == "auto" and sys.stderr.isatty())
    progress = Progress(total, done_rows, show)
    parts: queue.Queue = queue.Queue(maxsize=2 * len(specs))

    def work(embedder: Embedder) -> None:
        """One worker: each part read, tokenized and sent (Embedder.submit) here while the part before it
        steps, and its table built and committed by `commit` on a thread of its own, so the engine has the
        next part's rows queued before it finishes a part (a part's end does not drain the steps)."""
        sent: queue.Queue = queue.Queue(maxsize=1)  # a part waiting for `commit` (the one being committed aside)
        committer = threading.Thread(target=commit, args=(sent,), daemon=True)
        committer.start()
        submit = getattr(embedder, "submit", None)  # (a Ray actor's stand-in has none: a part is done when called)
        try:
            while (part := parts.get()) is not None:
                if failure:
                    continue
                try:
                    t = time.monotonic()
                    pending = submit(part.table, part.first_row) if submit else Pending(
                        table=embedder(part.table, part.first_row))
                    sent.put((part, pending, t))
                except BaseException as e:
                    log.exception("part %d failed", part.index)
                    failure.append(e)
        finally:
            sent.put(None)
            committer.join()

    def commit(sent: queue.Queue) -> None:
        while (item := sent.get()) is not None:
            part, pending, t = item
            if failure:
                continue
            try:
                good, errors = split_errors(pending.result())
                tokens = sum(x for x in good.column("tokens").to_pylist() if x is not None)
                progress.add(out.commit(part, good, errors, tokens, time.monotonic() - t))
            except BaseException as e:
                log.exception("part %d failed", part.index)
                failure.append(e)

    threads = [threading.Thread(target=work, args=(e,), daemon=True) for e in embedders]
    for t in threads:
        t.start()
    sent = 0
    try:
        columns = [settings.text_column, settings.id_column]
        for part in inp.parts(columns):
            if failure:
                break
            if part.index in done:
                continue
            if cfg.max_rows_per_s:  # throttle: a part goes out once the rows before it are within the rate
                time.sleep(max(0.0, sent / cfg.max_rows_per_s - (time.monotonic() - progress.start)))
            while not failure:
                try:
                    parts.put(part, timeout=0.5)
                    break
                except queue.Full:
                    continue
            sent += part.table.num_rows
    finally:
        for _ in threads:
            parts.put(None)
        for t in threads:
            t.join()
        progress.close()
        for e in embedders if owned else ():
            e.close()
    if failure:
        raise RuntimeError(f"the job stopped: {type(failure[0]).__name__}: {failure[0]} (run it again with the "
                           "same arguments to continue)")
    seconds = time.monotonic() - progress.start
    busy = [c.busy_s() - b for c, b in zip(clocks, busy0)]
    summary = {"rows": progress.rows, "written": progress.written, "errors": progress.errors,
               "tokens": progress.tokens, "seconds": round(seconds, 3),
               "rows_per_s": round(progress.rows / seconds, 1) if seconds > 0 else 0.0,
               "parts": progress.parts, "parts_resumed": len(done), "total_rows": done_rows + progress.rows,
               "load_seconds": round(load_s, 3), "output": cfg.output}
    if clocks:  # in-process: the share of the wall time with no step in flight (the mean over the engines)
        summary["step_busy_seconds"] = round(sum(busy) / len(busy), 3)
        summary["host_idle_share"] = round(1 - sum(busy) / len(busy) / seconds, 4) if seconds > 0 else 0.0
    out.finish(summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    cfg = EmbedJobConfig.from_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        summary = run(cfg)
    except (JobMismatch, ValueError, FileNotFoundError) as e:
        print(f"trellis embed: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"trellis embed: error: {e}", file=sys.stderr)
        return 1
    print(f"trellis embed: {summary['rows']:,} rows ({summary['errors']:,} errors, {summary['tokens']:,} tokens) in "
          f"{summary['seconds']:.1f} s, {summary['rows_per_s']:,.1f} rows/s; {summary['total_rows']:,} rows in "
          f"{cfg.output}", file=sys.stderr)
    if cfg.json:
        print(json.dumps(summary))
    return 0
