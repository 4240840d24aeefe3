"""Where a job's token ids become vectors: the engine loop in this process (`Local`: Tulip's own EngineLoop,
scheduler and engine, without the gRPC server), running Tulips (`Remote`: trellis.client at batch priority),
or an Ivy (`Http`: texts to /v1/embeddings with `X-Trellis-Priority: batch`).

Each backend's calls are coroutines on one `LoopThread` (an asyncio loop on a thread of its own), so the
`Embedder` tokenizes the next slice of its rows on the caller's thread while earlier requests run.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import logging
import threading
import time
from time import perf_counter
from typing import NamedTuple

import numpy as np

from trellis.tulip.v1 import tulip_pb2

log = logging.getLogger("jobs")

RETRY_S = 300.0  # a replica that stays unreachable or full this long fails the job (each try waits up to 5 s more)
_OUTPUT_CODES = {"sparse": tulip_pb2.OUTPUT_SPARSE, "colbert": tulip_pb2.OUTPUT_COLBERT}


class Rows(NamedTuple):
    """One request's results, a row per sequence: float32 vectors [n, dim]; per sequence (token ids, weights)
    where sparse was asked, float32 [tokens - 1, colbert_dim] where colbert was (else None)."""

    vectors: np.ndarray
    sparse: list | None = None
    colbert: list | None = None


class LoopThread:
    """An asyncio event loop running on a daemon thread; `submit` hands it a coroutine from any thread."""

    def __init__(self, name: str = "trellis-embed-io"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro, timeout: float | None = None):
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


class StepClock:
    """When the engine had a step in flight: `busy_s()` is the time so far with at least one step launched and
    not complete (steps overlap on a GPU: their union). A job's wall time minus its busy time is host time the
    steps did not hide (`host_idle_share` in run()'s summary). A step starts when `engine.step` is called and
    ends when it returns on CPU (a CPU step is complete then), on CUDA when the engine loop first sees its
    result ready (its polling or its waiter thread: a little after the GPU finished). `spans`: a list to which
    each busy stretch (perf_counter start, end) is appended, or None (the default: nothing kept)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.open = self.steps = 0
        self.busy = self.since = 0.0
        self.spans: list | None = None

    def start(self) -> None:
        with self.lock:
            if self.open == 0:
                self.since = perf_counter()
            self.open += 1
            self.steps += 1

    def end(self) -> None:
        with self.lock:
            self.open -= 1
            if self.open == 0:
                now = perf_counter()
                self.busy += now - self.since
                if self.spans is not None:
                    self.spans.append((self.since, now))

    def busy_s(self) -> float:
        with self.lock:
            return self.busy + (perf_counter() - self.since if self.open else 0.0)


class _TimedLazy:
    """A step's LazyTensor (ready / synchronize / await, as EngineLoop uses it) that tells the clock when the
    step is seen complete, once."""

    __slots__ = ("lazy", "clock")

    def __init__(self, lazy, clock: StepClock):
        self.lazy, self.clock = lazy, clock

    def _done(self) -> None:
        if self.clock is not None:
            self.clock, clock = None, self.clock
            clock.end()

    def ready(self) -> bool:
        r = self.lazy.ready()
        if r:
            self._done()
        return r

    def synchronize(self):
        try:
            return self.lazy.synchronize()
        finally:
            self._done()

    def __await__(self):
        try:
            return (yield from self.lazy.__await__())
        finally:
            self._done()


class TimedEngine:
    """The engine as the EngineLoop sees it, with its text steps timed by `clock` (everything else is the
    engine's own). Why a wrapper: EngineLoop (Tulip's) launches and completes the steps; this keeps the job's
    measurement out of Tulip's loop."""

    def __init__(self, engine, clock: StepClock):
        self._engine, self._clock = engine, clock

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def step(self, *args, **kwargs):
        clock = self._clock
        clock.start()
        try:
            lazy = self._engine.step(*args, **kwargs)
        except BaseException:
            clock.end()
            raise
        if lazy.ready():  # on CPU: complete on return
            clock.end()
            return lazy
        return _TimedLazy(lazy, clock)


class Local:
    """The model on this process's device, run by Tulip's EngineLoop (its FCFS token-budget scheduler, the
    overlap of steps, the CPU pieces and the sparse / ColBERT scatter): the steps a Tulip serving this model
    would run, without the server. `info` is the InfoReply that Tulip would answer."""

    def __init__(self, ref, device: str, dtype: str, max_batch_tokens: int, io: LoopThread):
        from rose.engine import Engine, EngineConfig
        from tulip.config import TulipConfig
        from tulip.loop import EngineLoop
        from tulip.server import DEFAULT_BATCH_TOKENS
        from tulip.servicer import TulipServicer

        engine = Engine(EngineConfig(str(ref.path), device, dtype))
        budget = max_batch_tokens or max(DEFAULT_BATCH_TOKENS, engine.spec.max_seq_len)
        if budget < engine.spec.max_seq_len:
            raise ValueError(f"max_batch_tokens {budget} is smaller than the model's maximum length "
                             f"{engine.spec.max_seq_len}")
        # the queue's bound is the Embedder's (inflight_tokens); the loop's only stops a runaway caller
        cfg = TulipConfig(model=str(ref.path), device=device, max_batch_tokens=budget,
                          max_queued_tokens=max(1 << 24, budget))
        self.engine, self.budget = engine, budget
        self.clock = StepClock()
        self.loop = EngineLoop(TimedEngine(engine, self.clock), cfg)
        io.call(self._start())
        self.info = TulipServicer(self.loop, ref.name, ref).info

    async def _start(self) -> None:
        self.loop.start()

    async def embed(self, seqs: list[np.ndarray], pool_from: list[int] | None, outputs: tuple[str, ...]) -> Rows:
        from rose.extras import Extra
        from tulip.loop import Request

        extras = frozenset(Extra(o) for o in outputs if o != "dense")
        ids = np.concatenate(seqs).astype(np.int32, copy=False)
        req = Request(ids, [len(s) for s in seqs], extras, pool_from=pool_from or None)
        rows = await self.loop.submit(req)
        return Rows(rows, req.sparse, req.colbert)

    async def close(self) -> None:
        await self.loop.stop()


class Remote:
    """One running Tulip over trellis.client's stream, every request at batch priority (Tulip serves queued
    online work first). A replica that is unreachable or full (UNAVAILABLE, RESOURCE_EXHAUSTED) is retried
    with backoff for up to RETRY_S."""

    def __init__(self, target: str, io: LoopThread):
        self.target = target
        self.info = io.call(self._connect())
        self.budget = self.info.max_batch_tokens or 16384

    async def _connect(self) -> tulip_pb2.InfoReply:
        from trellis.client import TulipClient

        self.client = TulipClient(self.target)  # (grpc.aio binds a channel to the loop it is made on)
        return await self._retry(lambda: self.client.info(timeout=5.0))

    async def _retry(self, call):
        import grpc

        start, wait = time.monotonic(), 0.2
        while True:
            try:
                return await call()
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                grpc.StatusCode.DEADLINE_EXCEEDED) or time.monotonic() - start > RETRY_S:
                    raise RuntimeError(f"Tulip {self.target}: {code.name}: {e.details()}") from None
                log.info("Tulip %s: %s, retrying in %.1f s", self.target, code.name, wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, 5.0)

    async def embed(self, seqs: list[np.ndarray], pool_from: list[int] | None, outputs: tuple[str, ...]) -> Rows:
        codes = [_OUTPUT_CODES[o] for o in outputs if o != "dense"]
        r = await self._retry(lambda: self.client.embed_result(seqs, outputs=codes, pool_from=pool_from or (),
                                                               priority=tulip_pb2.PRIORITY_BATCH))
        return Rows(np.asarray(r.vectors, dtype=np.float32), r.sparse if "sparse" in outputs else None,
                    r.colbert if "colbert" in outputs else None)

    async def close(self) -> None:
        await self.client.close()


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class Http:
    """An Ivy's /v1/embeddings: texts in (Ivy tokenizes and templates them), float32 vectors back (base64),
    `X-Trellis-Priority: batch` on every request. 429 / 503 / a lost connection are retried with backoff
    for up to RETRY_S; another error status raises HttpError (the Embedder splits the rows to find a bad one)."""

    def __init__(self, url: str, api_key: str, model: str, io: LoopThread):
        self.url, self.model = url.rstrip("/") + "/v1/embeddings", model
        self.headers = {"X-Trellis-Priority": "batch", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        io.call(self._open())

    async def _open(self) -> None:
        import httpx

        self.client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0))

    async def embed(self, texts: list[str], body: dict) -> tuple[np.ndarray, int]:
        """Vectors float32 [n, dim] of `texts` and the request's prompt tokens (`usage`)."""
        import httpx

        payload = {"input": texts, "encoding_format": "base64", **body, **({"model": self.model} if self.model else {})}
        start, wait = time.monotonic(), 0.2
        while True:
            try:
                r = await self.client.post(self.url, json=payload, headers=self.headers)
            except httpx.TransportError as e:
                status, message = 0, f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 200:
                    got = r.json()
                    rows = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in got["data"]]
                    return np.stack(rows), int(got.get("usage", {}).get("prompt_tokens", 0))
                status = r.status_code
                try:
                    message = r.json()["error"]["message"]
                except Exception:
                    message = r.text[:500]
            if status not in (0, 429, 502, 503, 504) or time.monotonic() - start > RETRY_S:
                raise HttpError(status, f"{self.url}: HTTP {status}: {message}")
            log.info("%s: HTTP %s (%s), retrying in %.1f s", self.url, status, message, wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, 5.0)

    async def close(self) -> None:
        await self.client.aclose()
