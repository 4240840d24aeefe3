"""Choosing the attention backend per batch shape from a table the kernel sweep wrote
(`python -m benchmarks.kernels`): for each (sequences, max length) cell, the fastest backend.

The choice is made on the host in `prepare()`, before a step runs or a graph is captured, from the
step's shape class (`rose.kernels.shape_class`): for a graph key it depends only on the
key, so a captured graph always replays the backend it captured, and an eager step of the same
batch takes the same backend.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np

from rose.kernels import shape_class
from rose.layers.attention import AttentionBackend

log = logging.getLogger(__name__)


class TableBackend(AttentionBackend):
    name = "table"

    def __init__(self, cells: list[dict], backends: dict[str, AttentionBackend], fallback: AttentionBackend):
        self.cells = [c for c in cells if c["winner"] in backends]
        self.backends = backends
        self.fallback = fallback
        self.name = "table(" + "+".join(sorted({c["winner"] for c in self.cells})) + ")"
        self.capturable = fallback.capturable and all(b.capturable for b in backends.values())
        # the fallback serves only a table without cells: with cells, the winners decide (a windowed
        # model on a torch whose varlen has no window_size keeps Triton's windows, and its graphs)
        self.windowed = all(backends[c["winner"]].windowed for c in self.cells) if self.cells else fallback.windowed
        self._current = fallback
        self._picks: dict[tuple[int, int], AttentionBackend] = {}  # shape class -> winner: steps pay a lookup

    def pick(self, seqs: int, max_len: int) -> AttentionBackend:
        """The winner of the nearest cell (max length first, then sequence count, in log scale)."""
        if not self.cells:
            return self.fallback

        def distance(c):
            return (abs(math.log2(c["max_len"]) - math.log2(max(max_len, 1))),
                    abs(math.log2(c["seqs"]) - math.log2(max(seqs, 1))))

        return self.backends[min(self.cells, key=distance)["winner"]]

    def prepare(self, key, cu_host, num_tokens):
        if key is not None:
            shape = shape_class(key.seqs, key.max_len)
        else:
            shape = shape_class(len(cu_host) - 1, int(np.diff(cu_host).max()))
        b = self._picks.get(shape)
        if b is None:
            b = self._picks[shape] = self.pick(*shape)
        self._current = b
        b.prepare(key, cu_host, num_tokens)

    def __call__(self, q, k, v, meta):
        return self._current(q, k, v, meta)


def table_file(heads: tuple[int, int, int], causal: bool = False) -> str:
    """The file name the kernel sweep gives the table of a head shape (q heads, kv heads, head dim),
    with "_causal" for a causal sweep's."""
    return "attention_table_{}x{}x{}{}.json".format(*heads, "_causal" if causal else "")


def load_table(path: Path, heads: tuple[int, int, int], causal: bool, make_backend, fallback) -> AttentionBackend:
    """A TableBackend from `path` (a table, or a directory holding the sweep's tables: the one for
    `heads` is used), or `fallback` (with a log line) when there is none or it does not fit.

    make_backend(name) builds a backend or raises (not installed / unsupported). A cell whose winner
    is unavailable here takes the fastest backend that is (its `tokens_per_s`), so a table swept with
    an optional backend (FlashAttention 4) still fits a machine without it; a cell with none is dropped.
    """
    path = Path(path)
    if path.is_dir():
        path = path / table_file(heads, causal)
        if not path.is_file():
            log.warning("no attention table for heads %s (causal %s) in %s; using %s", heads, causal, path.parent,
                        fallback.name)
            return fallback
    table = json.loads(path.read_text())
    if tuple(table.get("heads", ())) != tuple(heads) or bool(table.get("causal")) != causal:
        log.warning("attention table %s is for heads %s causal=%s, not %s causal=%s; using %s", path,
                    table.get("heads"), table.get("causal"), heads, causal, fallback.name)
        return fallback
    backends, missing = {}, set()

    def available(name: str) -> bool:
        if name not in backends and name not in missing:
            try:
                backends[name] = make_backend(name)
            except (ImportError, ValueError) as e:
                missing.add(name)
                log.info("attention table: %s unavailable here (%s); its cells take the next fastest", name, e)
        return name in backends

    cells = []
    for c in table["cells"]:
        speed = c.get("tokens_per_s") or {c["winner"]: 1.0}
        best = next((n for n in sorted(speed, key=speed.get, reverse=True) if available(n)), None)
        if best is not None:
            cells.append({**c, "winner": best})
    if not cells:
        log.warning("attention table %s: none of its backends is available here; using %s", path, fallback.name)
        return fallback
    return TableBackend(cells, backends, fallback)


# The choice without a swept table (attention "auto" on CUDA in half precision): the H200 sweep's tables
# for the head shapes ROSE's presets use, shipped beside this file (`attention_tables/`, written by
# `python -m benchmarks.kernels` on 2026-12-03 with FlashAttention 4 4.0.0b40 installed; the run is in
# benchmarks/results/2026-12-02_h200_attention-sweep/). Bidirectional, bge-m3's heads (16 x 64): ROSE's Triton kernel
# to 512 tokens (and one sequence of 1,024), FlashAttention 4 beyond (1 x 4096: 1.32x, which took the
# engine's step from 9.23 to 8.05 ms); pplx-embed's (16 query / 8 kv x 128): FA4 everywhere but one
# sequence of 128 tokens (1 x 4096: 1.60x; the step from 16.96 to 13.91 ms). Each cell keeps every
# backend's tokens/s, so where FA4 is not installed its cells take the next fastest: Triton. Every other
# head shape, and causal models (the 12-02 sweeps of e5-mistral's and gte-Qwen2's heads, 1.2-3.2x over
# torch's varlen), take Triton at every shape: `BUILTIN_CELLS`.
BUILTIN_TABLES = Path(__file__).parent / "attention_tables"
BUILTIN_CELLS = [{"seqs": 1, "max_len": 128, "winner": "triton"}]


def builtin_table(make_backend, fallback: AttentionBackend, heads: tuple[int, int, int] = (0, 0, 0),
                  causal: bool = False) -> AttentionBackend:
    """The shipped table for `heads` (`BUILTIN_TABLES`) over Triton at every shape (`BUILTIN_CELLS`),
    over `fallback` (torch's varlen); `fallback` alone where the Triton kernel cannot run here, or
    where `fallback` is not varlen (no CUDA half precision: left as it is)."""
    if fallback.name != "varlen":
        return fallback
    try:
        triton = make_backend("triton")
    except (ImportError, ValueError) as e:
        log.info("attention: no triton backend here (%s); using %s", e, fallback.name)
        return fallback
    made = {"triton": triton, "varlen": fallback}
    everywhere = TableBackend(BUILTIN_CELLS, made, fallback)
    shipped = BUILTIN_TABLES / table_file(heads, causal)
    if not shipped.is_file():
        return everywhere
    return load_table(shipped, heads, causal, lambda name: made.get(name) or make_backend(name), everywhere)
