"""First-come-first-served token-budget scheduler (pure Python, no GPU, no asyncio).

Requests wait in arrival order. `next_batch()` takes sequences from the front
until the next one would exceed the token budget; a request's sequences may be
spread over several batches, and a later request never overtakes an earlier
one. Nothing is sorted by length: the cost of a step is close to linear in its
tokens, so sorting buys nothing and makes short requests wait (DESIGN.md).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

_ZERO = np.zeros(1, dtype=np.int64)
_ZERO.setflags(write=False)


@dataclass(eq=False)
class Request:
    """One caller's sequences, packed: `ids[offsets[i]:offsets[i] + lengths[i]]` is sequence i.

    `pool_from[i]` (optional) is how many leading tokens of sequence i mean pooling leaves out.
    `rows` receives one output row per sequence as batches complete (and `sparse` /
    `colbert` the token-level outputs named in `extras`); `pending` counts sequences still
    missing. `cancelled` requests are skipped when batching. `on_done(request, rows, error)`
    is called once, by whoever owns the request (Tulip's engine loop), when it completes or fails.
    """

    ids: np.ndarray
    lengths: np.ndarray
    extras: frozenset = frozenset()
    on_done: Callable[["Request", "np.ndarray | None", "Exception | None"], None] | None = None
    offsets: np.ndarray = field(init=False)
    rows: list = field(init=False)
    sparse: list = field(init=False)
    colbert: list = field(init=False)
    pending: int = field(init=False)
    num_tokens: int = field(init=False)
    cancelled: bool = False
    queued_at: float = 0.0  # monotonic time it entered the queue (for the queue-time metric)
    deadline: float = 0.0  # monotonic time after which its queued sequences are dropped (0: none)
    timer: object = None  # the owner's handle for the deadline, cancelled when the request completes
    pool_from: np.ndarray | None = None
    stamps: list | None = None  # tulip.stages: perf_counter_ns per point, when stage recording is on

    def __post_init__(self):
        n = len(self.lengths)
        if n == 1:  # the online case
            self.offsets = _ZERO
        else:
            self.offsets = np.zeros(n, dtype=np.int64)
            np.cumsum(self.lengths[:-1], out=self.offsets[1:])
        self.rows, self.sparse, self.colbert = [None] * n, [None] * n, [None] * n
        self.pending = n
        self.num_tokens = int(self.lengths.sum())

    def seq(self, i: int) -> np.ndarray:
        o = int(self.offsets[i])
        return self.ids[o:o + int(self.lengths[i])]


class Scheduler:
    """FCFS queue of requests, cut into batches of at most `max_batch_tokens` tokens.

    `queued_tokens` counts only live work: `drop()` takes a request's unbatched tokens off at
    once (its entry leaves the queue when it reaches the front)."""

    def __init__(self, max_batch_tokens: int, max_batch_seqs: int = 1 << 16):
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self._queue: deque[list] = deque()  # [request, next sequence index]
        self._entries: dict[int, list] = {}  # id(request) -> its queue entry, while it has sequences queued
        self.queued_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, req: Request) -> None:
        if int(req.lengths.max()) > self.max_batch_tokens:
            raise ValueError(
                f"a sequence of {int(req.lengths.max())} tokens exceeds the batch budget of {self.max_batch_tokens}"
            )
        entry = [req, 0]
        self._queue.append(entry)
        self._entries[id(req)] = entry
        self.queued_tokens += req.num_tokens

    def drop(self, req: Request) -> bool:
        """Drop whatever of `req` is still queued and mark it cancelled; False (and nothing
        changed) if none of it is queued any more."""
        entry = self._entries.pop(id(req), None)
        if entry is None:
            return False
        req.cancelled = True
        self.queued_tokens -= int(req.lengths[entry[1]:].sum())
        return True

    def next_batch(self) -> list[tuple[Request, int]]:
        """Pop the next batch as (request, sequence index) slots, in arrival order."""
        slots: list[tuple[Request, int]] = []
        tokens = 0
        q = self._queue
        while q and len(slots) < self.max_batch_seqs:
            entry = q[0]
            req, i = entry
            if req.cancelled:  # dropped: its tokens are already off the count
                q.popleft()
                continue
            n = int(req.lengths[i])
            if tokens + n > self.max_batch_tokens:
                break
            slots.append((req, i))
            tokens += n
            self.queued_tokens -= n
            entry[1] = i + 1
            if entry[1] == len(req.lengths):
                q.popleft()
                del self._entries[id(req)]
        return slots
