"""The batch runner: an asyncio task in every Ivy worker (with `--batch-dir`) that claims one job at
a time (its SQLite row lease, `ivy.batches.store`), validates its input, and runs its lines through
the HTTP route's own handler (`/v1/embeddings`, `/v1/rerank`, `/v1/score`: the function Front calls
with a request's body), `--batch-concurrency` lines at once, at batch priority.

Finished lines are committed every COMMIT_S (or COMMIT_LINES lines): appended to the output / error
part files and recorded in one transaction, so a worker killed mid-job leaves a prefix of whole
lines, and the worker that takes the job over (a restarted Ivy, another worker once the lease
expires) skips the recorded lines and redoes only those in flight. A cancel (this worker's route
tells it at once; another worker's is seen within STATUS_S) cancels the lines in flight, whose Tulip
requests are cancelled with them, keeps the lines already finished, and ends the job `cancelled`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import time

import orjson

from ivy.batches import validate
from ivy.batches.store import ANY, LEASE_S, LeaseLost, Store, owner_id
from ivy.errors import APIError
from ivy.front import CALL, REQUEST_ID, Call, _no_stamp
from ivy.routes.common import PRIORITY_HEADER

log = logging.getLogger("ivy.batches")

POLL_S = 1.0  # an idle runner looks for new or abandoned jobs this often (a local create wakes it at once)
COMMIT_S = 0.25  # finished lines wait at most this long to be committed
COMMIT_LINES = 64  # ... or until this many are finished
STATUS_S = 0.5  # a running job's status (a cancel from another worker) is read this often
READ_LINES = 256  # input lines read per trip off the loop
RETRY = (429, 503)  # a line answered so (every replica busy or none reachable) is tried again ...
RETRY_S = (0.5, 1, 2, 4, 8, 15, 30, 30, 60)  # ... after these waits (~2.5 min: a Tulip restart), then its error is kept


def line_json(req_id: str, custom_id: str | None, status: int | None, request_id: str, body: bytes | None,
              error: dict | None) -> bytes:
    """One line of a batch's output or error file, OpenAI's batch output format; `body` the reply's
    JSON bytes, spliced in as they are (a vector reply is not parsed and serialised again)."""
    head = b'{"id":' + orjson.dumps(req_id) + b',"custom_id":' + orjson.dumps(custom_id)
    if body is None:
        return head + b',"response":null,"error":' + orjson.dumps(error) + b"}\n"
    return (head + b',"response":{"status_code":' + str(status).encode() + b',"request_id":'
            + orjson.dumps(request_id) + b',"body":' + body + b'},"error":null}\n')


class Runner:
    """See the module docstring. `handlers`: {endpoint: the route's fast handler}."""

    def __init__(self, store: Store, handlers: dict, concurrency: int, max_lines: int, max_line: int):
        self.store, self.handlers = store, handlers
        self.concurrency, self.max_lines, self.max_line = concurrency, max_lines, max_line
        self.owner = owner_id()
        self.wake = asyncio.Event()
        self.job: str | None = None  # the batch this worker runs now
        self.cancelled = asyncio.Event()  # its cancel, as this worker learns of it
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._loop(), name="ivy-batch-runner")

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task

    def poke(self, batch_id: str | None = None) -> None:
        """A batch was created (look for work now) or cancelled (stop it now, where it runs here)."""
        self.wake.set()
        if batch_id is not None and batch_id == self.job:
            self.cancelled.set()

    async def _loop(self) -> None:
        while True:
            try:
                job = await self.store.run(self.store.claim, self.owner)
            except Exception:
                log.exception("batch runner: claiming a job failed")
                job = None
            if job is None:
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), POLL_S)
                continue
            self.job = job["id"]
            self.cancelled.clear()
            log.info("batch %s (%s, %d of %d requests done): run by worker %d", job["id"], job["status"],
                     job["completed"] + job["failed"], job["total"], os.getpid())
            try:
                await self._run(job)
            except LeaseLost:
                log.warning("batch %s: its lease was taken by another worker; this one stopped", job["id"])
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await self.store.run(self.store.release, job["id"], self.owner)  # a restart takes it at once
                raise
            except Exception:
                log.exception("batch %s failed in the runner", job["id"])
                await self._fail(job["id"], "internal_error", "the batch runner failed; see Ivy's log")
                await asyncio.sleep(POLL_S)  # were the failure the database's, not a hot loop of claims
            finally:
                self.job = None

    async def _fail(self, batch_id: str, code: str, message: str) -> None:
        errors = json.dumps({"object": "list", "data": [validate.error(code, message)]})
        try:
            status = await self.store.run(self.store.status, batch_id)
            await self.store.run(self.store.set_status, batch_id, self.owner, status, "failed", errors=errors,
                                 lease_owner=None, lease_until=None)
        except Exception:
            log.exception("batch %s: recording its failure failed", batch_id)

    async def _run(self, job: dict) -> None:
        """The claimed job, from its status on, to its end."""
        bid, st = job["id"], self.store
        renew = asyncio.get_running_loop().create_task(self._renew(bid, asyncio.current_task()))
        try:
            while True:
                status = job["status"]
                if status == "validating":
                    path = st.path(job["input_file_id"])
                    total, errors = await asyncio.to_thread(validate.check, path, job["endpoint"], self.max_lines,
                                                            self.max_line)
                    if errors:
                        errs = json.dumps({"object": "list", "data": errors})
                        job = await st.run(st.set_status, bid, self.owner, "validating", "failed", errors=errs,
                                           lease_owner=None, lease_until=None)
                        if job["status"] == "failed":
                            return
                    else:
                        job = await st.run(st.set_status, bid, self.owner, "validating", "in_progress", total=total)
                elif status == "in_progress":
                    before = job["completed"] + job["failed"]
                    ended = await self._lines(job)
                    if ended == "expiring":  # past expires_at: what is done is kept, as OpenAI keeps it
                        await st.run(st.finish, bid, self.owner, "expired")
                        return
                    row = await st.run(st.get_batch, bid, ANY)
                    if ended == "finalizing" and row["completed"] + row["failed"] < row["total"]:
                        if row["completed"] + row["failed"] == before:  # a pass that did nothing: not again
                            raise RuntimeError(f"batch {bid}: {row['total']} requests, "
                                               f"{row['completed'] + row['failed']} done, none in the last pass")
                        job = row  # lines left (not expected): another pass
                        continue
                    job = await st.run(st.set_status, bid, self.owner, "in_progress", ended)
                elif status in ("cancelling", "finalizing"):
                    end = "cancelled" if status == "cancelling" else "completed"
                    job = await st.run(st.finish, bid, self.owner, end)
                    log.info("batch %s %s: %d requests answered, %d failed", bid, job["status"], job["completed"],
                             job["failed"])
                    return
                else:
                    return
        finally:
            renew.cancel()

    async def _renew(self, bid: str, job_task: asyncio.Task) -> None:
        """The lease renewed while the job runs; the job stopped where it is lost."""
        while True:
            await asyncio.sleep(LEASE_S / 6)
            try:
                await self.store.run(self.store.renew, bid, self.owner)
            except LeaseLost:
                job_task.cancel()
                return
            except Exception:
                log.exception("batch %s: renewing its lease failed", bid)

    async def _lines(self, job: dict) -> str:
        """The job's lines not yet done, run and committed; what comes next: "finalizing" (every line
        done), "cancelling" (cancelled) or "expiring" (past its expires_at)."""
        bid, st = job["id"], self.store
        done = await st.run(st.done_lines, bid)
        handler = self.handlers[job["endpoint"]]
        slots = asyncio.Semaphore(self.concurrency)
        finished: list = []
        flights: set[asyncio.Task] = set()
        stop: list[str] = []  # the status that stopped the job early

        async def one(n: int, raw: bytes | None) -> None:
            try:
                finished.append(await self._line(handler, job["endpoint"], n, raw))
            finally:
                slots.release()

        async def commit() -> None:
            batch, finished[:] = finished[:], []
            status = await st.run(st.commit, bid, self.owner, batch) if batch else await st.run(st.status, bid)
            if status == "cancelling":
                self.cancelled.set()

        async def committer() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(COMMIT_S if len(finished) < COMMIT_LINES else 0)
                if finished or time.monotonic() - last > STATUS_S:
                    last = time.monotonic()
                    await commit()
                if self.cancelled.is_set() or time.time() > job["expires_at"]:
                    stop.append("cancelling" if self.cancelled.is_set() else "expiring")
                    for t in flights:
                        t.cancel()
                    return

        path = st.path(job["input_file_id"])
        reading = validate.lines(path, self.max_line)
        commits = asyncio.get_running_loop().create_task(committer())
        try:
            while not commits.done():
                block = await asyncio.to_thread(lambda: list(itertools.islice(reading, READ_LINES)))
                if not block:
                    break
                for n, raw in block:
                    if n in done:
                        continue
                    await slots.acquire()
                    if commits.done():
                        slots.release()
                        break
                    t = asyncio.get_running_loop().create_task(one(n, raw))
                    flights.add(t)
                    t.add_done_callback(flights.discard)
            while flights and not commits.done():
                await asyncio.wait(set(flights) | {commits}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            commits.cancel()
            for t in flights:
                t.cancel()
            await asyncio.gather(*flights, commits, return_exceptions=True)
            reading.close()
            await commit()  # what finished before the end, a cancel or a shutdown is kept
        if not commits.cancelled() and commits.exception() is not None:
            raise commits.exception()  # a commit failed (its lines are not recorded: they run again)
        return stop[0] if stop else "finalizing"

    async def _line(self, handler, endpoint: str, n: int, raw: bytes | None):
        """One line run: (line number, output line or None, error line or None, tokens)."""
        req_id = f"batch_req_{os.urandom(12).hex()}"
        cid, body, err = validate.line_request(raw, endpoint, self.max_line)
        if err is not None:
            return n, None, line_json(req_id, cid, None, "", None, err), 0
        # Batch priority whatever the line asks: the body's field wins over the header in the route
        # (ivy.routes.common.request_priority), so it is set too. Both contextvars are this task's own, as
        # an HTTP request's are its task's: the request id Tulip sees, the call the metrics label.
        body["priority"] = "batch"
        body = orjson.dumps(body)
        rid = os.urandom(16).hex()
        REQUEST_ID.set(rid)
        CALL.set(Call(((PRIORITY_HEADER, b"batch"),)))
        for wait in (*RETRY_S, None):
            try:
                reply = await handler(body, _no_stamp)
            except APIError as e:
                if e.status in RETRY and wait is not None:
                    await asyncio.sleep(wait)
                    continue
                return n, None, line_json(req_id, cid, e.status, rid, e.body(), None), 0
            except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
                raise
            except Exception:
                log.exception("batch line %d: the route failed", n)
                e = APIError(500, "internal error running this request; see Ivy's log", None, "internal_error")
                return n, None, line_json(req_id, cid, 500, rid, e.body(), None), 0
            usage = orjson.loads(reply).get("usage") or {}
            return n, line_json(req_id, cid, 200, rid, reply, None), None, int(usage.get("total_tokens", 0))
