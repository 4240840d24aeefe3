"""What one step of scheduled slots runs on the engine (`tulip.loop.EngineLoop`'s steps): the `Batch` of
(request, sequence index) slots and the outputs they ask for, a large CPU step cut into pieces that skip the
cancelled, an image step's pixels (a view of one request's where they can be), and a CPU step run in the step
thread with LazyTensor's ready / synchronize / await."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from rose.batch import Batch
from rose.engine import Engine

_NO_EXTRAS = frozenset()


def batch_of(slots) -> tuple[Batch, frozenset]:
    """The Batch of these (request, sequence index) slots, and the outputs its requests ask for."""
    if len(slots) == 1:  # the online case
        r, i = slots[0]
        return Batch.from_sequences([r.seq(i)], None if r.pool_from is None else [r.pool_from[i]],
                                    None if r.segments is None else [r.segments[i]]), r.extras
    extras, skip, seg = _NO_EXTRAS, None, None
    for r, i in slots:
        if r.extras:
            extras = extras | r.extras
        if r.pool_from is not None:  # prompts left out of pooling: only from Ivy for such models
            skip = [0 if r.pool_from is None else r.pool_from[i] for r, i in slots]
        if r.segments is not None and seg is None:  # pairs: only for cross-encoders
            seg = [0 if r.segments is None else r.segments[i] for r, i in slots]
    return Batch.from_sequences([r.seq(i) for r, i in slots], skip, seg), extras


# A running step cannot be cut short, and on CPU one of 16,384 tokens takes seconds (all-MiniLM-L6-v2
# on 2 shared cores: 15 s and more), during which every other caller waits. So a CPU step of more
# tokens than this runs a piece of consecutive sequences at a time, and a piece whose requests have
# all been cancelled by the time it would start (their clients left) is skipped: the work of
# disconnected callers stops at the next piece, not at the end of the step. A CPU has no device to
# fill: per token, 8 pieces of 2,048 cost what one step of 16,384 does, within the noise of shared
# cores (docs/reliability.md, Ivy's limits).
CPU_PIECE_TOKENS = 2048


def pieces(slots) -> list:
    """`slots` cut into consecutive runs of at most CPU_PIECE_TOKENS tokens (at least one sequence each)."""
    pieces, start, tokens = [], 0, 0
    for k, (r, i) in enumerate(slots):
        n = r.lengths[i]
        if k > start and tokens + n > CPU_PIECE_TOKENS:
            pieces.append(slots[start:k])
            start, tokens = k, 0
        tokens += n
    pieces.append(slots[start:])
    return pieces


def run_pieces(engine: Engine, slots) -> torch.Tensor:
    """A large CPU step without token-level outputs, one piece at a time (CPU_PIECE_TOKENS); a piece
    whose requests are all cancelled (read across threads: a flag only ever set) is not run, and
    its rows are zeros that no one reads (`_complete` answers no cancelled request)."""
    outs: list = []
    for piece in pieces(slots):
        if all(r.cancelled for r, _ in piece):
            outs.append(len(piece))
            continue
        batch, _ = batch_of(piece)
        outs.append(engine.step(batch, _NO_EXTRAS).synchronize().clone())  # a copy: the next piece reuses buffers
    like = next((o for o in outs if not isinstance(o, int)), None)
    if like is None:  # all cancelled: rows of any width do
        return torch.zeros((len(slots), 1))
    return torch.cat([like.new_zeros((o, *like.shape[1:])) if isinstance(o, int) else o for o in outs])


def run_step(engine: Engine, batch: Batch, extras: frozenset):
    return engine.step(batch, extras).synchronize()


def pixels_of(slots) -> torch.Tensor:
    """The uint8 [N, S, S, 3] pictures of these (image request, image index) slots, in order: a view of the
    request's pixels where they are one request's, in a row, and writable (cut from a big message,
    tulip.messages.Images; the engine's staging copy is then their only one), else a copy (torch takes no
    read-only array: a small message's bytes)."""
    r, first = slots[0]
    pixels = r.pixels
    if pixels.flags.writeable and slots[-1][1] == first + len(slots) - 1 and all(e is r for e, _ in slots):
        return torch.from_numpy(pixels[first:first + len(slots)])
    return torch.from_numpy(np.stack([r.pixels[i] for r, i in slots]))


def run_images(engine: Engine, pixels: torch.Tensor):
    return engine.step_images(pixels).synchronize()


class StepThread:
    """A CPU step running in the step thread, with LazyTensor's ready / synchronize / await."""

    def __init__(self, future):
        self.future = future

    def ready(self) -> bool:
        return self.future.done()

    def synchronize(self):
        return self.future.result()

    def __await__(self):
        return asyncio.wrap_future(self.future).__await__()
