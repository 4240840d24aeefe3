"""Token-budget scheduler with two priority classes, first come first served within each (pure
Python, no GPU, no asyncio, no numpy).

Requests wait in arrival order, online ones (the default) in one queue, batch ones (bulk jobs:
`trellis embed`, Ivy's Batch API) in another. `next_batch()` takes online sequences from the front
of theirs until the next one would exceed the token budget; a step with no online work is all batch
work (at most `batch_step_tokens` of it). Queued online work overtakes queued batch work at every step.
A step that carries online work takes no batch work beside it: its callers wait for the whole step,
and one online sequence with 2,048 batch tokens beside it runs as long as a batch step, where alone
it runs as a step of its own size (on CUDA in the graph of its own shape, captured once). Only one in
`ONLINE_STEPS_PER_FILL` such steps in a row while batch work waits fills the budget the online work
leaves, so batch work is never starved, even by online work queued at every step. A request's
sequences may be spread over several batches, and within a class a later request never overtakes an
earlier one. Nothing is sorted by length: the cost of a step is close to linear in its tokens, so
sorting buys nothing and makes short requests wait (DESIGN.md).

An entry may be held (`hold`): its unbatched sequences leave the counts and are skipped until
`resume` (tulip.servicer holds the work of a connection whose replies are not being read); one that
reached the front of its queue while held goes back to the front, where it was.

The scheduler sees only an `Entry`: a request's sequence lengths, its class and how far it has been
batched. What the engine loop needs besides (token ids, the rows computed so far, the caller's
callback) lives in `tulip.loop.Request`, an `Entry` with more slots.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

# An Entry's `priority`: the values of the proto's Priority enum (PRIORITY_ONLINE, PRIORITY_BATCH;
# tests/test_priority.py holds them equal), kept as plain ints so this module imports no stubs.
ONLINE, BATCH = 0, 1

# Of the steps in a row that carry online work while batch work waits, this one (the fourth) takes batch
# work in the budget the online work leaves; the others take none. Online requests that arrive one or a few
# at a time find batch-only steps between theirs and never meet a filled step; a stream of online work that
# keeps its queue non-empty at every step still leaves batch work the room of one step in four.
ONLINE_STEPS_PER_FILL = 4


class Entry:
    """One request as the scheduler sees it: `lengths` (plain ints, one per sequence), its class
    `priority` (ONLINE or BATCH) and its progress. `next` is the index of its next sequence to batch;
    `queued` says some of it is still waiting; `cancelled` (set by `Scheduler.drop`, or by the owner)
    makes batching skip it; `held` (set by `Scheduler.hold`: 1 held in its queue, 2 held and taken off it
    at the front) too, until `Scheduler.resume`. Set `priority` before `Scheduler.add`."""

    __slots__ = ("lengths", "num_tokens", "next", "queued", "cancelled", "priority", "held")

    def __init__(self, lengths: Sequence[int], priority: int = ONLINE):
        if type(lengths) is not tuple:
            lengths = tuple(lengths.tolist() if hasattr(lengths, "tolist") else lengths)
        self.lengths = lengths
        self.num_tokens = sum(lengths)
        self.next = 0
        self.queued = False
        self.cancelled = False
        self.priority = priority
        self.held = 0


class Scheduler:
    """Two FCFS queues of entries (online, batch), cut into batches of at most `max_batch_tokens`
    tokens, online sequences first.

    `queued_tokens` and `len()` count only live work of both classes (`batch_tokens` / `batch_live`:
    the batch class's share): `drop()` takes an entry's unbatched tokens off at once (the entry itself
    leaves its queue when it reaches the front)."""

    def __init__(self, max_batch_tokens: int, max_batch_seqs: int = 1 << 16, batch_step_tokens: int = 0,
                 online_batch_step_tokens: int = 0):
        self.max_batch_tokens = max_batch_tokens
        # the most batch-class tokens one step takes (0: the whole budget): a step of batch work runs while online
        # requests arrive, and they wait for it; one batch sequence longer than this still goes alone
        self.batch_step_tokens = batch_step_tokens or max_batch_tokens
        # the same while online work is live (`next_batch(live=True)`; 0: batch_step_tokens)
        self.online_batch_step_tokens = online_batch_step_tokens or self.batch_step_tokens
        self.max_batch_seqs = max_batch_seqs
        self._queue: deque[Entry] = deque()  # online
        self._batch: deque[Entry] = deque()
        self._live = 0  # entries with sequences still queued, both classes
        self.queued_tokens = 0
        self.batch_live = 0  # of which batch entries
        self.batch_tokens = 0  # of which batch tokens
        self.held_tokens = 0  # unbatched tokens of held entries (in neither count above)
        self._unfilled = 0  # steps in a row that carried online work and no batch work while batch work waited

    def __len__(self) -> int:
        return self._live

    @property
    def online_live(self) -> int:
        """Online entries with sequences still queued (not held): the next step carries online work."""
        return self._live - self.batch_live

    def add(self, entry: Entry) -> None:
        longest = max(entry.lengths)
        if longest > self.max_batch_tokens:
            raise ValueError(f"a sequence of {longest} tokens exceeds the batch budget of {self.max_batch_tokens}")
        entry.queued = True
        if entry.priority:
            self._batch.append(entry)
            self.batch_live += 1
            self.batch_tokens += entry.num_tokens
        else:
            self._queue.append(entry)
        self._live += 1
        self.queued_tokens += entry.num_tokens

    def _count(self, entry: Entry, sign: int) -> int:
        """Add (sign 1) or take off (-1) what is left of `entry` to the queued counts; returns its tokens."""
        left = sum(entry.lengths[entry.next:])
        self._live += sign
        self.queued_tokens += sign * left
        if entry.priority:
            self.batch_live += sign
            self.batch_tokens += sign * left
        return left

    def drop(self, entry: Entry) -> bool:
        """Drop whatever of `entry` is still queued (or held) and mark it cancelled; False (and nothing
        changed) if none of it is queued any more."""
        if entry.held:
            entry.held = 0
            entry.cancelled = True
            self.held_tokens -= sum(entry.lengths[entry.next:])
            return True
        if not entry.queued:
            return False
        entry.queued = False
        entry.cancelled = True
        self._count(entry, -1)
        return True

    def hold(self, entry: Entry) -> bool:
        """Take what is still queued of `entry` out of the counts and out of batching until `resume`
        (it keeps its place in its queue); False if none of it is queued."""
        if not entry.queued:
            return False
        entry.queued = False
        entry.held = 1
        self.held_tokens += self._count(entry, -1)
        return True

    def resume(self, entries) -> None:
        """Batch these held entries again (others are ignored): in their place, or at the front of their
        queue for those that reached it while held (in the order given: their arrival order)."""
        front = []
        for entry in entries:
            if not entry.held:
                continue
            if entry.held == 2:
                front.append(entry)
            entry.held = 0
            entry.queued = True
            self.held_tokens -= self._count(entry, 1)
        for entry in reversed(front):
            (self._batch if entry.priority else self._queue).appendleft(entry)

    def next_batch(self, live: bool = False, fill: bool = True, batch_only: bool = False) -> list[tuple[Entry, int]]:
        """Pop the next batch as (entry, sequence index) slots: online work in arrival order; batch work
        in arrival order only where there is no online work, or in the budget left by one step in
        `ONLINE_STEPS_PER_FILL` that carry online work in a row. `live`: online work is live (the engine
        loop's clock says), batch work takes at most `online_batch_step_tokens`. With an online lane (the
        engine runs online steps beside batch steps) the loop asks for the two kinds apart: `fill=False`,
        a step of online work and no batch work; `batch_only`, a step of batch work whatever online work
        waits."""
        slots: list[tuple[Entry, int]] = []
        if batch_only:
            self._fill(slots, 0, self.online_batch_step_tokens if live else self.batch_step_tokens)
            return slots
        tokens = 0
        budget = self.max_batch_tokens
        q = self._queue
        while q and len(slots) < self.max_batch_seqs:
            entry = q[0]
            if entry.cancelled or entry.held:  # dropped: its tokens are already off the count (drop() did it)
                q.popleft()
                if entry.held:  # held: off the queue until resume() puts it back at the front
                    entry.held = 2
                elif entry.queued:  # cancelled by its owner without drop()
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
        if self._batch and fill:  # the online-only case pays this one test
            if not slots or self._unfilled >= ONLINE_STEPS_PER_FILL - 1:
                self._unfilled = 0
                self._fill(slots, tokens, self.online_batch_step_tokens if live else self.batch_step_tokens)
            elif self.batch_live:
                self._unfilled += 1
        return slots

    def _fill(self, slots: list, tokens: int, step_tokens: int) -> None:
        """Append batch-class sequences, FCFS, to `slots` (holding `tokens`) while they fit the budget and
        `step_tokens` more (at least one sequence where it fits the budget)."""
        budget = self.max_batch_tokens
        cap = tokens + step_tokens
        first = True
        q = self._batch
        while q and len(slots) < self.max_batch_seqs:
            entry = q[0]
            if entry.cancelled or entry.held:
                q.popleft()
                if entry.held:
                    entry.held = 2
                elif entry.queued:
                    self.drop(entry)
                continue
            i = entry.next
            n = entry.lengths[i]
            if tokens + n > budget or (tokens + n > cap and not first):
                break
            first = False
            slots.append((entry, i))
            tokens += n
            self.queued_tokens -= n
            self.batch_tokens -= n
            entry.next = i = i + 1
            if i == len(entry.lengths):
                q.popleft()
                entry.queued = False
                self._live -= 1
                self.batch_live -= 1
