"""Tulip's gRPC server: validate requests, queue them, step the engine, reply.

One asyncio event loop runs the grpc.aio server (unary `Embed`, streaming
`EmbedStream`, `Info`, health) and one engine loop. The engine loop takes FCFS
batches from the `Scheduler` and launches `engine.step()` while up to
`max_inflight - 1` earlier steps still run; each step's `LazyTensor` is awaited
without blocking the event loop and its rows are scattered to the waiting
requests. A bad request is answered INVALID_ARGUMENT before it is queued; an
engine failure fails only the requests in that batch.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import signal
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rose.batch import Batch
from rose.engine import Engine, EngineConfig
from rose.modeldir import default_served_name
from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc
from tulip.config import TulipConfig, warmup_shapes
from tulip.metrics import TulipMetrics
from tulip.scheduler import Request, Scheduler
from tulip.spin import Spinner

log = logging.getLogger("tulip")
SERVICE_NAME = "trellis.tulip.v1.Tulip"
DEFAULT_BATCH_TOKENS = 16384  # --max-batch-tokens 0: this, or the model's max sequence length where longer


def parse_request(req: tulip_pb2.EmbedRequest,
                  info: tulip_pb2.InfoReply) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Check an EmbedRequest against the served model and unpack it into (ids, lengths, pool_from
    or None); raise ValueError with a caller-facing message."""
    vocab_size, max_seq_len, dim = info.vocab_size, info.max_seq_len, info.embedding_dim
    lens = list(req.lengths)  # plain ints: cheaper than numpy for the usual handful of sequences
    if not lens:
        raise ValueError("request has no sequences (lengths is empty)")
    if len(req.token_ids) % 4:
        raise ValueError(f"token_ids has {len(req.token_ids)} bytes, not a multiple of 4 (int32 little-endian)")
    ids = np.frombuffer(req.token_ids, dtype="<i4")
    if sum(lens) != ids.shape[0]:
        raise ValueError(f"lengths add up to {sum(lens)} tokens but token_ids holds {ids.shape[0]}")
    if min(lens) == 0:
        raise ValueError(f"sequence {lens.index(0)} is empty")
    longest = max(lens)
    if longest > max_seq_len:
        raise ValueError(f"sequence {lens.index(longest)} has {longest} tokens; "
                         f"this model accepts at most {max_seq_len}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if req.dimensions > dim:
        raise ValueError(f"dimensions {req.dimensions} exceeds the model's embedding size {dim}")
    if req.encoding not in info.encodings:
        name = tulip_pb2.Encoding.Name(req.encoding) if req.encoding in tulip_pb2.Encoding.values() else req.encoding
        raise ValueError(f"encoding {name} is not supported by this model "
                         f"(supported: {', '.join(tulip_pb2.Encoding.Name(e) for e in info.encodings)})")
    for o in req.outputs:
        if o != tulip_pb2.OUTPUT_UNSPECIFIED and o not in info.outputs:
            name = tulip_pb2.Output.Name(o) if o in tulip_pb2.Output.values() else o
            raise ValueError(f"output {name} is not supported by this model "
                             f"(supported: {', '.join(tulip_pb2.Output.Name(x) for x in info.outputs)})")
    pool_from = None
    if req.pool_from:
        if len(req.pool_from) != len(lens):
            raise ValueError(f"pool_from has {len(req.pool_from)} entries for {len(lens)} sequences")
        pool_from = np.array(req.pool_from, dtype=np.int64)
        bad = np.flatnonzero(pool_from >= np.array(lens))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"pool_from {int(pool_from[i])} leaves no token of sequence {i} ({lens[i]} tokens) to pool")
    return ids, np.array(lens, dtype=np.int64), pool_from


EXTRAS = {tulip_pb2.OUTPUT_SPARSE: "sparse", tulip_pb2.OUTPUT_COLBERT: "colbert"}


def lexical_weights(ids: np.ndarray, weights: np.ndarray, special: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Max weight per token id in first-occurrence order; special tokens and weights <= 0 dropped."""
    keep = (weights > 0) & ~np.isin(ids, special)
    ids, weights = ids[keep], weights[keep]
    uniq, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    best = np.zeros(len(uniq), dtype=np.float32)
    np.maximum.at(best, inverse, weights)
    order = np.argsort(first, kind="stable")
    return uniq[order], best[order]


def truncate_dims(vectors: np.ndarray, dims: int) -> np.ndarray:
    """Matryoshka truncation to `dims` (0 = keep all), then L2 re-normalisation."""
    if dims == 0 or dims == vectors.shape[1]:
        return vectors
    v = vectors[:, :dims]
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


def warm_up(engine: Engine, specs: tuple[str, ...]) -> None:
    """Run each --warmup shape (`warmup_shapes`: N sequences of L tokens, with the outputs after "+")
    three times: eager, capture, replay. A model without an asked output raises ValueError."""
    for n, length, extras in warmup_shapes(specs):
        length = min(length, engine.spec.max_seq_len)
        batch = Batch.from_sequences([np.full(length, 5, dtype=np.int64)] * n)
        t0 = time.perf_counter()
        for _ in range(3):
            engine.step(batch, extras).synchronize()
        log.info("warmed up %dx%d%s in %.0f ms", n, length, "".join(f"+{e}" for e in sorted(extras)),
                 (time.perf_counter() - t0) * 1e3)


def encode(vectors: np.ndarray, encoding: int) -> bytes:
    """float32 [n, dim] -> the reply's bytes in `encoding` (see tulip.proto)."""
    if encoding == tulip_pb2.ENCODING_INT8:
        return np.clip(np.rint(np.tanh(vectors) * 127), -127, 127).astype(np.int8).tobytes()
    if encoding == tulip_pb2.ENCODING_BINARY:
        return np.packbits(vectors > 0, axis=1).tobytes()
    return np.ascontiguousarray(vectors, dtype="<f4").tobytes()


def _deliver(req: Request, rows, error) -> None:
    """Call a request's completion callback; its failure is its own, never the engine loop's."""
    if req.timer is not None:
        req.timer.cancel()
    try:
        req.on_done(req, rows, error)
    except Exception:
        log.exception("completion callback failed for a request of %d sequences", len(req.lengths))


def _run_step(engine: Engine, batch: Batch, extras: frozenset):
    return engine.step(batch, extras).synchronize()


class _StepThread:
    """A CPU step running in the step thread, with LazyTensor's ready / synchronize / await."""

    def __init__(self, future):
        self.future = future

    def ready(self) -> bool:
        return self.future.done()

    def synchronize(self):
        return self.future.result()

    def __await__(self):
        return asyncio.wrap_future(self.future).__await__()


@dataclass(eq=False)
class _Step:
    slots: list
    lazy: object  # LazyTensor, or _StepThread on CPU
    launched: float
    watched_from: float = 0.0


class EngineLoop:
    """Owns the scheduler and the engine; answers each request through its `on_done` callback.

    No task sits between a request and the GPU: `submit_nowait` queues the request and,
    when a step slot is free (at most `max_inflight` in flight), launches the next FCFS
    batch at once (on CUDA `engine.step` only queues work). While a step runs, another is
    launched only once a quarter of a batch's token budget is waiting; fewer requests wait
    for the running step and go together in the next. The oldest step is watched by
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
        self.scheduler = Scheduler(cfg.max_batch_tokens)
        self.metrics.queue_tokens.set_function(lambda: self.scheduler.queued_tokens)
        self.metrics.queue_requests.set_function(lambda: len(self.scheduler))
        self._inflight: deque[_Step] = deque()
        # On CPU the forward runs in the step; keep it off the event loop.
        self._executor = ThreadPoolExecutor(1, "tulip-step") if engine.device.type == "cpu" else None
        self._spin_s = cfg.spin_ms / 1e3 if self._executor is None else 0.0
        # A step launched while another runs pays a step's fixed cost (~0.9 ms for BGE-M3 on an
        # H200) for whatever is queued; for a few requests that costs more than waiting for the
        # running step and joining the next, larger one.
        self._overlap_tokens = cfg.max_batch_tokens // 4
        self._special = np.asarray(engine.spec.special_token_ids, dtype=np.int32)
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._watching = False  # a _watch callback or _wait task owns the oldest step
        # After a step completes the loop stays awake for spin_ms, so the next request (and the
        # replies being written) are picked up without an epoll wake-up.
        self._idle = Spinner(self._spin_s)

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

    def cancel(self, req: Request) -> None:
        """The caller is gone: drop what is still queued of `req`; its computed rows are discarded."""
        self.scheduler.drop(req)
        req.cancelled = True
        if req.timer is not None:
            req.timer.cancel()

    def submit_nowait(self, req: Request) -> None:
        """Queue `req` (its `on_done` is called when it completes or fails); raise OverflowError
        when the queue is full. Launches a step at once if a slot is free."""
        if self.scheduler.queued_tokens + req.num_tokens > self.cfg.max_queued_tokens:
            raise OverflowError(
                f"queue full: {self.scheduler.queued_tokens} tokens waiting, this request adds {req.num_tokens}, "
                f"limit {self.cfg.max_queued_tokens}"
            )
        req.queued_at = time.monotonic()
        self.scheduler.add(req)
        if req.deadline:
            req.timer = self._aloop.call_later(max(0.0, req.deadline - req.queued_at), self._expire, req)
        self._pump()

    def _expire(self, req: Request) -> None:
        """A deadline passed: a request still (partly) queued is answered now; one fully running completes."""
        if not req.cancelled and self.scheduler.drop(req):
            _deliver(req, None, TimeoutError("deadline passed while the request was queued"))

    async def submit(self, req: Request) -> np.ndarray:
        """Queue `req` and wait for its [n, dim] float32 rows; cancelling the caller drops the request."""
        fut = self._aloop.create_future()

        def done(r, rows, error):
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(rows)

        req.on_done = done
        self.submit_nowait(req)
        try:
            return await fut
        except asyncio.CancelledError:
            self.cancel(req)
            raise

    def _record_launch(self, tokens: int, seqs: int, waits: list[float]) -> None:
        m = self.metrics
        m.batch_tokens.observe(tokens)
        m.batch_seqs.observe(seqs)
        for w in waits:
            m.queue_seconds.observe(w)

    def _pump(self) -> None:
        """Launch FCFS batches while a step slot is free."""
        sched = self.scheduler
        while (len(self._inflight) < self.cfg.max_inflight and len(sched)
               and (not self._inflight or sched.queued_tokens >= self._overlap_tokens)):
            slots = sched.next_batch()
            if not slots:
                break
            extras = frozenset().union(*(r.extras for r, _ in slots))
            launched = time.monotonic()
            try:
                skip = None  # prompts left out of pooling: only requests from Ivy for such models carry them
                if any(r.pool_from is not None for r, _ in slots):
                    skip = [int(r.pool_from[i]) if r.pool_from is not None else 0 for r, i in slots]
                batch = Batch.from_sequences([r.seq(i) for r, i in slots], skip)
                if self._executor is None:
                    lazy = self.engine.step(batch, extras)
                else:
                    lazy = _StepThread(self._executor.submit(_run_step, self.engine, batch, extras))
            except Exception as e:  # an engine failure fails this batch only
                log.exception("engine step failed for %d sequences", len(slots))
                self._fail(slots, e)
                continue
            self._inflight.append(_Step(slots, lazy, launched))
            # Metrics on a later loop iteration, while the step runs: off the request's path.
            self._aloop.call_soon(self._record_launch, batch.num_tokens, batch.num_seqs,
                                  [launched - r.queued_at for r, i in slots if i == 0])
        if self._inflight and not self._watching:
            self._watching = True
            self._aloop.call_soon(self._watch)

    def _watch(self) -> None:
        """Complete the oldest step if it is done; otherwise poll again on the next loop
        iteration, or hand the wait to a thread once it has run for `spin_ms`."""
        if not self._inflight:  # stop() gave up on the steps
            self._watching = False
            return
        step = self._inflight[0]
        now = time.monotonic()
        if step.watched_from == 0.0:
            step.watched_from = now  # the spin budget counts from when a step becomes the oldest
        try:
            ready = step.lazy.ready()
        except Exception:  # e.g. a sticky CUDA error: synchronize() raises it again in _complete
            ready = True
        if ready:
            self._complete(step)
        elif now - step.watched_from < self._spin_s:
            self._aloop.call_soon(self._watch)
        else:
            self._aloop.create_task(self._wait(step))

    async def _wait(self, step: _Step) -> None:
        try:
            await step.lazy
        except Exception:
            pass  # raised again, and reported, by _complete
        self._complete(step)

    def _complete(self, step: _Step) -> None:
        self._watching = False
        self._idle.kick()
        if not self._inflight or self._inflight[0] is not step:
            return  # stop() already failed it
        self._inflight.popleft()
        try:
            result = step.lazy.synchronize()
            # Copy before the next launch: the host buffers belong to the engine's ring, which the
            # steps launched after this one write into.
            if isinstance(result, tuple):
                out, weights, vectors = (t.numpy().copy() for t in result)
            else:
                out = result.numpy().copy()
        except Exception as e:
            log.exception("engine step failed for %d sequences", len(step.slots))
            self._fail(step.slots, e)
            out = None
        self._pump()  # feed the GPU before the replies are built
        if out is not None:
            try:
                if isinstance(result, tuple):
                    self._scatter_extras(step.slots, weights, vectors)
                for row, (r, i) in enumerate(step.slots):
                    r.rows[i] = out[row]
                    r.pending -= 1
                    if r.pending == 0 and not r.cancelled:
                        _deliver(r, out[row:row + 1] if len(r.rows) == 1 else np.stack(r.rows), None)
            except Exception as e:
                log.exception("scattering a step's results failed")
                self._fail(step.slots, e)
        self._aloop.call_soon(self.metrics.step_seconds.observe, time.monotonic() - step.launched)

    def _fail(self, slots, e: Exception) -> None:
        """Fail the (not yet answered) requests of these slots; their queued sequences are dropped."""
        for r, _ in slots:
            if not r.cancelled and r.pending > 0:
                self.cancel(r)
                _deliver(r, None, RuntimeError(f"engine step failed: {e}"))

    def _scatter_extras(self, slots, weights: np.ndarray, vectors: np.ndarray) -> None:
        start = 0
        for r, i in slots:
            n = int(r.lengths[i])
            if "sparse" in r.extras:
                r.sparse[i] = lexical_weights(r.seq(i), weights[start:start + n], self._special)
            if "colbert" in r.extras:
                r.colbert[i] = vectors[start + 1:start + n]  # every token after the first (a copy already)
            start += n


class RpcFailure(Exception):
    """A request's failure, as the gRPC status it is answered with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message

    @classmethod
    def of(cls, error: Exception) -> "RpcFailure":
        """The engine loop's failures: a full queue, a passed deadline, a failed step."""
        code = (grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(error, OverflowError)
                else grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(error, TimeoutError)
                else grpc.StatusCode.INTERNAL)
        return cls(code, str(error))


class TulipServicer(tulip_pb2_grpc.TulipServicer):
    def __init__(self, loop: EngineLoop, served_name: str):
        self.loop = loop
        e = loop.engine
        self.info = tulip_pb2.InfoReply(
            model=served_name,
            embedding_dim=e.embedding_dim,
            max_seq_len=e.spec.max_seq_len,
            vocab_size=e.spec.vocab_size,
            pooling=e.spec.pooling,
            normalized=e.spec.normalize,
            outputs=[tulip_pb2.OUTPUT_DENSE] + [o for o, n in EXTRAS.items() if n in e.extra_outputs],
            dtype=str(e.dtype).removeprefix("torch."),
            device=str(e.device),
            max_batch_tokens=loop.cfg.max_batch_tokens,
            attention=e.attention.name,
            encodings=[tulip_pb2.ENCODING_FLOAT32] + (
                [tulip_pb2.ENCODING_INT8, tulip_pb2.ENCODING_BINARY] if e.spec.quantized_outputs else []),
        )

        self._ok = loop.metrics.requests.labels("OK")

    async def Info(self, request, context):
        return self.info

    async def Embed(self, request, context):
        count = self.loop.metrics.requests
        try:
            req = self._request(request)
            try:
                vectors = await self.loop.submit(req)
            except (OverflowError, TimeoutError, RuntimeError) as e:
                raise RpcFailure.of(e) from None
            reply = self._reply(request, req, vectors)
        except RpcFailure as e:
            count.labels(e.code.name).inc()
            await context.abort(e.code, e.message)
        except asyncio.CancelledError:
            count.labels("CANCELLED").inc()
            raise
        self._ok.inc()
        return reply

    async def EmbedStream(self, request_iterator, context):
        """Requests tagged with request_id; replies in completion order. A failed request gets
        a reply with error_code / error_message; the stream and everyone else carry on.

        No task per request: the reader queues each request, and the engine loop's completion
        callback puts its reply on the queue this generator drains."""
        replies: asyncio.Queue = asyncio.Queue()
        outstanding: set[Request] = set()
        count = self.loop.metrics.requests

        def answer(request, reply=None, error: RpcFailure | None = None):
            if reply is None:
                count.labels(error.code.name).inc()
                reply = tulip_pb2.EmbedReply(error_code=error.code.value[0], error_message=error.message)
            else:
                self._ok.inc()
            reply.request_id = request.request_id
            replies.put_nowait(reply)

        def done(request, req, rows, error):
            outstanding.discard(req)
            if error is not None:
                answer(request, error=RpcFailure.of(error))
                return
            try:
                answer(request, self._reply(request, req, rows))
            except Exception as e:  # never leave a stream request unanswered
                log.exception("building a reply failed")
                answer(request, error=RpcFailure(grpc.StatusCode.INTERNAL, f"could not build the reply: {e}"))

        async def read():
            try:
                async for request in request_iterator:
                    try:
                        req = self._request(request, functools.partial(done, request))
                        if request.timeout_ms:
                            req.deadline = time.monotonic() + request.timeout_ms / 1e3
                        outstanding.add(req)
                        self.loop.submit_nowait(req)
                    except OverflowError as e:
                        outstanding.discard(req)
                        answer(request, error=RpcFailure.of(e))
                    except RpcFailure as e:
                        answer(request, error=e)
            finally:
                replies.put_nowait(None)  # the caller closed its side (or reading failed)

        reader = asyncio.create_task(read())
        try:
            closed = False
            while not (closed and not outstanding and replies.empty()):
                reply = await replies.get()
                if reply is None:
                    closed = True
                else:
                    yield reply
        finally:
            reader.cancel()
            for req in list(outstanding):
                self.loop.cancel(req)

    def _request(self, request: tulip_pb2.EmbedRequest, on_done=None) -> Request:
        """Validate one request; raise RpcFailure(INVALID_ARGUMENT) with the reason."""
        try:
            ids, lengths, pool_from = parse_request(request, self.info)
        except ValueError as e:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return Request(ids, lengths, frozenset(EXTRAS[o] for o in request.outputs if o in EXTRAS), on_done,
                       pool_from=pool_from)

    def _reply(self, request: tulip_pb2.EmbedRequest, req: Request, vectors: np.ndarray) -> tulip_pb2.EmbedReply:
        """The reply for a completed request."""
        vectors = truncate_dims(vectors, request.dimensions)
        reply = tulip_pb2.EmbedReply(
            embeddings=encode(vectors, request.encoding),
            shape=vectors.shape,
            prompt_tokens=req.num_tokens,
            encoding=request.encoding,
        )
        if "sparse" in req.extras:
            reply.sparse.extend(tulip_pb2.SparseVector(token_ids=t, weights=w) for t, w in req.sparse)
        if "colbert" in req.extras:
            reply.colbert = np.concatenate(req.colbert).astype("<f4").tobytes()
            reply.colbert_lengths.extend(len(c) for c in req.colbert)
            reply.colbert_dim = self.loop.engine.heads.colbert_dim
        return reply


async def serve(cfg: TulipConfig) -> int:
    """Load the model, serve until SIGTERM/SIGINT, drain, return the exit code."""
    engine = Engine(EngineConfig(cfg.model, cfg.device, cfg.dtype, cfg.attention, cfg.graphs, compile=cfg.compile,
                                 attention_table=cfg.attention_table))
    if not cfg.max_batch_tokens:
        budget = max(DEFAULT_BATCH_TOKENS, engine.spec.max_seq_len)
        if cfg.max_queued_tokens < budget:
            raise ValueError(f"max_queued_tokens {cfg.max_queued_tokens} is below this model's step budget {budget} "
                             f"({DEFAULT_BATCH_TOKENS}, or its maximum length where longer); raise it")
        cfg = replace(cfg, max_batch_tokens=budget)
    if cfg.max_batch_tokens < engine.spec.max_seq_len:
        raise ValueError(
            f"max_batch_tokens {cfg.max_batch_tokens} is smaller than the model's max sequence length "
            f"{engine.spec.max_seq_len}"
        )
    if engine.runner is not None and cfg.max_inflight > engine.runner.cfg.ring:
        raise ValueError(f"max_inflight {cfg.max_inflight} exceeds the engine's ring of {engine.runner.cfg.ring} "
                         "result buffers")
    warm_up(engine, cfg.warmup)
    # Everything loaded so far lives as long as the process: keep it out of the collector's
    # scans, so a full collection while serving is short.
    gc.collect()
    gc.freeze()
    metrics = TulipMetrics(engine)
    if cfg.metrics_port:
        metrics.serve(cfg.metrics_port, cfg.host)
    loop = EngineLoop(engine, cfg, metrics)
    loop.start()
    mb = cfg.max_message_mb << 20
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", mb),
        ("grpc.max_send_message_length", mb),
        ("grpc.so_reuseport", 0),
    ])
    servicer = TulipServicer(loop, cfg.served_model_name or default_served_name(cfg.model, engine.spec.path))
    tulip_pb2_grpc.add_TulipServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    if cfg.uds and not server.add_insecure_port(f"unix:{cfg.uds}"):
        raise OSError(f"could not bind unix:{cfg.uds}")
    if port == 0:
        raise OSError(f"could not bind {cfg.host}:{cfg.port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("tulip serving %s on %s:%d", servicer.info.model, cfg.host, port)
    print(f"TULIP_READY {cfg.host}:{port}" + (f" unix:{cfg.uds}" if cfg.uds else ""), flush=True)

    stop = asyncio.Event()
    aloop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("tulip: draining (up to %.1f s)", cfg.drain_seconds)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=cfg.drain_seconds)
    await loop.stop(cfg.drain_seconds)
    log.info("tulip: stopped")
    return 0
