"""Warm-up before serving: on CUDA the kernels of every step shape class compiled (`warm_up`,
`shape_classes`, `class_batches`), then the --warmup shapes run (eager, capture, replay)."""

from __future__ import annotations

import logging
import time

import numpy as np

from rose.batch import Batch
from rose.engine import Engine
from tulip.config import warmup_shapes

log = logging.getLogger("tulip")




def shape_classes(max_len: int, max_tokens: int) -> list[tuple[int, int]]:
    """Every (sequences, length) class a step of at most `max_tokens` tokens can fall in
    (`rose.kernels.shape_class`: both rounded up to powers of two, lengths from 64 to the model's longest),
    longest first. A class's sequences may be one token each but its longest: N up to `max_tokens`."""
    lengths, length = [], 64
    while length < max_len:
        lengths.append(length)
        length *= 2
    lengths.append(max_len)
    out = []
    for length in reversed(lengths):
        n = 1
        while length + n // 2 <= max(max_tokens, max_len):  # its fewest tokens: n // 2 + 1 sequences
            out.append((n, length))
            n *= 2
    return out


def class_batches(n: int, length: int, max_tokens: int) -> list[Batch]:
    """Steps of shape class (n, length): n sequences of `length` tokens where they fit the budget, and the
    class's fewest tokens: one sequence of `length` and n // 2 of one token (a token count no multiple of
    16: Triton compiles integer arguments divisible by 16 apart)."""
    seqs = [np.full(length, 5, dtype=np.int64)] + [np.full(1, 5, dtype=np.int64)] * (n // 2)
    out = [Batch.from_sequences(seqs)]
    if n > 1 and n * length <= max_tokens:
        out.append(Batch.from_sequences([seqs[0]] * n))
    return out


def warm_up(engine: Engine, specs: tuple[str, ...], max_tokens: int = 16384) -> None:
    """On CUDA, first run one eager step of every shape class (`shape_classes` of steps up to `max_tokens`, the
    step budget: Tulip's --max-batch-tokens): the kernels a class
    launches (ROSE's Triton attention takes its tile from the class, and Triton compiles each variant on
    its first launch) are compiled before serving, not in front of the first caller whose request has
    that shape. Before this, ten 16,000-token `truncate: "chunk"` requests on an H100 (bge-m3's 8,192-token
    class, its first time) cost an independent caller 1,930 ms; the same attack again, compiled: 306-369 ms
    (benchmarks/attacks/ivy.py). Triton's on-disk cache makes a restart's compile cheap.
    Then run each --warmup shape (`warmup_shapes`: N sequences of L tokens, with the outputs after "+")
    three times: eager, capture, replay (and in the online lane where the engine has one). A model without an asked output raises ValueError."""
    if engine.device.type == "cuda":
        t0 = time.perf_counter()
        classes = shape_classes(engine.spec.max_seq_len, max_tokens)
        for n, length in classes:
            for batch in class_batches(n, length, max_tokens):
                engine.step(batch).synchronize()
        log.info("compiled the kernels of %d shape classes in %.1f s", len(classes), time.perf_counter() - t0)
    for n, length, extras in warmup_shapes(specs):
        length = min(length, engine.spec.max_seq_len)
        batch = Batch.from_sequences([np.full(length, 5, dtype=np.int64)] * n)
        t0 = time.perf_counter()
        for urgent in (False, True) if engine.lane is not None else (False,):  # the online lane's graphs too
            for _ in range(3):
                engine.step(batch, extras, urgent=urgent).synchronize()
        log.info("warmed up %dx%d%s in %.0f ms", n, length, "".join(f"+{e}" for e in sorted(extras)),
                 (time.perf_counter() - t0) * 1e3)
