"""A/B of clients against one Tulip, paired request by request: which client (or which revision
of `trellis.client`) is faster, on a machine too noisy for separate runs to tell.

    python -m benchmarks.clientab [--trees NAME=PATH,...] [--proto] [--loops uvloop,asyncio]
        [--transports stream,unary] [--rounds 5] [--n 2000] [--device-ms 1] [--timeout S] [--out FILE.jsonl]

One Tulip over `benchmarks.hop`'s null engine (a step of `--device-ms`), served once for the whole
run. Each round, for each (loop, transport), one client process opens every client under test
(one `trellis.client.TulipClient` per tree in `--trees`, each imported from that tree's
`trellis/client.py`, e.g. an old revision unpacked with `git archive`; and with `--proto`,
`benchmarks.protoclient`'s grpc.aio client) and sends the same 1 x 128 request one at a time,
the clients taking turns in a fresh random order for every request, so drift on the machine
falls on all of them alike. `TulipClient.embed` is called as `benchmarks.hop` calls it (with
`--timeout`, as Ivy calls it: with a deadline). One JSON line per (client, loop, transport,
round): p50 / p99 / mean, and the main thread's CPU per request; then one per cell with the
median of the rounds' p50s (`bench: "clientab-summary"`). With `--pin` (default where there are
at most 4 CPUs) the server runs on CPU 0 and the clients on CPU 1.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
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


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _client_file(tree: Path) -> Path:
    """A tree's client: trellis/client.py, or tulip/client.py in a tree from before it moved (whose imports,
    tulip.h2stream and tulip.spin, are then looked up in this tree and are not found: time it from its own tree)."""
    new = tree / "trellis" / "client.py"
    return new if new.is_file() else tree / "tulip" / "client.py"


async def _open(name: str, path: str | None, target: str, transport: str, timeout: float | None):
    """(one request, close) for one client under test."""
    import numpy as np

    if path is None:  # the proto-only client
        import grpc

        from benchmarks import protoclient
        from trellis.tulip.v1 import tulip_pb2_grpc

        ch = grpc.aio.insecure_channel(target)
        stub, req = tulip_pb2_grpc.TulipStub(ch), protoclient.make_request(128)
        if transport == "unary":
            async def one(i):
                return await stub.Embed(req, timeout=timeout)
        else:
            call = stub.EmbedStream()

            async def one(i):
                req.request_id = str(i)
                await call.write(req)
                return await call.read()
        return one, ch.close
    c = _load(f"_clientab_{name}", path).TulipClient(target, transport=transport)
    seq = [np.arange(5, 133, dtype=np.int32)]

    async def one(i):
        return await c.embed(seq, timeout=timeout)
    return one, c.close


async def _paired(target: str, transport: str, n: int, warmup: int, timeout, clients: dict) -> dict:
    opened = {name: await _open(name, path, target, transport, timeout) for name, path in clients.items()}
    names = list(opened)
    for i in range(warmup):
        for name in names:
            await opened[name][0](i)
    ts = {name: [] for name in names}
    cpu = dict.fromkeys(names, 0.0)
    rng = random.Random(0)
    for i in range(n):
        rng.shuffle(names)
        for name in names:
            c0, t0 = time.thread_time(), time.perf_counter()
            await opened[name][0](warmup + i)
            ts[name].append((time.perf_counter() - t0) * 1e3)
            cpu[name] += time.thread_time() - c0
    for _, close in opened.values():
        await close()
    from benchmarks.protoclient import stats

    return {name: {**stats(ts[name]), "main_thread_cpu_us": round(cpu[name] / n * 1e6, 1)} for name in ts}


def client_main(args) -> int:
    """One (loop, transport) of one round, in this process: print {client: stats}."""
    if args.loop == "uvloop":
        import uvloop

        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    clients = json.loads(args.clients)
    print(json.dumps(loop.run_until_complete(_paired(args.target, args.transport, args.n, args.warmup,
                                                     args.timeout, clients))), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default=f"this={ROOT}", help="NAME=PATH,... source trees whose trellis/client.py to time")
    ap.add_argument("--proto", action=argparse.BooleanOptionalAction, default=True, help="also the proto-only client")
    ap.add_argument("--loops", default="uvloop")
    ap.add_argument("--transports", default="stream,unary")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=None, help="each request's deadline, seconds (default none)")
    ap.add_argument("--device-ms", type=float, default=1.0)
    ap.add_argument("--spin-ms", type=float, default=10.0, help="Tulip's --spin-ms")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) <= 4)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)  # one cell (the parent runs these)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--loop", help=argparse.SUPPRESS)
    ap.add_argument("--transport", help=argparse.SUPPRESS)
    ap.add_argument("--clients", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        return client_main(args)

    from benchmarks.common import environment, free_port
    from benchmarks.hop import _serve, _wait_ready

    clients = {name: str(_client_file(Path(path))) for name, path in (t.split("=", 1) for t in args.trees.split(","))}
    if args.proto:
        clients["proto"] = None
    cells = [(lp, tr) for lp in args.loops.split(",") for tr in args.transports.split(",")]
    env = environment()
    port, uds = free_port(), Path(tempfile.mkdtemp()) / "tulip.sock"
    ctx = mp.get_context("spawn")
    ready, cmd = ctx.Queue(), ctx.Queue()
    mine = os.sched_getaffinity(0)
    if args.pin:
        os.sched_setaffinity(0, {0})  # the spawned server inherits CPU 0
    p = ctx.Process(target=_serve, args=("tulip", port, str(uds), dict(model="", device_ms=args.device_ms,
                                         spin_ms=args.spin_ms, n=200, profile=""), ready, cmd), daemon=True)
    p.start()
    os.sched_setaffinity(0, mine)
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")

    common = dict(device_ms=args.device_ms, spin_ms=args.spin_ms, timeout_s=args.timeout, pinned=args.pin,
                  n=args.n, **env)
    try:
        in_process = _wait_ready(p, ready, 900)
        emit({"bench": "clientab", "client": "in-process engine loop", **in_process, **common})
        for rnd in range(args.rounds):
            for loop, transport in random.Random(rnd).sample(cells, len(cells)):
                pre = ["taskset", "-c", "1"] if args.pin else []
                r = subprocess.run(pre + [sys.executable, "-m", "benchmarks.clientab", "--client", "--target",
                                          f"127.0.0.1:{port}", "--loop", loop, "--transport", transport,
                                          "--n", str(args.n), "--warmup", str(args.warmup),
                                          "--clients", json.dumps(clients)]
                                   + (["--timeout", str(args.timeout)] if args.timeout else []),
                                   cwd=ROOT, capture_output=True, text=True, timeout=1800,
                                   env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))))
                if r.returncode:
                    raise RuntimeError(f"client ({loop}, {transport}) exited {r.returncode}: {r.stderr[-2000:]}")
                for name, stats in json.loads(r.stdout.strip().splitlines()[-1]).items():
                    emit({"bench": "clientab", "round": rnd, "client": name, "loop": loop, "transport": transport,
                          **common, **stats})
        for loop, transport in cells:
            for name in clients:
                p50s = [r["p50_ms"] for r in rows if r.get("round") is not None and r["client"] == name
                        and r["loop"] == loop and r["transport"] == transport]
                emit({"bench": "clientab-summary", "client": name, "loop": loop, "transport": transport,
                      "rounds": len(p50s), "median_p50_ms": round(statistics.median(p50s), 4), "p50s_ms": p50s,
                      "in_process_p50_ms": in_process.get("p50_ms"), **common})
    finally:
        p.terminate()
        p.join(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
