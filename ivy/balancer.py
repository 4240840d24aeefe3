"""The one balancer: chunks a request on a token budget and sends each chunk to
the least-loaded Tulip replica (fewest outstanding tokens), retrying a chunk on
another replica when one is unavailable. Results come back in input order.
Which replicas there are, and whether each is serving, is ivy.discovery's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time

import grpc
import numpy as np

from ivy.discovery import SERVING, Replica, ReplicaSet
from trellis.client import EmbedOptions, EmbedResult, rpc_error
from trellis.tulip.v1 import tulip_pb2

log = logging.getLogger("ivy.balancer")

RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
DOWN_SECONDS = 2.0
# A replica that answered RESOURCE_EXHAUSTED (its queue is full) is passed over this long, and the
# chunk tried on the others: a fast-rejecting replica has the fewest outstanding tokens and would
# otherwise draw every request.
BUSY_SECONDS = 0.25

__all__ = ["Balancer", "Replica", "chunk"]


def chunk(seqs: list[np.ndarray], budget: int) -> list[tuple[int, int]]:
    """Split [0, len(seqs)) into consecutive (start, end) runs of at most `budget` tokens (>= 1 seq each)."""
    runs, start, tokens = [], 0, 0
    for i, s in enumerate(seqs):
        if i > start and tokens + len(s) > budget:
            runs.append((start, i))
            start, tokens = i, 0
        tokens += len(s)
    runs.append((start, len(seqs)))
    return runs


class Balancer:
    def __init__(self, targets: tuple[str, ...], max_chunk_tokens: int, transport: str = "stream",
                 spin_ms: float = 0.0, resolve_interval: float = 5.0):
        self.pool = ReplicaSet(targets, transport, spin_ms, resolve_interval)
        self.max_chunk_tokens = max_chunk_tokens
        self._rr = itertools.count()
        self._info: tulip_pb2.InfoReply | None = None
        self._fetch: asyncio.Future | None = None

    @property
    def replicas(self) -> list[Replica]:
        return self.pool.replicas

    def pick(self, exclude: set[Replica]) -> Replica | None:
        """Least outstanding tokens among the routable replicas not excluded (none that reports
        NOT_SERVING); ejected ones, then ones marked down, then ones not yet heard healthy come last."""
        now = time.monotonic()
        replicas = self.pool.replicas
        candidates = [(i, r) for i, r in enumerate(replicas) if r.routable and r not in exclude]
        if len(candidates) < 2:
            return candidates[0][1] if candidates else None
        turn = next(self._rr)
        n = len(replicas)
        return min(candidates, key=lambda c: (c[1].ejected, c[1].down_until > now, c[1].health != SERVING,
                                              c[1].busy_until > now, c[1].outstanding, (c[0] - turn) % n))[1]

    def full(self) -> bool:
        """Every routable replica answered RESOURCE_EXHAUSTED (or is down or ejected) within the last
        BUSY_SECONDS, one at least full: a request now would be refused, so Ivy refuses it before tokenizing it. The mark
        expires on its own; the first request after it probes the replicas again."""
        now = time.monotonic()
        live = [r for r in self.pool.replicas if r.routable]  # the ones pick() would try
        return (any(r.busy_until > now for r in live)
                and all(r.busy_until > now or r.down_until > now or r.ejected for r in live))

    def start(self) -> None:
        """Ask for Info, resolve names and watch health in the background from now on (call on the
        serving event loop)."""
        self.pool.start()
        self._fetch = asyncio.ensure_future(self.fetch_info())

    async def close(self) -> None:
        if self._fetch is not None:
            self._fetch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._fetch
        await self.pool.close()

    async def info(self, wait: float = 0.0) -> tulip_pb2.InfoReply | None:
        """The served model's Info (cached), or None when no replica has answered. `wait`: seconds to
        wait for the start-up fetch first. Each Ivy worker has its own channels: a request can reach a
        worker that has not heard from a replica another worker already reached."""
        if self._info is None and wait > 0 and self._fetch is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._fetch), wait)
        return self._info

    async def _ask_info(self) -> tulip_pb2.InfoReply | None:
        for r in self.pool.replicas:
            try:
                self._info = await r.client.info(timeout=2.0)
                break
            except grpc.aio.AioRpcError:
                continue
        return self._info

    async def fetch_info(self, every: float = 0.5) -> tulip_pb2.InfoReply:
        """Ask for Info until a replica answers: run at start-up, so no request waits on it (a worker
        asking first under load once met a 2 s Info timeout on both busy replicas and answered 503)."""
        while True:
            try:
                if (info := await self._ask_info()) is not None:
                    return info
            except Exception:  # not an RPC status (those _ask_info absorbs): say so and keep asking
                log.exception("asking the replicas for Info failed")
            await asyncio.sleep(every)

    async def ready(self) -> bool:
        """This worker can serve: it knows the model and a replica answers its health check."""
        if self._info is None:
            return False
        checks = await asyncio.gather(*(r.client.healthy() for r in self.pool.replicas))
        return any(checks)

    async def _send(self, seqs: list[np.ndarray], opts: EmbedOptions, stamp=None) -> EmbedResult:
        """One chunk: to the picked replica, then the next where one is full or unavailable (with
        --otlp-endpoint, ivy.tracing wraps this and `pick` on the instance: a span per chunk)."""
        tokens = sum(len(s) for s in seqs)
        tried: set[Replica] = set()
        last: grpc.aio.AioRpcError | None = None
        while (r := self.pick(tried)) is not None:
            tried.add(r)
            r.outstanding += tokens
            if stamp is not None:
                stamp("balancer")
            try:
                out = await r.client.call(seqs, opts)  # within what is left of opts.deadline
                r.down_until = 0.0
                self.pool.succeeded(r)
                return out
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    r.busy_until = time.monotonic() + BUSY_SECONDS  # full: the next replica, if any has room
                elif e.code() in RETRYABLE:
                    log.warning("request %s: replica %s unavailable (%s); retrying elsewhere", opts.request_id or "-",
                                r.target, e.details())
                    r.down_until = time.monotonic() + DOWN_SECONDS
                    self.pool.failed(r, e.details() or e.code().name)
                else:
                    raise
                if last is None or last.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    last = e  # a full replica's "retry shortly" (429) outranks an unreachable one's 503
            finally:
                r.outstanding -= tokens
        if last is None:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "no Tulip replica is serving: "
                            + (", ".join(map(repr, self.pool.replicas)) or
                               f"none found yet for {', '.join(t.given for t in self.pool.targets)}"))
        raise last

    async def embed(self, seqs: list[np.ndarray], opts: EmbedOptions, stamp=None) -> EmbedResult:
        """Embed all `seqs` (chunked over replicas) as `opts` asks; results per sequence, in input
        order, by `opts.deadline` (retries included). A chunk's options are `opts.part`'s (its
        sequences' pool_from / segment_starts, the request id with "-k" added). `stamp` (ivy.front's
        per-stage timing): called with "balancer" once a one-chunk request's replica is picked. A
        cross-encoder's pairs: the result's `scores`."""
        runs = chunk(seqs, self.max_chunk_tokens)
        if len(runs) == 1:
            return await self._send(seqs, opts, stamp)
        tasks = [asyncio.ensure_future(self._send(seqs[a:b], opts.part(a, b, k)))
                 for k, (a, b) in enumerate(runs)]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        return EmbedResult(np.concatenate([p.vectors for p in parts]),
                           [s for p in parts for s in p.sparse], [c for p in parts for c in p.colbert],
                           None if parts[0].scores is None else np.concatenate([p.scores for p in parts]))
