"""How gRPC's core does its I/O in every Trellis process (Tulip, Ivy, their clients).

grpcio's default (its EventEngine) reads and writes sockets on threads of its own, which hand each
completion on to the thread that waits on the completion queue (grpc.aio's poller), which wakes the
event loop: two thread wake-ups per message each way. With the EventEngine client and listener
turned off (`GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener`), the thread waiting on the
completion queue polls the sockets itself (grpc's iomgr, its long-standing default): one wake-up
fewer each way. Measured on a 2-core machine (`benchmarks.hop`, 3 alternating runs of 2,000 requests):
a bare grpc.aio echo's p50 / p99 fell from 0.20 / 0.98 to 0.17 / 0.34 ms on a stream and from
0.91 / 9.1 to 0.61 / 2.2 ms unary.

grpc reads the variable once, when it is first imported, so `use_inline_io()` must run before that:
`tulip` and `ivy` call it on import (their `__init__`); where grpc is already imported it does
nothing. It never overrides a `GRPC_EXPERIMENTS` already set: `GRPC_EXPERIMENTS=` (empty) keeps
grpc's own default. Child processes inherit it.
"""

from __future__ import annotations

import os
import sys

EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def use_inline_io() -> bool:
    """Ask grpc (not imported yet) to poll sockets on its completion-queue thread; True if it will."""
    if "grpc" in sys.modules:
        return os.environ.get("GRPC_EXPERIMENTS") == EXPERIMENTS
    os.environ.setdefault("GRPC_EXPERIMENTS", EXPERIMENTS)
    return os.environ["GRPC_EXPERIMENTS"] == EXPERIMENTS
