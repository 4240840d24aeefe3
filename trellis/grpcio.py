"""How gRPC's core does its I/O in Tulip's server process.

grpcio's default (its EventEngine) reads and writes sockets on threads of its own, which hand each
completion on to the thread that waits on the completion queue (grpc.aio's poller), which wakes the
event loop: two thread wake-ups per message each way. With the EventEngine client and listener
turned off (`GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener`), the thread waiting on the
completion queue polls the sockets itself (grpc's iomgr, its long-standing default): one wake-up
fewer each way. Measured on a 2-core machine (`benchmarks.hop`, 3 alternating runs of 2,000 requests):
a bare grpc.aio echo's p50 / p99 fell from 0.20 / 0.98 to 0.17 / 0.34 ms on a stream and from
0.91 / 9.1 to 0.61 / 2.2 ms unary. On an H200 host (`benchmarks.tailab`, one run of 2,000 requests per
variant, the setting in every process: `benchmarks/results/request_path/tail/`), Tulip over a 1 ms
null step: stream p50 1.739 -> 1.534 ms (tulip.client), 1.693 -> 1.426 (the proto-only client); unary
2.022 -> 1.919, 2.088 -> 1.864.

Where: `python -m tulip` (`tulip.__main__`), before anything imports grpc. Not Ivy: on the 2-core
machine one Ivy worker at 16 clients served 783 req/s with it against 1,090 without (7 runs each),
and on an H200 host (4 workers, real Tulip, two rounds: `results/request_path/ivy_h200/README.md`)
it gained nothing at 1 client (2.59 / 2.69 ms p50 against 2.46 / 2.77) nor at 16; the setting is per
process, so Ivy keeps grpc's default.
`use_inline_io()` does nothing where grpc is already imported, and never overrides a
`GRPC_EXPERIMENTS` already set: `GRPC_EXPERIMENTS=` (empty) keeps grpc's own default.
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
