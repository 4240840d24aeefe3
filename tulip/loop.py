"""Tulip's engine loop: batches from the `Scheduler` (online work first, FCFS within a priority class),
launched on the engine while up to `max_inflight - 1` earlier steps still run (batch-only steps one at a
time while online work is live), each step's rows scattered to its requests' callbacks.

`EngineLoop` owns the scheduler and the engine; the gRPC servicer (`tulip.server`) only validates,
submits and replies. `warm_up` runs the --warmup shapes before serving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from time import perf_counter_ns
from typing import Callable, Sequence

import numpy as np

from rose.engine import Engine
from rose.extras import Extra, colbert_vectors, lexical_weights, vocab_weights
from trellis.spin import Spinner
from tulip.config import TulipConfig
from tulip.metrics import TulipMetrics
from tulip.scheduler import ONLINE, Entry, Scheduler
from tulip.stages import BATCH, COPY, DELIVER, LAUNCH, SCHEDULE, WAIT, StageRecorder
from tulip.steps import CPU_PIECE_TOKENS, batch_of, pixels_of, run_images, run_pieces, run_step, StepThread

log = logging.getLogger("tulip")

# How long after an online request arrives online work counts as live. While it is, batch-only steps go one
# at a time (an online arrival waits for at most one batch step, not `max_inflight` of them) and take at most
# `online_batch_step_tokens`; the job pays the host's gap between its steps only then. Online traffic at a rate
# r gets this for the p99 of its requests where 99% of them come within the window of the one before:
# exp(-r * ONLINE_LIVE_S) <= 0.01, r >= 4.6 a second; a job with no online work beside it keeps `max_inflight`.
ONLINE_LIVE_S = 1.0


_NO_EXTRAS = frozenset()


class Request(Entry):
    """One caller's sequences, packed: `ids[offsets[i]:offsets[i] + lengths[i]]` is sequence i
    (`lengths`: plain ints; one sequence, the online case, needs no offsets and no row list).

    `pool_from[i]` (optional) is how many leading tokens of sequence i mean pooling leaves out;
    `segments[i]` (optional, cross-encoders) where its second segment starts (0: none).
    As batches complete the loop collects one output row per sequence (and the token-level
    outputs named in `extras` in `sparse` / `colbert`); `pending` counts sequences still
    missing. `on_done(request, rows, error)` is called once, by the engine loop, when it
    completes or fails. `deadline` (monotonic, 0: none) drops its still-queued sequences.
    `trace`: its tulip.tracing.RequestTrace where tracing is on (None: not traced).
    `priority`: its scheduling class (tulip.scheduler ONLINE, the default, or BATCH: the EmbedRequest's).
    `pixels`: an image request's pictures (uint8 [n, S, S, 3], the engine's `image_size` S), whose `lengths` are
    each image's token cost (`Engine.image_tokens`) and `ids` None; None for text.
    """

    __slots__ = ("ids", "extras", "on_done", "pool_from", "segments", "offsets", "rows", "sparse", "colbert", "pending",
                 "queued_at", "deadline", "timer", "future", "stamps", "tag", "trace", "pixels")

    def __init__(self, ids: np.ndarray, lengths: Sequence[int], extras: frozenset = _NO_EXTRAS,
                 on_done: Callable[["Request", "np.ndarray | None", "Exception | None"], None] | None = None,
                 pool_from: Sequence[int] | None = None, segments: Sequence[int] | None = None,
                 priority: int = ONLINE, pixels: np.ndarray | None = None):
        super().__init__(lengths, priority)
        self.pixels = pixels
        n = len(self.lengths)
        self.ids, self.extras, self.on_done, self.pool_from, self.segments = ids, extras, on_done, pool_from, segments
        self.pending = n
        if n == 1:
            self.offsets = self.rows = None
        else:
            self.offsets = (0, *itertools.accumulate(self.lengths[:-1]))
            self.rows = [None] * n
        if extras:  # (an Extra's hash is a Python call: none for the usual request)
            self.sparse = [None] * n if Extra.SPARSE in extras else None
            self.colbert = [None] * n if Extra.COLBERT in extras else None
        else:
            self.sparse = self.colbert = None
        self.queued_at = self.deadline = 0.0  # monotonic: when it was queued; after which it is dropped (0: never)
        # the deadline's handle; submit()'s future; tulip.stages stamps; the owner's own (the gRPC message); tracing
        self.timer = self.future = self.stamps = self.tag = self.trace = None

    def seq(self, i: int) -> np.ndarray:
        if self.offsets is None:
            return self.ids
        o = self.offsets[i]
        return self.ids[o:o + self.lengths[i]]


def _resolve(req: Request, rows, error) -> None:
    """`submit()`'s completion callback: its future gets the rows or the error."""
    fut = req.future
    if not fut.done():
        fut.set_exception(error) if error is not None else fut.set_result(rows)


def _deliver(req: Request, rows, error) -> None:
    """Call a request's completion callback; its failure is its own, never the engine loop's."""
    if req.timer is not None:
        req.timer.cancel()
        req.timer = None
    if req.stamps is not None:
        req.stamps[DELIVER] = perf_counter_ns()
    # Dropped once called: the callback is the caller's session, which holds the request, and a
    # cycle left behind is garbage for the collector (a collection is ~0.1-0.4 ms on the loop).
    on_done, req.on_done = req.on_done, None
    try:
        on_done(req, rows, error)
    except Exception:
        log.exception("completion callback failed for a request of %d sequences", len(req.lengths))
    if req.trace is not None:
        req.trace.end(error)


def _stamp(slots, point: int) -> None:
    """Stamp `point` (a tulip.stages constant) now on each stamping request of `slots`."""
    t = perf_counter_ns()
    for r, _ in slots:
        if r.stamps is not None:
            r.stamps[point] = t


def _ready(step) -> bool:
    try:
        return step.lazy.ready()
    except Exception:  # e.g. a sticky CUDA error: synchronize() raises it again in _complete
        return True


class _Step:
    __slots__ = ("slots", "lazy", "launched", "watched_from", "tokens", "batch_only", "waited", "urgent")

    def __init__(self, slots: list, lazy, launched: float, tokens: int):
        self.slots, self.lazy, self.launched, self.tokens = slots, lazy, launched, tokens  # lazy: LazyTensor / StepThread
        self.watched_from = 0.0
        self.waited = False  # a _wait task owns it
        self.batch_only = slots[0][0].priority != ONLINE  # online slots come first
        self.urgent = False  # an online text step sent to the engine's online lane (`Engine.lane`)


class EngineLoop:
    """Owns the scheduler and the engine; answers each request through its `on_done` callback.

    No task sits between a request and the GPU: `submit_nowait` queues the request and,
    when a step slot is free (at most `max_inflight` in flight on a GPU, one on CPU), launches the next FCFS
    batch at once (on CUDA `engine.step` only queues work). While a step runs, another is
    launched only once a quarter of a batch's token budget is waiting; fewer requests wait
    for the running step and go together in the next. While online work is live (`ONLINE_LIVE_S`)
    at most one batch-only step is in flight: a step is not cut short once launched, so an online
    request that arrives waits for the batch steps ahead of it on the device. The oldest step is watched by
    polling its event from the event loop for up to `spin_ms` (a wake-up costs a few
    microseconds, not a thread hand-off), then by a waiter thread; after a step completes the
    loop keeps polling for `spin_ms` more (`Spinner`), so the next request is read at once.
    When a step completes, the next batch is launched, then its rows are scattered and
    finished requests answered, so batch N+1 runs while batch N's results are sent.
    """

    def __init__(self, engine: Engine, cfg: TulipConfig, metrics: TulipMetrics | None = None):
        if cfg.max_batch_tokens < 1:
            raise ValueError("EngineLoop needs max_batch_tokens >= 1 (serve() resolves 0 from the model)")
        self.engine = engine
        self.cfg = cfg
        self.metrics = metrics or TulipMetrics()
        self.scheduler = Scheduler(cfg.max_batch_tokens, batch_step_tokens=cfg.batch_step_tokens,
                                   online_batch_step_tokens=cfg.online_batch_step_tokens)
        # a model with an image tower (CLIP, SigLIP): image requests queue apart, since a step is text or
        # images; their sequences are images, budgeted at the tower's tokens each (Engine.image_tokens)
        # (a step of at most the largest image graph's images: bigger ones would run eagerly)
        self.images = Scheduler(min(cfg.max_batch_tokens, engine.image_batch * engine.image_tokens or
                                    cfg.max_batch_tokens)) if engine.image_size else None
        self._image_turn = False  # both kinds waiting: text and image steps take turns
        self.metrics.queue_tokens.set_function(self._queued_tokens)
        self.metrics.queue_requests.set_function(
            lambda: len(self.scheduler) + (len(self.images) if self.images is not None else 0))
        self.metrics.by_class(self.scheduler)
        self._inflight: deque[_Step] = deque()
        # the engine runs online steps on a stream of their own beside the rest (`Engine.lane`): steps in flight
        # can complete out of launch order
        self._lane = getattr(engine, "lane", None) is not None
        self._online_until = 0.0  # monotonic: online work is live until then (ONLINE_LIVE_S after an arrival)
        # On CPU the forward runs in the step; keep it off the event loop.
        self._executor = ThreadPoolExecutor(1, "tulip-step") if engine.device.type == "cpu" else None
        self._spin_s = cfg.spin_ms / 1e3 if self._executor is None else 0.0
        # On CPU one step at a time: the step thread runs steps one after another, so a second step
        # launched would only wait in its queue, formed and past cancelling (ten disconnected clients'
        # 8,192-token chunks once held a probe 15 s behind two such steps, the second all cancelled
        # work). Formed when the running step completes, it leaves out whatever was cancelled meanwhile.
        self._max_inflight = cfg.max_inflight if self._executor is None else 1
        # A step launched while another runs pays a step's fixed cost (~0.9 ms for BGE-M3 on an
        # H200) for whatever is queued; for a few requests that costs more than waiting for the
        # running step and joining the next, larger one.
        self._overlap_tokens = cfg.max_batch_tokens // 4
        self._special = np.asarray(engine.spec.special_token_ids, dtype=np.int32)
        self._sparse_rows = engine.sparse_rows  # SPLADE: the sparse output is a row's nonzero entries
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._polling = False  # a _watch callback is due
        self._pump_soon = False  # a _pump is due on the next turn (resume)
        # After a step completes the loop stays awake for spin_ms, so the next request (and the
        # replies being written) are picked up without an epoll wake-up.
        self._idle = Spinner(self._spin_s)
        # --stage-samples: per-request stage timestamps (tulip.stages); None: off
        self.stages = StageRecorder(cfg.stage_samples) if cfg.stage_samples else None
        # --otlp-endpoint: each step tells its traced requests (Request.trace) when it ran (tulip.tracing)
        self.tracing = None

    def start(self) -> None:
        self._aloop = asyncio.get_running_loop()

    async def stop(self, timeout: float = 10.0) -> None:
        """Wait (up to `timeout` s) for the steps in flight, fail what is left, release the step thread."""
        deadline = time.monotonic() + timeout
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        if self._inflight:
            log.warning("tulip: %d steps still running after %.1f s; failing their requests",
                        len(self._inflight), timeout)
            while self._inflight:
                self._fail(self._inflight.popleft().slots, RuntimeError("the server is stopping"))
        if self._executor:
            self._executor.shutdown(wait=False)

    def _queued_tokens(self) -> int:
        return self.scheduler.queued_tokens + (self.images.queued_tokens if self.images is not None else 0)

    def _queue_of(self, req: Request) -> Scheduler:
        return self.scheduler if req.pixels is None else self.images

    def cancel(self, req: Request) -> None:
        """The caller is gone: drop what is still queued of `req`; its computed rows are discarded."""
        self._queue_of(req).drop(req)
        req.cancelled = True
        if req.timer is not None:
            req.timer.cancel()
        if req.trace is not None:
            req.trace.end("CANCELLED")

    def hold(self, reqs) -> None:
        """Their callers are not taking replies (tulip.servicer): what is still queued of these requests
        waits, not batched, until `resume` (still counted against the queue's bound); `cancel` drops it."""
        for req in reqs:
            self._queue_of(req).hold(req)

    def resume(self, reqs) -> None:
        """Batch these held requests again, each where it was in its queue."""
        reqs = list(reqs)  # (one call per queue: those that reached the front go back in their order)
        self.scheduler.resume([r for r in reqs if r.pixels is None])
        if self.images is not None:
            self.images.resume([r for r in reqs if r.pixels is not None])
        if not self._pump_soon:  # on the next turn: a connection resumes all its sessions' requests first
            self._pump_soon = True
            self._aloop.call_soon(self._pumped)

    def _pumped(self) -> None:
        self._pump_soon = False
        self._pump()

    def submit_nowait(self, req: Request, held: bool = False) -> None:
        """Queue `req` (its `on_done` is called when it completes or fails); raise OverflowError
        when the queue is full (held requests count). Launches a step at once if a slot is free
        (`held`: queued held, see `hold`)."""
        queued = self.scheduler.queued_tokens + self.scheduler.held_tokens
        if self.images is not None:
            queued += self.images.queued_tokens + self.images.held_tokens
        if queued + req.num_tokens > self.cfg.max_queued_tokens:
            error = OverflowError(f"queue full: {queued} tokens waiting, this request adds "
                                  f"{req.num_tokens}, limit {self.cfg.max_queued_tokens}")
            if req.trace is not None:
                req.trace.end(error)
            raise error
        req.queued_at = time.monotonic()
        if req.priority == ONLINE:
            self._online_until = req.queued_at + ONLINE_LIVE_S
        queue = self.scheduler if req.pixels is None else self.images
        queue.add(req)
        if held:
            queue.hold(req)
        if req.stamps is not None:
            req.stamps[SCHEDULE] = perf_counter_ns()
        if req.deadline:
            req.timer = self._aloop.call_later(max(0.0, req.deadline - req.queued_at), self._expire, req)
        self._pump()

    def _expire(self, req: Request) -> None:
        """A deadline passed: a request still (partly) queued is answered now; one fully running completes."""
        if not req.cancelled and self._queue_of(req).drop(req):
            _deliver(req, None, TimeoutError("deadline passed while the request was queued"))

    async def submit(self, req: Request) -> np.ndarray:
        """Queue `req` and wait for its [n, dim] float32 rows; cancelling the caller drops the request."""
        req.future = fut = self._aloop.create_future()
        req.on_done = _resolve
        self.submit_nowait(req)
        try:
            return await fut
        except asyncio.CancelledError:
            self.cancel(req)
            raise

    def _record(self, step: _Step, done: float) -> None:
        """A step's metrics, on a loop iteration after its replies were handed on (off their path)."""
        m = self.metrics
        m.batch_tokens.observe(step.tokens)
        m.batch_seqs.observe(len(step.slots))
        by_class = m.class_queue_seconds
        for r, i in step.slots:
            if i == 0:
                waited = step.launched - r.queued_at
                m.queue_seconds.observe(waited)
                by_class[r.priority].observe(waited)
        m.step_seconds.observe(done - step.launched)

    def _urgent(self) -> int:
        """Online-lane steps in flight (the rest are on the main stream: batch-only, image and CPU steps)."""
        return sum(1 for s in self._inflight if s.urgent) if self._lane else 0

    def _pump(self) -> None:
        """Launch FCFS batches while a step slot is free (a model with an image tower: a step is text or
        images, and while both wait they take turns)."""
        sched, images = self.scheduler, self.images
        live = bool(self._online_until) and time.monotonic() < self._online_until  # (a job alone reads no clock)
        while True:
            if (images is not None and len(images) and (self._image_turn or not len(sched))
                    and (not self._inflight or images.queued_tokens >= self._overlap_tokens)
                    and len(self._inflight) - self._urgent() < self._max_inflight):  # (else the lane's online text)
                picked = images
            elif len(sched) and (not self._inflight or sched.queued_tokens >= self._overlap_tokens
                                 # the lane: online work with no online step in flight runs beside the rest
                                 or (self._lane and sched.online_live and not self._urgent())):
                picked = sched
            else:
                break
            if self._lane and picked is sched:  # (image steps run on the main stream)
                # The online lane: online steps and batch-only steps have `max_inflight` in flight each, since
                # an online step runs beside the batch steps, not behind them; it takes no batch work (batch
                # work has steps of its own, so it is not starved), and the job keeps its steps in flight.
                urgent = self._urgent()
                online = picked.online_live > 0 and urgent < self._max_inflight
                if not online and not (picked.batch_live and len(self._inflight) - urgent < self._max_inflight):
                    break
                slots = picked.next_batch(live, fill=False) if online else picked.next_batch(live, batch_only=True)
            else:
                if len(self._inflight) >= self._max_inflight:
                    break
                if live and not picked.online_live and any(s.batch_only for s in self._inflight):
                    break  # online work is live: one batch-only step in flight at a time
                slots = picked.next_batch(live)
            if not slots:
                break
            launched = time.monotonic()
            try:
                if picked is sched:
                    batch, extras = batch_of(slots)
                    tokens = batch.num_tokens
                    if self.stages is not None:
                        _stamp(slots, BATCH)
                    if self._executor is None:  # a step with online work: the engine's online lane where it has one
                        lazy = self.engine.step(batch, extras, urgent=slots[0][0].priority == ONLINE)
                    elif tokens > CPU_PIECE_TOKENS and len(slots) > 1 and not extras:
                        lazy = StepThread(self._executor.submit(run_pieces, self.engine, slots))
                    else:
                        lazy = StepThread(self._executor.submit(run_step, self.engine, batch, extras))
                    self._image_turn = True
                else:
                    pixels = pixels_of(slots)
                    tokens = sum(r.lengths[i] for r, i in slots)
                    if self.stages is not None:
                        _stamp(slots, BATCH)
                    lazy = self.engine.step_images(pixels) if self._executor is None else \
                        StepThread(self._executor.submit(run_images, self.engine, pixels))
                    self._image_turn = False
                if self.stages is not None:
                    _stamp(slots, LAUNCH)
            except Exception as e:  # an engine failure fails this batch only
                log.exception("engine step failed for %d sequences", len(slots))
                self._fail(slots, e)
                continue
            self._inflight.append(step := _Step(slots, lazy, launched, tokens))
            step.urgent = self._lane and picked is sched and not step.batch_only
            if self.tracing is not None:
                self.tracing.launched(step)
        if self._inflight and not self._polling and self._unwaited():
            self._polling = True
            self._aloop.call_soon(self._watch)

    def _unwaited(self) -> bool:
        """Whether a step `_watch` polls has no waiter task yet (else a poll would find nothing to do: one
        callback per `_pump`, i.e. per request, while a waiter thread has the oldest step)."""
        if not self._lane:
            return not self._inflight[0].waited
        return any(not s.waited for s in self._inflight)

    def _watch(self) -> None:
        """Complete a watched step that is done, else poll again on the next loop iteration, handing a step to a
        waiter task (a thread's wait) once it has been watched for `spin_ms`. One stream: the oldest step is
        watched (the rest finish after it), its spin budget counted from when it became the oldest. With an
        online lane (`Engine.lane`) every step in flight is: an online step runs beside the bulk step ahead of
        it and can finish first."""
        self._polling = False
        if not self._inflight:  # stop() gave up on the steps
            return
        now = time.monotonic()
        spinning = False
        for step in (self._inflight if self._lane else (self._inflight[0],)):
            if step.waited:
                continue
            if step.watched_from == 0.0:
                step.watched_from = now
            if _ready(step):
                self._complete(step)
                return
            if now - step.watched_from < self._spin_s:
                spinning = True
            else:
                step.waited = True
                self._aloop.create_task(self._wait(step))
        if spinning:
            self._polling = True
            self._aloop.call_soon(self._watch)

    async def _wait(self, step: _Step) -> None:
        try:
            await step.lazy
        except Exception:
            pass  # raised again, and reported, by _complete
        self._complete(step)

    def _complete(self, step: _Step) -> None:
        self._idle.kick()
        if step not in self._inflight:
            return  # stop() already failed it
        if self._lane and self._inflight[0] is not step:
            # Steps of one stream finish in launch order, and a result's page-locked memory is reused `ring`
            # launches later (rose.graphs): a step launched earlier that is done (one of this step's stream, or
            # not) is completed first, not left to a waiter thread while steps launched meanwhile reuse its slot.
            for s in list(itertools.takewhile(lambda s: s is not step, self._inflight)):  # (in launch order)
                if _ready(s):
                    self._complete(s)
        self._inflight.remove(step)
        if self.stages is not None:
            _stamp(step.slots, WAIT)
        if self.tracing is not None:
            self.tracing.completed(step, time.monotonic())
        try:
            result = step.lazy.synchronize()
            # Copy before the next launch: the host buffers belong to the engine's ring, which the
            # steps launched after this one write into.
            if isinstance(result, tuple):
                out, weights, vectors = (t.numpy().copy() for t in result)
            else:
                out = result.numpy().copy()
            if self.stages is not None:
                _stamp(step.slots, COPY)
        except Exception as e:
            log.exception("engine step failed for %d sequences", len(step.slots))
            self._fail(step.slots, e)
            out = None
        if self._executor is None:
            self._pump()  # feed the GPU before the replies are built
        if out is not None:
            try:
                if isinstance(result, tuple):
                    self._scatter_extras(step.slots, weights, vectors)
                elif self._sparse_rows:
                    for row, (r, i) in enumerate(step.slots):
                        if Extra.SPARSE in r.extras:
                            r.sparse[i] = vocab_weights(out[row])
                for row, (r, i) in enumerate(step.slots):
                    r.pending -= 1
                    if r.rows is None:  # one sequence: its row is the answer
                        if not r.cancelled:
                            _deliver(r, out[row:row + 1], None)
                        continue
                    r.rows[i] = out[row]
                    if r.pending == 0 and not r.cancelled:
                        _deliver(r, np.stack(r.rows), None)
            except Exception as e:
                log.exception("scattering a step's results failed")
                self._fail(step.slots, e)
        if self._executor is not None:
            # On CPU the replies go first (a few ms against a step of seconds): a caller whose reply
            # cannot go has its queued work held (tulip.h2conn, Limits.hold_s) before the next step is
            # formed, instead of one more step of seconds computed for a peer that takes nothing.
            self._pump()
        self._aloop.call_soon(self._record, step, time.monotonic())

    def _fail(self, slots, e: Exception) -> None:
        """Fail the (not yet answered) requests of these slots; their queued sequences are dropped."""
        for r, _ in slots:
            if not r.cancelled and r.pending > 0:
                _deliver(r, None, RuntimeError(f"engine step failed: {e}"))  # first: a trace ends as failed
                self.cancel(r)

    def _scatter_extras(self, slots, weights: np.ndarray, vectors: np.ndarray) -> None:
        start = 0
        for r, i in slots:
            n = r.lengths[i]
            if Extra.SPARSE in r.extras:
                r.sparse[i] = lexical_weights(r.seq(i), weights[start:start + n], self._special)
            if Extra.COLBERT in r.extras:
                r.colbert[i] = colbert_vectors(vectors, start, n)  # a copy already
            start += n
