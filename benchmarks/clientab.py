"""A/B of clients against one Tulip: which client (or which revision of `tulip.client`) is faster.

    python -m benchmarks.clientab [--trees NAME=PATH,...] [--variants tulip,proto] [--loops uvloop,asyncio]
        [--transports stream,unary] [--rounds 5] [--n 2000] [--device-ms 1] [--out FILE.jsonl]

One Tulip over `benchmarks.hop`'s null engine (a step of `--device-ms`), served once for the whole
run, and the same 1 x 128 request sent one at a time by clients each in a process of its own:
`tulip` (`tulip.client.TulipClient`, as `benchmarks.hop` calls it: `embed` of one int32 row) and
`proto` (`benchmarks.protoclient`'s asyncio client: grpcio and the stubs only), on uvloop or on
asyncio's default loop, over `stream` or `unary`. `--trees` names source trees whose
`tulip.client` is imported (the server always runs this tree's Tulip), e.g. an old revision
unpacked with `git archive`. Every cell is run once per round, in a fresh order per round, so
A and B are interleaved; one JSON line per (cell, round) and then one per cell with the median
of the rounds' p50s (`bench: "clientab-summary"`). On a machine with few cores, `--pin` (default
on where there are at most 4) puts the server on CPU 0 and the clients on CPU 1.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


async def _tulip(target: str, transport: str, n: int, warmup: int) -> list[float]:
    import numpy as np

    from tulip.client import TulipClient

    seq = [np.arange(5, 133, dtype=np.int32)]
    async with TulipClient(target, transport=transport) as c:
        ts = []
        for i in range(warmup + n):
            t0 = time.perf_counter()
            await c.embed(seq)
            ts.append((time.perf_counter() - t0) * 1e3)
    return ts[warmup:]


def client_main(args) -> int:
    """One cell, in this process: print {"p50_ms", ...}."""
    import asyncio

    from benchmarks import protoclient

    if args.loop == "uvloop":
        import uvloop

        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    if args.variant == "tulip":
        coro = _tulip(args.target, args.transport, args.n, args.warmup)
    else:
        run = protoclient.aio_stream if args.transport == "stream" else protoclient.aio_unary
        coro = run(args.target, protoclient.make_request(128), args.n, args.warmup, 128)
    ts = loop.run_until_complete(coro)
    print(json.dumps(protoclient.stats(ts)), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default=f"this={ROOT}", help="NAME=PATH,... source trees of tulip.client")
    ap.add_argument("--variants", default="tulip,proto")
    ap.add_argument("--loops", default="uvloop")
    ap.add_argument("--transports", default="stream,unary")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--device-ms", type=float, default=1.0)
    ap.add_argument("--spin-ms", type=float, default=10.0, help="Tulip's --spin-ms")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) <= 4)
    ap.add_argument("--out", type=Path, default=None)
    # one cell (internal: how the parent runs each client)
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--loop", help=argparse.SUPPRESS)
    ap.add_argument("--transport", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        return client_main(args)

    from benchmarks.common import environment, free_port
    from benchmarks.hop import _serve, _wait_ready

    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    cells = [(tree, v, lp, tr) for tree in trees for v in args.variants.split(",") for lp in args.loops.split(",")
             for tr in args.transports.split(",")]
    cells = [c for i, c in enumerate(cells) if c[1] == "tulip" or c[1:] not in [d[1:] for d in cells[:i]]]  # proto once
    env = environment()
    port, uds = free_port(), Path(tempfile.mkdtemp()) / "tulip.sock"
    ctx = mp.get_context("spawn")
    ready, cmd = ctx.Queue(), ctx.Queue()
    serve_args = dict(model="", device_ms=args.device_ms, spin_ms=args.spin_ms, n=200, profile="")
    mine = os.sched_getaffinity(0)
    if args.pin:
        os.sched_setaffinity(0, {0})  # the spawned server inherits CPU 0
    p = ctx.Process(target=_serve, args=("tulip", port, str(uds), serve_args, ready, cmd), daemon=True)
    p.start()
    os.sched_setaffinity(0, mine)
    out = args.out.open("a") if args.out else None
    p50s: dict[tuple, list[float]] = {c: [] for c in cells}
    try:
        in_process = _wait_ready(p, ready, 900)
        print(json.dumps({"bench": "clientab-in-process", **in_process, **env}), flush=True)
        for rnd in range(args.rounds):
            order = cells[:]
            random.Random(rnd).shuffle(order)
            for cell in order:
                tree, variant, loop, transport = cell
                pre = ["taskset", "-c", "1"] if args.pin else []
                r = subprocess.run(pre + [sys.executable, "-m", "benchmarks.clientab", "--client", "--target",
                                          f"127.0.0.1:{port}", "--variant", variant, "--loop", loop, "--transport",
                                          transport, "--n", str(args.n), "--warmup", str(args.warmup)],
                                   cwd=ROOT, capture_output=True, text=True, timeout=900,
                                   env=dict(os.environ, PYTHONPATH=f"{trees[tree]}:{ROOT}"))
                if r.returncode:
                    raise RuntimeError(f"client {cell} exited {r.returncode}: {r.stderr[-2000:]}")
                stats = json.loads(r.stdout.strip().splitlines()[-1])
                p50s[cell].append(stats["p50_ms"])
                row = {"bench": "clientab", "round": rnd, "tree": tree if variant == "tulip" else None,
                       "client": "tulip.client" if variant == "tulip" else "proto", "loop": loop,
                       "transport": transport, "device_ms": args.device_ms, "pinned": args.pin, **stats, **env}
                print(json.dumps(row), flush=True)
                if out:
                    out.write(json.dumps(row) + "\n")
        for cell, v in p50s.items():
            tree, variant, loop, transport = cell
            row = {"bench": "clientab-summary", "tree": tree if variant == "tulip" else None,
                   "client": "tulip.client" if variant == "tulip" else "proto", "loop": loop, "transport": transport,
                   "rounds": len(v), "n": args.n, "median_p50_ms": round(statistics.median(v), 4),
                   "p50s_ms": v, "in_process_p50_ms": in_process.get("p50_ms"), "device_ms": args.device_ms,
                   "pinned": args.pin, **env}
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
    finally:
        if out:
            out.close()
        p.terminate()
        p.join(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
