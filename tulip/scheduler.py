"""First-come-first-served token-budget scheduler (pure Python, no GPU, no asyncio, no numpy).

Requests wait in arrival order. `next_batch()` takes sequences from the front
until the next one would exceed the token budget; a request's sequences may be
spread over several batches, and a later request never overtakes an earlier
one. Nothing is sorted by length: the cost of a step is close to linear in its
tokens, so sorting buys nothing and makes short requests wait (DESIGN.md).

The scheduler sees only an `Entry`: a request's sequence lengths and how far it has been
batched. What the engine loop needs besides (token ids, the rows computed so far, the
caller's callback) lives in `tulip.loop.Request`, an `Entry` with more slots.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence


class Entry:
    """One request as the scheduler sees it: `lengths` (plain ints, one per sequence) and its
    progress. `next` is the index of its next sequence to batch; `queued` says some of it is
    still waiting; `cancelled` (set by `Scheduler.drop`, or by the owner) makes batching skip it."""

    __slots__ = ("lengths", "num_tokens", "next", "queued", "cancelled")

    def __init__(self, lengths: Sequence[int]):
        if type(lengths) is not tuple:
            lengths = tuple(lengths.tolist() if hasattr(lengths, "tolist") else lengths)
        self.lengths = lengths
        self.num_tokens = sum(lengths)
        self.next = 0
        self.queued = False
        self.cancelled = False


class Scheduler:
    """FCFS queue of entries, cut into batches of at most `max_batch_tokens` tokens.

    `queued_tokens` counts only live work: `drop()` takes an entry's unbatched tokens off at
    once (the entry itself leaves the queue when it reaches the front)."""

    def __init__(self, max_batch_tokens: int, max_batch_seqs: int = 1 << 16):
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self._queue: deque[Entry] = deque()
        self._live = 0  # entries with sequences still queued
        self.queued_tokens = 0

    def __len__(self) -> int:
        return self._live

    def add(self, entry: Entry) -> None:
        longest = max(entry.lengths)
        if longest > self.max_batch_tokens:
            raise ValueError(f"a sequence of {longest} tokens exceeds the batch budget of {self.max_batch_tokens}")
        entry.queued = True
        self._queue.append(entry)
        self._live += 1
        self.queued_tokens += entry.num_tokens

    def drop(self, entry: Entry) -> bool:
        """Drop whatever of `entry` is still queued and mark it cancelled; False (and nothing
        changed) if none of it is queued any more."""
        if not entry.queued:
            return False
        entry.queued = False
        entry.cancelled = True
        self._live -= 1
        self.queued_tokens -= sum(entry.lengths[entry.next:])
        return True

    def next_batch(self) -> list[tuple[Entry, int]]:
        """Pop the next batch as (entry, sequence index) slots, in arrival order."""
        slots: list[tuple[Entry, int]] = []
        tokens = 0
        budget = self.max_batch_tokens
        q = self._queue
        while q and len(slots) < self.max_batch_seqs:
            entry = q[0]
            if entry.cancelled:  # dropped: its tokens are already off the count (drop() did it)
                q.popleft()
                if entry.queued:  # cancelled by its owner without drop()
                    self.drop(entry)
                continue
            i = entry.next
            n = entry.lengths[i]
            if tokens + n > budget:
                break
            slots.append((entry, i))
            tokens += n
            self.queued_tokens -= n
            entry.next = i = i + 1
            if i == len(entry.lengths):
                q.popleft()
                entry.queued = False
                self._live -= 1
        return slots
